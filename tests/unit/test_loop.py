"""workers/loop.py without Ray: one process, world size 1, no process group."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from workers import checkpoint, events
from workers.failures import DETERMINISTIC, INFRASTRUCTURE, DeterministicTrainingError
from workers.faults import InjectedFault
from workers.loop import WorkerEnv, train, weights_sha256
from workers.models import build_model
from workers.spec import JobSpec


def job(tmp_path, job_id, size=384, **overrides) -> JobSpec:
    spec = {
        "job_id": job_id,
        "model": "simple_cnn",
        "dataset": {"name": "synthetic", "size": size, "noise": 2.0},
        "workers": 1,
        "training": {"max_steps": 30, "global_batch_size": 32, "seed": 7},
        "checkpoint": {"every_steps": 10, "keep": 3},
        "storage": str(tmp_path),
        **overrides,
    }
    spec = JobSpec.model_validate(spec)
    os.makedirs(spec.run_dir, exist_ok=True)  # workers.run's prepare_run_dir does this before Ray starts
    return spec


def env() -> WorkerEnv:
    return WorkerEnv(rank=0, world_size=1, local_rank=0)


# 384 samples: 345 to train on, 10 steps an epoch, so step 10 ends epoch 0; 512: 14 an epoch,
# so the checkpoint of step 10 is mid-epoch and the fault (step 17) falls in the next epoch.
@pytest.mark.parametrize("size", [384, 512], ids=["checkpoint-at-epoch-end", "checkpoint-mid-epoch"])
def test_resume_after_an_injected_fault_is_exact(tmp_path, size):
    undisturbed = train(job(tmp_path, "twin", size), env())
    assert undisturbed["event"] == "finished" and undisturbed["final_step"] == 30
    digest = undisturbed["weights_sha256"]
    assert len(digest) == 64

    spec = job(tmp_path, "faulty", size, faults=[{"at_step": 17, "rank": 0, "kind": "exception"}])
    with pytest.raises(InjectedFault, match="at step 17 on rank 0"):
        train(spec, env())
    assert checkpoint.latest(spec.run_dir)[0] == 10
    assert max(m["step"] for m in events.metrics(spec.run_dir)) == 16
    (failed,) = events.events(spec.run_dir, "worker_failed")
    assert failed["classification"] == INFRASTRUCTURE and failed["step"] == 17
    assert len(events.events(spec.run_dir, "fault_injected")) == 1

    resumed_run = train(spec, env())  # the next attempt, same run directory
    assert resumed_run["final_step"] == 30
    assert resumed_run["weights_sha256"] == digest

    (resumed,) = events.events(spec.run_dir, "resumed")
    assert resumed["from_step"] == 10
    assert resumed["reached_step"] == 16
    assert resumed["lost_steps"] == 6
    assert resumed["failed_rank"] == 0
    assert resumed["attempt"] == 2
    assert len(events.events(spec.run_dir, "fault_injected")) == 1  # fired once, not again on replay
    assert [e["attempt"] for e in events.events(spec.run_dir, "attempt_started")] == [1, 2]
    assert [e["from_step"] for e in events.events(spec.run_dir, "attempt_started")] == [0, 10]
    # Steps 11..16 were run twice, 17..30 once after the fault.
    steps = [m["step"] for m in events.metrics(spec.run_dir)]
    assert steps == list(range(1, 17)) + list(range(11, 31))
    assert checkpoint.latest(spec.run_dir)[0] == 30

    # final/model.pt holds the weights the digest describes.
    state = checkpoint.load_shard(checkpoint.latest(spec.run_dir)[1], "state.pt")
    assert (state["epoch"], state["batch_index"]) == {384: (2, 10), 512: (2, 2)}[size]
    model = build_model(spec.model, in_channels=1, num_classes=10, image_size=28)
    model.load_state_dict(torch.load(os.path.join(spec.run_dir, "final", "model.pt")))
    assert weights_sha256(model) == digest


def test_the_digest_tells_runs_apart(tmp_path):
    a = train(job(tmp_path, "seed7"), env())
    b = train(job(tmp_path, "seed8", training={"max_steps": 30, "global_batch_size": 32, "seed": 8}), env())
    assert a["weights_sha256"] != b["weights_sha256"]


def test_a_model_that_always_fails_is_deterministic(tmp_path):
    spec = job(tmp_path, "broken", model={"name": "custom", "factory": "tests.helpers.bad_model:build"})
    with pytest.raises(DeterministicTrainingError) as info:
        train(spec, env())
    assert "ValueError: shape bug in Broken.forward" in str(info.value)
    assert "step 1" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    (failed,) = events.events(spec.run_dir, "worker_failed")
    assert failed["classification"] == DETERMINISTIC
    assert failed["rank"] == 0 and failed["step"] == 1
    assert "Traceback (most recent call last)" in failed["traceback"]
    assert "in forward" in failed["traceback"]
    assert "ValueError: shape bug in Broken.forward" in failed["traceback"]
    assert events.events(spec.run_dir, "finished") == []


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_and_resumes_exactly(tmp_path, precision):
    undisturbed = train(job(tmp_path, f"{precision}-twin", precision=precision), env())
    losses = [m["loss"] for m in events.metrics(os.path.join(tmp_path, f"{precision}-twin"))]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # it learns
    fp32 = train(job(tmp_path, "fp32-twin"), env())
    assert undisturbed["weights_sha256"] != fp32["weights_sha256"]  # autocast really ran

    spec = job(tmp_path, f"{precision}-faulty", precision=precision,
               faults=[{"at_step": 17, "rank": 0, "kind": "exception"}])
    with pytest.raises(InjectedFault):
        train(spec, env())
    state = checkpoint.load_shard(checkpoint.latest(spec.run_dir)[1], "state.pt")
    # fp16's loss scale is part of the checkpoint; bf16 needs none.
    assert bool(state["scaler"]) == (precision == "fp16")
    if precision == "fp16":
        assert state["scaler"]["scale"] > 0 and "_growth_tracker" in state["scaler"]
    assert train(spec, env())["weights_sha256"] == undisturbed["weights_sha256"]


def test_recovery_blames_the_dead_process_not_the_peer_that_lost_its_connection(tmp_path):
    from workers.recovery import Recovery

    run_dir = str(tmp_path)
    events.emit(run_dir, "attempt_started", attempt=1)
    events.log_metrics(run_dir, step=13, attempt=1)
    # The survivor notices first, with gloo's message (brackets and all); Ray reports the death after.
    events.emit(run_dir, "worker_failed", rank=0, classification=INFRASTRUCTURE,
                error="[/__w/pytorch/third_party/gloo/pair.cc:561] Connection closed by peer")
    events.emit(run_dir, "worker_failed", rank=1, classification=INFRASTRUCTURE, error="worker process died",
                process_died=True)
    recovery = Recovery(run_dir, from_step=10)
    assert (recovery.failed_rank, recovery.cause) == (1, "worker process died")
    assert (recovery.reached_step, recovery.attempt) == (13, 2)


def test_errors_in_set_up_are_classified_and_name_what_failed(tmp_path):
    bad = tmp_path / "images.gz"
    bad.write_bytes(b"not an idx file at all")
    cases = {
        "model": ({"model": {"name": "custom", "factory": "tests.helpers.bad_model:unbuildable"}},
                  "building the model (model.name = custom)", "3 heads on a width of 128"),
        "data": ({"dataset": {"name": "idx", "images": str(bad), "labels": str(bad)}},
                 "loading the dataset (dataset.name = idx)", str(bad)),
        "small": ({"dataset": {"name": "synthetic", "size": 20}}, "setting up",
                  "fewer than one global batch (training.global_batch_size = 32)"),
    }
    for name, (overrides, activity, cause) in cases.items():
        spec = job(tmp_path, f"setup-{name}", **overrides)
        with pytest.raises(DeterministicTrainingError) as info:
            train(spec, env())
        assert activity in str(info.value) and cause in str(info.value), (name, str(info.value))
        (failed,) = events.events(spec.run_dir, "worker_failed")
        assert failed["classification"] == DETERMINISTIC and failed["activity"].startswith(activity.split(" (")[0])
        # The attempt counted even though it never trained.
        assert [e["attempt"] for e in events.events(spec.run_dir, "attempt_started")] == [1]
        assert events.events(spec.run_dir, "training_started") == []


def test_a_checkpoint_that_cannot_be_loaded_is_skipped_for_the_one_before(tmp_path):
    digest = train(job(tmp_path, "twin"), env())["weights_sha256"]
    spec = job(tmp_path, "damaged", faults=[{"at_step": 25, "rank": 0, "kind": "exception"}])
    with pytest.raises(InjectedFault):
        train(spec, env())
    # A shard that passes its checksum (the manifest is rewritten to match) but that torch
    # cannot read: what a writer of another version, or a bug, leaves behind.
    newest = checkpoint.latest(spec.run_dir)[1]
    assert newest.endswith("step-000020")
    with open(os.path.join(newest, "state.pt"), "wb") as f:
        f.write(b"garbage")
    manifest_path = os.path.join(newest, checkpoint.MANIFEST)
    manifest = json.load(open(manifest_path))
    manifest["files"]["state.pt"] = {"bytes": 7, "sha256": hashlib.sha256(b"garbage").hexdigest()}
    json.dump(manifest, open(manifest_path, "w"))

    resumed = train(spec, env())
    assert resumed["weights_sha256"] == digest
    (skipped,) = events.events(spec.run_dir, "checkpoint_skipped")
    assert skipped["step"] == 20 and "UnpicklingError" in skipped["error"] or "pickle" in skipped["error"].lower()
    assert events.events(spec.run_dir, "training_started")[-1]["from_step"] == 10
    assert events.events(spec.run_dir, "resumed")[-1]["from_step"] == 10
    # Set aside, not deleted, and never tried again.
    assert any(n.startswith(".unloadable-step-000020") for n in os.listdir(checkpoint.root(spec.run_dir)))
