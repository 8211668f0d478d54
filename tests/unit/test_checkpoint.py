"""workers/checkpoint.py: atomic commit, LATEST, fallback past damage, retention."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from workers import checkpoint as ckpt


def make(run_dir, step, payload=None):
    """Write the shards of one checkpoint the way the loop does, then commit it."""
    tmp = ckpt.tmp_dir(str(run_dir), step)
    ckpt.write_shard(tmp, "state.pt", {"step": step, "payload": payload if payload is not None else [step] * 64})
    ckpt.write_shard(tmp, "rng-rank0.pt", {"seed": step})
    return ckpt.commit(str(run_dir), step, {"epoch": step // 10, "world_size": 1})


def latest_step(run_dir):
    found = ckpt.latest(str(run_dir))
    return None if found is None else found[0]


def read_latest_file(run_dir):
    return (run_dir / "checkpoints" / "LATEST").read_text().strip()


def test_commit_makes_a_sealed_step_directory(tmp_path):
    path = make(tmp_path, 10)
    root = tmp_path / "checkpoints"
    assert path == str(root / "step-000010")
    assert sorted(os.listdir(path)) == ["manifest.json", "rng-rank0.pt", "state.pt"]
    assert not (root / ".tmp-step-000010").exists()
    manifest = json.loads((root / "step-000010" / "manifest.json").read_text())
    assert manifest["step"] == 10 and manifest["epoch"] == 1 and manifest["world_size"] == 1
    assert sorted(manifest["files"]) == ["rng-rank0.pt", "state.pt"]
    for name, info in manifest["files"].items():
        data = (root / "step-000010" / name).read_bytes()
        assert info["bytes"] == len(data)
        assert info["sha256"] == hashlib.sha256(data).hexdigest()
    assert read_latest_file(tmp_path) == "step-000010"
    assert ckpt.latest(str(tmp_path)) == (10, path)
    assert ckpt.load_shard(path, "state.pt")["step"] == 10


def test_commit_replaces_latest(tmp_path):
    make(tmp_path, 10)
    path = make(tmp_path, 20)
    assert read_latest_file(tmp_path) == "step-000020"
    assert ckpt.latest(str(tmp_path)) == (20, path)
    assert not (tmp_path / "checkpoints" / ".LATEST.tmp").exists()
    assert ckpt.committed_steps(str(tmp_path)) == [20, 10]


def test_recommitting_a_step_replaces_it(tmp_path):
    make(tmp_path, 10, payload="first")
    path = make(tmp_path, 10, payload="replayed")
    assert ckpt.load_shard(path, "state.pt")["payload"] == "replayed"
    assert ckpt.latest(str(tmp_path)) == (10, path)


def test_no_checkpoints_means_none(tmp_path):
    assert ckpt.latest(str(tmp_path)) is None  # no checkpoints/ at all
    (tmp_path / "checkpoints").mkdir()
    assert ckpt.latest(str(tmp_path)) is None


def test_a_temporary_directory_is_never_returned(tmp_path):
    make(tmp_path, 10)
    tmp = ckpt.tmp_dir(str(tmp_path), 20)
    ckpt.write_shard(tmp, "state.pt", {"step": 20})
    assert os.path.basename(tmp) == ".tmp-step-000020"
    assert latest_step(tmp_path) == 10
    # Even a temporary whose manifest got written (crash before the rename) is not committed.
    (tmp_path / "checkpoints" / ".tmp-step-000020" / "manifest.json").write_text(
        json.dumps({"step": 20, "files": {}})
    )
    assert latest_step(tmp_path) == 10
    assert ckpt.committed_steps(str(tmp_path)) == [10]


def test_a_step_directory_without_manifest_is_skipped(tmp_path):
    make(tmp_path, 10)
    make(tmp_path, 20)
    os.remove(tmp_path / "checkpoints" / "step-000020" / "manifest.json")
    assert read_latest_file(tmp_path) == "step-000020"  # LATEST still names it
    assert ckpt.latest(str(tmp_path)) == (10, str(tmp_path / "checkpoints" / "step-000010"))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _remove(path):
    os.remove(path)


def _tear_manifest(path):
    manifest = path.parent / "manifest.json"
    manifest.write_text(manifest.read_text()[:20])


@pytest.mark.parametrize("damage", [_truncate, _flip_byte, _remove, _tear_manifest],
                         ids=["truncated", "bytes-changed", "file-missing", "manifest-torn"])
def test_latest_naming_a_damaged_checkpoint_falls_back(tmp_path, damage):
    make(tmp_path, 10)
    make(tmp_path, 20)
    make(tmp_path, 30)
    state = tmp_path / "checkpoints" / "step-000030" / "state.pt"
    size = state.stat().st_size
    damage(state)
    if damage is _flip_byte:
        assert state.stat().st_size == size  # only the checksum can tell
    assert read_latest_file(tmp_path) == "step-000030"
    assert ckpt.read_manifest(str(state.parent)) is None
    assert latest_step(tmp_path) == 20


def test_read_manifest_skips_checksums_when_asked(tmp_path):
    path = make(tmp_path, 10)
    state = tmp_path / "checkpoints" / "step-000010" / "state.pt"
    _flip_byte(state)
    assert ckpt.read_manifest(path) is None
    assert ckpt.read_manifest(path, verify=False).step == 10
    # A size mismatch is caught even without checksums.
    _truncate(state)
    assert ckpt.read_manifest(path, verify=False) is None


def test_newest_sound_checkpoint_wins_over_a_stale_latest(tmp_path):
    make(tmp_path, 10)
    newest = make(tmp_path, 20)
    (tmp_path / "checkpoints" / "LATEST").write_text("step-000010\n")
    assert ckpt.latest(str(tmp_path)) == (20, newest)


def test_latest_naming_a_missing_directory_falls_back(tmp_path):
    make(tmp_path, 10)
    (tmp_path / "checkpoints" / "LATEST").write_text("step-000090\n")
    assert latest_step(tmp_path) == 10


def test_prune_keeps_the_newest_k(tmp_path):
    for step in (10, 20, 30, 40, 50):
        make(tmp_path, step)
    assert ckpt.prune(str(tmp_path), 2) == [30, 20, 10]
    assert ckpt.committed_steps(str(tmp_path)) == [50, 40]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["LATEST", "step-000040", "step-000050"]
    assert latest_step(tmp_path) == 50
    assert ckpt.prune(str(tmp_path), 2) == []
    assert ckpt.prune(str(tmp_path), 5) == []
    assert ckpt.committed_steps(str(tmp_path)) == [50, 40]


def test_prune_does_not_count_unsealed_directories(tmp_path):
    make(tmp_path, 10)
    make(tmp_path, 20)
    os.remove(tmp_path / "checkpoints" / "step-000020" / "manifest.json")
    ckpt.prune(str(tmp_path), 1)
    # keep=1 must still leave one checkpoint that can be resumed from.
    assert latest_step(tmp_path) == 10


def test_clear_partial_removes_temporaries_only(tmp_path):
    make(tmp_path, 10)
    make(tmp_path, 20)
    for step in (30, 40):
        ckpt.write_shard(ckpt.tmp_dir(str(tmp_path), step), "state.pt", {"step": step})
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == [".tmp-step-000030", ".tmp-step-000040", "LATEST", "step-000010",
                                        "step-000020"]
    ckpt.clear_partial(str(tmp_path))
    assert sorted(os.listdir(root)) == ["LATEST", "step-000010", "step-000020"]
    assert latest_step(tmp_path) == 20
    assert ckpt.read_manifest(str(root / "step-000010")) is not None


def test_clear_partial_without_checkpoints_is_a_no_op(tmp_path):
    ckpt.clear_partial(str(tmp_path))
    assert os.listdir(tmp_path) == []


class _Planted:
    """A pickle that runs code when loaded: what a crafted shard on shared storage would hold."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_shard_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    import pickle

    import torch

    marker = tmp_path / "ran"
    (tmp_path / "state.pt").write_bytes(pickle.dumps({"step": 1, "x": _Planted(str(marker))}, protocol=2))
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        ckpt.load_shard(str(tmp_path), "state.pt")
    assert not marker.exists()
    torch.save({"step": 1, "x": _Planted(str(marker))}, tmp_path / "saved.pt")
    marker.unlink(missing_ok=True)
    with pytest.raises(pickle.UnpicklingError):
        ckpt.load_shard(str(tmp_path), "saved.pt")
    assert not marker.exists()


def test_a_ranks_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    import random

    import numpy as np
    import torch

    from workers.checkpointing import rng_state

    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    state = rng_state()
    torch.save(state, tmp_path / "rng-rank0.pt")
    loaded = ckpt.load_shard(str(tmp_path), "rng-rank0.pt")
    assert loaded["python"] == state["python"] and torch.equal(loaded["torch"], state["torch"])
    assert loaded["numpy"][0] == state["numpy"][0] and (loaded["numpy"][1] == state["numpy"][1]).all()
    assert loaded["numpy"][2:] == state["numpy"][2:]
