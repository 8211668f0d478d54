"""failure.mode live on a real local Ray cluster with torchft: the survivors of a
failure keep training, the failed worker's replica group is replaced and takes the
state from a live peer, and a job whose every worker died resumes from a checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import finish, start_job

pytestmark = pytest.mark.ray


def live_spec(job_id: str, steps: int = 260) -> dict:
    return {
        "job_id": job_id,
        "model": {"name": "custom", "factory": "tests.helpers.paced:slow_linear"},  # 0.1 s a step at least
        "dataset": {"name": "synthetic", "size": 4096, "noise": 2.0},
        "workers": 3,
        "training": {"max_steps": steps, "global_batch_size": 96, "seed": 7},
        "checkpoint": {"every_steps": 20, "keep": 2},
        "failure": {"mode": "live", "max_failures": 6, "collective_timeout_s": 10},
    }


def _events(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [e for line in path.read_text().splitlines() if line.strip() and (e := json.loads(line))["event"] == kind]


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _wait(what: str, predicate, proc, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"the job ended while waiting for {what}: {proc.stdout.read()[-3000:]}"
        if predicate():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def _pids(run_dir: Path) -> dict[int, list[int]]:
    """Each rank's worker processes, in the order they started."""
    out: dict[int, list[int]] = {}
    for e in _events(run_dir, "worker_started"):
        out.setdefault(e["rank"], []).append(e["pid"])
    return out


def _started(run_dir: Path, proc) -> dict[int, list[int]]:
    _wait("three workers training", lambda: len(_pids(run_dir)) == 3 and len(_steps(run_dir)) >= 30, proc)
    return _pids(run_dir)


def mean_loss(lines: list[dict]) -> float:
    return sum(m["loss"] for m in lines) / len(lines)


def test_a_killed_worker_is_replaced_while_the_others_keep_training(ray_cluster, tmp_path):
    proc, run_dir = start_job(ray_cluster, live_spec("live-kill"), tmp_path)
    try:
        before = _started(run_dir, proc)
        killed_at = _steps(run_dir)[-1]["step"]
        os.kill(before[1][0], signal.SIGKILL)
        _wait("the replacement to rejoin", lambda: _events(run_dir, "live_recovered"), proc)
    finally:
        outcome = finish(proc, run_dir)
    assert outcome.rc == 0, outcome.output[-3000:]
    s = outcome.summary
    assert s["status"] == "succeeded" and s["final_step"] == 260
    assert s["restarts"] == 0 and s["steps_recomputed"] == 0
    after = _pids(run_dir)
    # The survivors' processes are the ones that started; rank 1 has a new one.
    assert after[0] == before[0] and after[2] == before[2], after
    assert len(after[1]) == 2 and after[1][0] == before[1][0], after
    (recovered,) = outcome.events("live_recovered")
    assert recovered["survivors_restarted"] is False and recovered["failed_ranks"] == [1], recovered
    assert recovered["failed_after_step"] >= killed_at - 1 and recovered["survivor_steps"] > 0, recovered
    assert recovered["rejoin_s"] > recovered["stall_s"] > 0, recovered
    (joined,) = outcome.events("live_joined")
    assert joined["rank"] == 1 and joined["step"] > killed_at, joined  # the peer's state, not a checkpoint's
    assert s["live_recoveries"][0]["failed_ranks"] == [1]
    lines = _steps(run_dir)
    assert [m["step"] for m in lines] == list(range(1, 261))  # no step lost, none trained twice
    assert {m["groups"] for m in lines if m["step"] <= recovered["failed_after_step"]} == {3}
    assert {m["groups"] for m in lines if recovered["failed_after_step"] < m["step"] < recovered["rejoined_at_step"]} \
        == {2}
    # The loss keeps falling through the recovery.
    fail, back = recovered["failed_after_step"], recovered["rejoined_at_step"]
    assert mean_loss(lines[fail - 20:fail]) > mean_loss(lines[fail:back]) > mean_loss(lines[-20:])


def test_a_second_failure_while_the_first_replacement_joins(ray_cluster, tmp_path):
    proc, run_dir = start_job(ray_cluster, live_spec("live-twice"), tmp_path)
    try:
        before = _started(run_dir, proc)
        os.kill(before[2][0], signal.SIGKILL)
        # Ray is bringing up rank 2's replacement: kill rank 0 before it has joined.
        from ray.util.state import list_actors

        def replacement_starting() -> bool:
            alive = list_actors(address=ray_cluster.dashboard,
                                filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
            return any(a.pid not in (before[0][0], before[1][0], before[2][0]) for a in alive)

        _wait("rank 2's replacement to start", replacement_starting, proc)
        assert not _events(run_dir, "live_joined")
        os.kill(before[0][0], signal.SIGKILL)
    finally:
        outcome = finish(proc, run_dir)
    _completed_without_a_restart(outcome, run_dir)
    assert sorted(e["rank"] for e in outcome.events("live_joined")) == [0, 2]
    assert _pids(run_dir)[1] == before[1]  # the one survivor trained throughout
    recovered = outcome.events("live_recovered")
    assert recovered and all(r["survivors_restarted"] is False for r in recovered)
    assert sorted(r for e in recovered for r in e["failed_ranks"]) == [0, 2]


def test_a_failure_just_before_the_end_completes_without_the_replacement(ray_cluster, tmp_path):
    """The survivors train the last steps while the replacement starts: it finds nothing
    left to join, ends, and the job succeeds (it failed waiting for a peer that had
    finished, in bench/live_recovery.py's five failures over 400 steps)."""
    proc, run_dir = start_job(ray_cluster, live_spec("live-late"), tmp_path)
    try:
        before = _started(run_dir, proc)
        _wait("step 255 of 260", lambda: len(_steps(run_dir)) >= 255, proc)
        os.kill(before[2][0], signal.SIGKILL)
    finally:
        outcome = finish(proc, run_dir)
    _completed_without_a_restart(outcome, run_dir)
    (recovered,) = outcome.events("live_recovered")
    assert recovered["failed_ranks"] == [2] and recovered["rejoined_at_step"] is None
    assert recovered["survivors_restarted"] is False
    assert _pids(run_dir)[0] == before[0] and _pids(run_dir)[1] == before[1]


def _completed_without_a_restart(outcome, run_dir: Path) -> None:
    """All 260 steps, each trained once, and no worker group started again."""
    assert outcome.rc == 0, outcome.output[-3000:]
    assert outcome.summary["status"] == "succeeded" and outcome.summary["final_step"] == 260
    assert outcome.summary["restarts"] == 0
    assert [m["step"] for m in _steps(run_dir)] == list(range(1, 261))


def test_when_every_worker_dies_the_job_resumes_from_the_newest_checkpoint(ray_cluster, tmp_path):
    proc, run_dir = start_job(ray_cluster, live_spec("live-all", steps=160), tmp_path)
    try:
        before = _started(run_dir, proc)
        _wait("a checkpoint", lambda: _events(run_dir, "checkpoint_committed"), proc)
        for rank in (0, 1, 2):
            os.kill(before[rank][0], signal.SIGKILL)
    finally:
        outcome = finish(proc, run_dir)
    _resumed_from_a_checkpoint(outcome, run_dir)


def test_survivors_dying_while_a_replacement_is_made_fall_back_to_the_newest_checkpoint(ray_cluster, tmp_path):
    """A node lost whole, its workers noticed dead one poll apart: Ray Train starts
    replacing the first one's group and, doing so, calls the others (Ray 2.60 ends the
    run there with a controller error it never retries)."""
    proc, run_dir = start_job(ray_cluster, live_spec("live-node", steps=160), tmp_path)
    stopped: list[int] = []
    try:
        before = _started(run_dir, proc)
        _wait("a checkpoint", lambda: _events(run_dir, "checkpoint_committed"), proc)
        # Frozen, ranks 1 and 2 answer no poll: the controller sees rank 0 alone fail and
        # its replacement waits on them; then they die.
        stopped = [before[1][0], before[2][0]]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        os.kill(before[0][0], signal.SIGKILL)
        _wait("the controller to notice rank 0", lambda: _events(run_dir, "worker_failed"), proc)
        time.sleep(1)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):  # Ray may have ended it already
                os.kill(pid, signal.SIGKILL)
        outcome = finish(proc, run_dir)
    _resumed_from_a_checkpoint(outcome, run_dir)


def _resumed_from_a_checkpoint(outcome, run_dir: Path) -> None:
    assert outcome.rc == 0, outcome.output[-3000:]
    s = outcome.summary
    assert s["status"] == "succeeded" and s["final_step"] == 160
    assert s["restarts"] == 1, s
    attempts = outcome.events("attempt_started")
    assert attempts[1]["from_step"] > 0 and attempts[1]["from_step"] % 20 == 0, attempts
    assert attempts[0]["generation"] != attempts[1]["generation"]
    (resumed,) = outcome.events("resumed")
    assert resumed["from_step"] == attempts[1]["from_step"] and resumed["lost_steps"] <= 20, resumed
    assert not outcome.events("live_joined")  # a full start loads the checkpoint: no peer was alive
    steps = [m["step"] for m in _steps(run_dir) if m["attempt"] == 2]
    assert steps == list(range(attempts[1]["from_step"] + 1, 161))
