"""Recovery on a real local Ray cluster: DESIGN.md invariants 1-4."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.conftest import finish, recovery_spec, run_job, start_job

pytestmark = pytest.mark.ray
INTERVAL = recovery_spec("x")["checkpoint"]["every_steps"]


def assert_bounded(outcome) -> None:
    for r in outcome.events("resumed"):
        assert 0 <= r["lost_steps"] <= INTERVAL, r
        assert r["reached_step"] - r["from_step"] == r["lost_steps"], r
        assert r["recovery_s"] > 0, r


def test_two_crashes_end_bit_identical(ray_cluster, twin, tmp_path):
    faults = [{"at_step": 14, "rank": 1, "kind": "crash"}, {"at_step": 33, "rank": 0, "kind": "crash"}]
    outcome = run_job(ray_cluster, recovery_spec("two-crashes", faults), tmp_path)
    assert outcome.rc == 0, outcome.output[-3000:]
    s = outcome.summary
    assert s["status"] == "succeeded" and s["final_step"] == 40
    assert s["restarts"] == 2
    assert s["weights_sha256"] == twin.summary["weights_sha256"]
    resumed = outcome.events("resumed")
    assert [(r["failed_rank"], r["from_step"], r["lost_steps"]) for r in resumed] == [(1, 10, 3), (0, 30, 2)]
    assert s["steps_recomputed"] == 5
    assert_bounded(outcome)


def test_crash_while_checkpoint_is_written_never_loads_it(ray_cluster, twin, tmp_path):
    faults = [{"at_step": 20, "rank": 1, "kind": "crash", "phase": "checkpoint"}]
    outcome = run_job(ray_cluster, recovery_spec("crash-in-checkpoint", faults), tmp_path)
    assert outcome.rc == 0, outcome.output[-3000:]
    attempts = outcome.events("attempt_started")
    assert [a["from_step"] for a in attempts] == [0, 10]  # step 20 was half-written: never loaded
    committed = [(e["step"], e["time"]) for e in outcome.events("checkpoint_committed")]
    assert [step for step, t in committed if t < attempts[1]["time"]] == [10]
    assert outcome.events("resumed")[0]["from_step"] == 10
    assert outcome.summary["weights_sha256"] == twin.summary["weights_sha256"]
    assert not [p for p in os.listdir(outcome.run_dir / "checkpoints") if p.startswith(".tmp")]
    assert_bounded(outcome)


def _worker_pids(cluster) -> list[int]:
    from ray.util.state import list_actors

    actors = list_actors(address=cluster.dashboard, filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    return [a.pid for a in actors]


def test_worker_killed_from_outside_recovers(ray_cluster, twin, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    proc, run_dir = start_job(ray_cluster, recovery_spec("sigkill", []), tmp_path)
    deadline = time.time() + 120
    metrics = run_dir / "metrics.jsonl"
    # Kill a worker once training is under way, between checkpoints.
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 16):
        time.sleep(0.05)
    pids = _worker_pids(ray_cluster)
    assert len(pids) == 2, pids
    os.kill(pids[-1], signal.SIGKILL)
    outcome = finish(proc, run_dir)
    assert outcome.rc == 0, outcome.output[-3000:]
    assert outcome.summary["restarts"] == 1
    assert outcome.summary["weights_sha256"] == twin.summary["weights_sha256"]
    died = [e for e in outcome.events("worker_failed") if e.get("process_died")]
    assert died, outcome.events()
    assert outcome.events("resumed")[0]["failed_rank"] == died[0]["rank"]
    assert_bounded(outcome)


def test_hang_and_exception_are_detected_and_retried(ray_cluster, twin, tmp_path):
    faults = [{"at_step": 12, "rank": 1, "kind": "hang"}, {"at_step": 27, "rank": 0, "kind": "exception"}]
    outcome = run_job(ray_cluster, recovery_spec("hang-exception", faults), tmp_path)
    assert outcome.rc == 0, outcome.output[-3000:]
    resumed = outcome.events("resumed")
    assert [(r["failed_rank"], r["cause"]) for r in resumed] == [(1, "hang"), (0, "exception")]
    # Detected through the 8 s collective timeout, not the 30-minute default.
    assert resumed[0]["recovery_s"] < 60
    assert outcome.summary["weights_sha256"] == twin.summary["weights_sha256"]
    assert_bounded(outcome)


def test_deterministic_user_error_fails_at_once(ray_cluster, tmp_path):
    spec = recovery_spec("bad-model")
    spec["model"] = {"name": "custom", "factory": "tests.helpers.bad_model:build"}
    started = time.time()
    outcome = run_job(ray_cluster, spec, tmp_path)
    assert outcome.rc != 0
    assert outcome.summary["status"] == "failed"
    assert "shape bug in Broken.forward" in outcome.summary["error"]
    assert len(outcome.events("attempt_started")) == 1
    assert outcome.summary["restarts"] == 0
    failed = outcome.events("failed")
    assert failed and failed[0]["classification"] == "deterministic"
    assert "Traceback" in outcome.events("worker_failed")[0]["traceback"]
    assert time.time() - started < 120


def test_no_preemption_watcher_or_dataset_manager_was_started(ray_cluster, twin, monkeypatch):
    """Neither is of use to this loop; each would be one more Ray worker process booting
    beside the workers on every start and restart (docs/architecture.md)."""
    from ray.util.state import list_actors

    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    names = {a.class_name for a in list_actors(address=ray_cluster.dashboard, limit=10000)}
    assert "RayTrainWorker" in names, names  # the twin's workers, alive or dead: the listing holds them
    assert not names & {"PreemptionWatcher", "DatasetManager"}, names
