"""workers/checkpoint.py on an object store (a real S3-compatible server, moto's server
mode, over HTTP): written in place, sealed by the manifest and then LATEST, never loaded
without a verified manifest, never pruned while being written; the sharded strategies
write through torch.distributed.checkpoint's fsspec path."""

from __future__ import annotations

import hashlib
import os
import traceback

import fsspec
import pytest
import torch.multiprocessing as mp

from workers import checkpoint as ckpt
from workers import storage


def make(run_dir, step, payload=None, *, seal=True):
    tmp = ckpt.tmp_dir(run_dir, step)
    ckpt.write_shard(tmp, "state.pt", {"step": step, "payload": payload if payload is not None else [step] * 64})
    ckpt.write_shard(tmp, "rng-rank0.pt", {"seed": step})
    return ckpt.commit(run_dir, step, {"epoch": step // 10, "world_size": 1}) if seal else tmp


def keys(uri):
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    base = uri.split("://", 1)[1]
    return sorted(p[len(base) + 1:] for p in fs.find(base))


@pytest.fixture
def run_dir(s3_bucket, tmp_path, monkeypatch):
    # Anything written to the local disk by mistake would land under the working directory
    # (a path "s3:/..." taken for a relative one): run from an empty one, and check it stays so.
    monkeypatch.chdir(tmp_path)
    yield f"{s3_bucket}/runs/job-1"
    assert os.listdir(tmp_path) == [], "nothing of an object-store run may be written to the local disk"


def test_a_checkpoint_is_written_in_place_and_sealed_by_its_manifest_then_latest(run_dir):
    assert ckpt.tmp_dir(run_dir, 10) == ckpt.path_of(run_dir, 10)  # no rename on an object store
    path = make(run_dir, 10)
    assert path == f"{run_dir}/checkpoints/step-000010"
    assert keys(run_dir) == ["checkpoints/LATEST", "checkpoints/step-000010/manifest.json",
                             "checkpoints/step-000010/rng-rank0.pt", "checkpoints/step-000010/state.pt"]
    manifest = ckpt.read_manifest(path)
    assert manifest.step == 10 and manifest.epoch == 1 and sorted(manifest.files) == ["rng-rank0.pt", "state.pt"]
    for name, info in manifest.files.items():
        data = storage.read_bytes(f"{path}/{name}")
        assert (info.bytes, info.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert storage.read_bytes(f"{run_dir}/checkpoints/LATEST").decode().strip() == "step-000010"
    assert ckpt.latest(run_dir) == (10, path)
    assert ckpt.load_shard(path, "state.pt")["payload"] == [10] * 64

    newer = make(run_dir, 20)
    assert ckpt.latest(run_dir) == (20, newer) and ckpt.committed_steps(run_dir) == [20, 10]


def test_a_checkpoint_crashed_mid_write_is_never_loaded_nor_pruned_and_the_next_attempt_clears_it(run_dir):
    make(run_dir, 10)
    make(run_dir, 20)
    # The crash: shards of step 30 are in the store, the manifest never came.
    partial = make(run_dir, 30, seal=False)
    assert ckpt.latest(run_dir)[0] == 20
    assert ckpt.read_manifest(partial, verify=False) is None

    assert ckpt.prune(run_dir, keep=1) == [10]  # a directory being written is never pruned
    assert ckpt.committed_steps(run_dir) == [30, 20]

    ckpt.clear_partial(run_dir)  # the next attempt, before any rank writes
    assert ckpt.committed_steps(run_dir) == [20]
    # Step 30 is written again into a clean prefix and commits.
    path = make(run_dir, 30, payload="replayed")
    assert ckpt.latest(run_dir) == (30, path)
    assert ckpt.load_shard(path, "state.pt")["payload"] == "replayed"


def test_a_damaged_shard_is_never_loaded_the_one_before_is_and_the_damaged_one_is_set_aside(run_dir):
    make(run_dir, 10)
    path = make(run_dir, 20)
    original = storage.read_bytes(f"{path}/state.pt")
    storage.write_bytes(f"{path}/state.pt", bytes([original[0] ^ 1]) + original[1:])  # same size
    assert ckpt.read_manifest(path) is None
    assert ckpt.latest(run_dir)[0] == 10
    assert storage.read_bytes(f"{run_dir}/checkpoints/LATEST").decode().strip() == "step-000020"

    ckpt.clear_partial(run_dir)
    assert ckpt.committed_steps(run_dir) == [10]
    assert any(k.startswith("checkpoints/.unloadable-step-000020-") for k in keys(run_dir))
    make(run_dir, 20, payload="again")
    assert ckpt.latest(run_dir)[0] == 20
    assert ckpt.load_shard(ckpt.latest(run_dir)[1], "state.pt")["payload"] == "again"


def test_pruning_never_removes_what_latest_names(run_dir):
    make(run_dir, 10)
    make(run_dir, 20)
    # A crash after step 30's manifest, before LATEST moved: LATEST still names 20.
    partial = make(run_dir, 30, seal=False)
    storage.write_bytes(f"{partial}/manifest.json", ckpt.Manifest(
        step=30, files={n: ckpt.ManifestFile(bytes=storage.size(f"{partial}/{n}"),
                                             sha256=hashlib.sha256(storage.read_bytes(f"{partial}/{n}")).hexdigest())
                        for n in ("state.pt", "rng-rank0.pt")}).model_dump_json().encode())
    assert ckpt.latest(run_dir)[0] == 30
    assert ckpt.prune(run_dir, keep=1) == [10]
    assert ckpt.committed_steps(run_dir) == [30, 20]


def test_a_manifest_that_does_not_parse_seals_nothing(run_dir):
    make(run_dir, 10)
    path = make(run_dir, 20)
    storage.write_bytes(f"{path}/manifest.json", b'{"step": 20, "files": ')
    assert ckpt.latest(run_dir)[0] == 10


def _rank(rank: int, world: int, store: str, uri: str, env: dict, results) -> None:
    os.environ.update(env, OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    from torch import nn

    from workers.strategies.fsdp import FSDP

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        def model_and_optimizer(seed):
            torch.manual_seed(seed)
            strategy = FSDP()
            strategy.setup(torch.device("cpu"), rank, world)
            model = strategy.wrap(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
            return strategy, model, torch.optim.AdamW(model.parameters(), lr=0.1)

        strategy, model, optimizer = model_and_optimizer(seed=1)
        model(torch.randn(8, 16)).sum().backward()
        optimizer.step()
        for step, background in ((10, False), (20, True)):
            directory = ckpt.tmp_dir(uri, step)
            strategy.save_state(directory, model, optimizer, background=background)
            strategy.wait_saved(block=True)
            dist.barrier()
            if rank == 0:
                ckpt.commit(uri, step, {"world_size": world})
            dist.barrier()
        saved = strategy.full_state_dict(model)

        step, path = ckpt.latest(uri)
        other, fresh, fresh_optimizer = model_and_optimizer(seed=2)
        other.load_state(path, fresh, fresh_optimizer, {})
        loaded = other.full_state_dict(fresh)
        same = rank != 0 or (saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved))
        results.put((rank, "ok", (step, same)))
    except BaseException as e:
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def test_fsdp_shards_go_through_dcp_to_the_object_store_and_load_back(run_dir, s3_server, tmp_path_factory):
    store = str(tmp_path_factory.mktemp("store") / "pg")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, store, run_dir, s3_server.env, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        outs = sorted(results.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert all(o[1] == "ok" for o in outs), outs
    assert [o[2] for o in outs] == [(20, True), (20, True)]
    names = keys(run_dir)
    assert "checkpoints/step-000020/.metadata" in names and "checkpoints/step-000020/manifest.json" in names
    assert sum(n.startswith("checkpoints/step-000020/") and n.endswith(".distcp") for n in names) == 2
    manifest = ckpt.read_manifest(f"{run_dir}/checkpoints/step-000020")
    assert ".metadata" in manifest.files and len(manifest.files) == 3
