"""Recovery on a real local Ray cluster: DESIGN.md invariants 1-4."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.conftest import finish, recovery_spec, run_job, start_job
from workers.process_clock import process_started

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


def _idle_workers(ray_job: str) -> dict[int, tuple[bool, bool]]:
    """This Ray job's idle worker processes on this machine (spares, failure.spares): for
    each, whether it was started for Ray Train's workers and whether torch is loaded in it."""
    idle = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read().startswith(b"ray::IDLE"):
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
            if f"RAY_JOB_ID={ray_job}".encode() in env:
                with open(f"/proc/{pid}/maps") as f:
                    idle[int(pid)] = (b"ETRAIN_TRAIN_WORKER=1" in env, "libtorch_cpu" in f.read())
        except OSError:  # gone meanwhile
            continue
    return idle


def _warm_spares(ray_job: str) -> dict[int, bool]:
    """The spares for Ray Train's workers, each with whether torch is loaded in it yet."""
    return {pid: torch for pid, (train, torch) in _idle_workers(ray_job).items() if train}


def test_launch_and_restart_start_in_warm_spares_that_end_with_the_job(ray_cluster, tmp_path, monkeypatch):
    """failure.spares (the default): the driver has the processes of the controller, its
    actors and the workers started before the trainer asks for them, and every one is
    taken (none is left idle when training starts). Once the workers train, the node
    holds one idle Ray worker per worker, torch imported; the restart after a killed
    worker starts in those rather than booting new processes, and the job's spares end
    with the job, on a cluster that outlives it (as `etrain serve`'s does)."""
    from ray.util.state import list_actors

    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    spec = recovery_spec("spares")
    spec["training"]["max_steps"] = 3000  # long enough for the spares to warm up first (~10 s on 2 busy cores)
    spec["checkpoint"]["every_steps"] = 100
    proc, run_dir = start_job(ray_cluster, spec, tmp_path)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.time() + 120
        while time.time() < deadline and (not metrics.exists() or not metrics.read_text().strip()):
            time.sleep(0.2)
        # At once, before the spares for a restart are asked for (spares.FIRST_AFTER_S):
        # a launch spare whose runtime env string missed the actors' would sit idle here.
        first = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
                 if '"worker_started"' in line]
        with open(f"/proc/{first[0]['pid']}/environ", "rb") as f:
            launch_job = next(v for v in f.read().split(b"\0") if v.startswith(b"RAY_JOB_ID=")).decode()[11:]
        assert _idle_workers(launch_job) == {}, "launch spares left unused"
        actors = list_actors(address=ray_cluster.dashboard,
                             filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
        assert len(actors) == 2, actors
        ray_job = actors[0].job_id
        spares: dict[int, bool] = {}
        while time.time() < deadline and not (len(spares) == 2 and all(spares.values())):
            assert proc.poll() is None, "the job ended before its spares were warm"
            time.sleep(0.5)
            spares = _warm_spares(ray_job)
        assert len(spares) == 2 and all(spares.values()), spares
        killed = time.time()
        os.kill(actors[-1].pid, signal.SIGKILL)
        # Ray Train's synchronization actor, new with every worker group, starts in the
        # controller's spare.
        while time.time() < deadline + 120 and '"resumed"' not in (run_dir / "events.jsonl").read_text():
            assert proc.poll() is None, "the job ended before it resumed"
            time.sleep(0.2)
        (sync,) = list_actors(address=ray_cluster.dashboard, filters=[("class_name", "=", "SynchronizationActor"),
                                                                      ("state", "=", "ALIVE")])
        assert process_started(sync.pid) < killed
        outcome = finish(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert outcome.rc == 0, outcome.output[-3000:]
    assert "no warm processes" not in outcome.output
    assert outcome.summary["restarts"] == 1 and outcome.summary["final_step"] == 3000
    restarted = [w for w in outcome.events("worker_started") if w["attempt"] == 2]
    assert {w["pid"] for w in restarted} == set(spares), (restarted, spares)
    assert all(w["process_started"] < killed for w in restarted), restarted
    (resumed,) = outcome.events("resumed")
    assert 0 <= resumed["lost_steps"] <= spec["checkpoint"]["every_steps"], resumed
    deadline = time.time() + 30  # the raylet ends a finished job's idle workers within a few seconds
    while _idle_workers(ray_job) and time.time() < deadline:
        time.sleep(0.5)
    assert not _idle_workers(ray_job)
