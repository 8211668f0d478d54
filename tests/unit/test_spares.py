"""Warm spares (failure.spares): which jobs ask for them and how a spare warms up. That
a restart really starts in them, and that they end with the job, is
tests/integration/test_recovery.py's, on a real Ray cluster."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from workers import spares
from workers.run import JOB_CONFIG_ENV, worker_runtime_env
from workers.spec import JobSpec


def spec(**failure) -> JobSpec:
    return JobSpec.model_validate({"job_id": "j", "workers": 2, "failure": failure})


def test_exact_jobs_warm_their_spares_by_default_and_others_do_not(monkeypatch):
    monkeypatch.delenv(JOB_CONFIG_ENV, raising=False)
    assert spec().failure.spares is True
    assert worker_runtime_env(spec(), None)["worker_process_setup_hook"] == spares.HOOK
    assert "worker_process_setup_hook" not in worker_runtime_env(spec(spares=False), None)
    # live mode replaces one worker, in a process of its own: no spares.
    assert "worker_process_setup_hook" not in worker_runtime_env(spec(mode="live", max_failures=2), None)


def test_a_ray_job_with_a_setup_hook_of_its_own_keeps_it(monkeypatch):
    """`ray job submit --runtime-env-json` with a hook: Ray refuses a key given twice, and
    the user's hook wins (the spares still start; they only boot without torch)."""
    monkeypatch.setenv(JOB_CONFIG_ENV, json.dumps({"runtime_env": {"worker_process_setup_hook": "mine.setup"}}))
    assert "worker_process_setup_hook" not in worker_runtime_env(spec(), None)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_a_spare_imports_at_idle_priority_and_its_main_thread_keeps_its_own(monkeypatch):
    """The main thread goes on to train when a worker group takes the spare, and an
    unprivileged process cannot raise its priority again: only the import thread is lowered."""
    seen = {}
    original = spares._import_at_idle_priority

    def recording():
        original()
        seen["thread"] = threading.current_thread().name
        seen["policy"] = os.sched_getscheduler(0)

    monkeypatch.setattr(spares, "_import_at_idle_priority", recording)
    monkeypatch.setenv(spares.TRAIN_WORKER_ENV, "1")
    before = os.sched_getscheduler(0)
    spares.warm_up()
    assert seen == {"thread": "etrain-warm-up", "policy": os.SCHED_IDLE}
    assert os.sched_getscheduler(0) == before
    assert "workers.loop" in sys.modules and "ray.train.torch" in sys.modules


def test_processes_that_never_train_are_not_warmed(monkeypatch):
    """Ray runs the job's setup hook in every process of the job: the controller too."""
    calls = []
    monkeypatch.setattr(spares, "_import_at_idle_priority", lambda: calls.append(1))
    monkeypatch.delenv(spares.TRAIN_WORKER_ENV, raising=False)
    spares.warm_up()
    assert calls == []


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="spares are counted from /proc")
def test_a_node_counts_only_its_jobs_idle_spares_so_they_never_pile_up():
    """An idle Ray worker is a process named ray::IDLE; a spare for training workers
    carries the marker in its environment, one for the job's other actors does not."""
    def idle(job: str, train: bool) -> subprocess.Popen:
        env = {"PATH": os.environ["PATH"], "RAY_JOB_ID": job, **({spares.TRAIN_WORKER_ENV: "1"} if train else {})}
        return subprocess.Popen(["bash", "-c", 'exec -a "ray::IDLE" sleep 60'], env=env)

    procs = [idle("0a000000", True), idle("0a000000", True), idle("0a000000", False), idle("0b000000", True)]
    try:
        def counts():
            return (spares.spares_here("0a000000"), spares.spares_here("0a000000", train=False),
                    spares.spares_here("0b000000"), spares.spares_here("0c000000"))

        deadline = time.time() + 10  # until each bash has exec'd under its new name
        while counts() != (2, 1, 1, 0) and time.time() < deadline:
            time.sleep(0.05)
        assert counts() == (2, 1, 1, 0)
    finally:
        for p in procs:
            p.kill()
            p.wait()
