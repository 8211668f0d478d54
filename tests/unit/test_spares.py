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
@pytest.mark.parametrize("beside_a_group", [True, False])
def test_a_spare_imports_at_idle_priority_beside_a_training_group_and_at_its_own_at_launch(
        monkeypatch, beside_a_group):
    """The main thread goes on to train when a worker group takes the spare, and an
    unprivileged process cannot raise its priority again: only the import thread is
    lowered, and only where a group trains (at launch an actor waits for the imports)."""
    seen = {}
    original = spares._import

    def recording(idle):
        original(idle)
        seen["thread"] = threading.current_thread().name
        seen["policy"] = os.sched_getscheduler(0)

    monkeypatch.setattr(spares, "_import", recording)
    monkeypatch.setattr(spares, "_group_training_here", lambda job: beside_a_group)
    monkeypatch.setenv(spares.TRAIN_WORKER_ENV, "1")
    before = os.sched_getscheduler(0)
    spares.warm_up()
    assert seen == {"thread": "etrain-warm-up", "policy": os.SCHED_IDLE if beside_a_group else before}
    assert os.sched_getscheduler(0) == before
    assert "workers.loop" in sys.modules and "ray.train.torch" in sys.modules


def test_processes_that_never_train_are_not_warmed(monkeypatch):
    """Ray runs the job's setup hook in every process of the job: the controller too."""
    calls = []
    monkeypatch.setattr(spares, "_import", lambda idle: calls.append(1))
    monkeypatch.delenv(spares.TRAIN_WORKER_ENV, raising=False)
    spares.warm_up()
    assert calls == []


def test_a_childs_runtime_env_string_is_the_one_ray_makes():
    """Recorded from Ray 2.60: a job started with this env (spaced, ASCII-escaped, as the
    driver reports it), and the string an actor it started with
    runtime_env={"env_vars": {...}} reported. The raylet matches spares by this string,
    byte for byte."""
    job = ('{"env_vars": {"OMP_NUM_THREADS": "1", "X_\\u00dc": "\\u00e9", '
           '"__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR": "workers.spares.warm_up"}, '
           '"worker_process_setup_hook": "workers.spares.warm_up"}')
    actor = ('{"env_vars":{"ETRAIN_TRAIN_WORKER":"1","OMP_NUM_THREADS":"1","RAY_TRAIN_V2_ENABLED":"1",'
             '"X_\u00dc":"\u00e9","__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR":"workers.spares.warm_up"},'
             '"worker_process_setup_hook":"workers.spares.warm_up"}')
    child = {"env_vars": {"RAY_TRAIN_V2_ENABLED": "1", "ETRAIN_TRAIN_WORKER": "1"}}
    assert spares.child_env(job, child) == actor
    # A key other than env_vars replaces the parent's; env_vars merge key by key.
    merged = json.loads(spares.child_env(actor, {"env_vars": {"OMP_NUM_THREADS": "2"}, "pip": ["x"]}))
    assert merged["env_vars"]["OMP_NUM_THREADS"] == "2" and merged["env_vars"]["ETRAIN_TRAIN_WORKER"] == "1"
    assert merged["pip"] == ["x"]


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


class Raylet:
    """Starts at most `at_once` of a request's processes, as Ray's raylet does
    (maximum_startup_concurrency: min(cores, CPUs)), and drops the rest."""

    def __init__(self, at_once: int):
        self.at_once, self.started, self.requests = at_once, {}, []

    def prestart(self, count, env=None, keep_alive_s=None):
        self.requests.append((count, env))
        self.started[env] = self.started.get(env, 0) + min(count, self.at_once)


def keep_for_a_while(monkeypatch, raylet: Raylet, count: int) -> None:
    """spares.keep against `raylet`, retrying at once, for half a second."""
    monkeypatch.setattr(spares, "prestart", raylet.prestart)
    monkeypatch.setattr(spares, "spares_here", lambda job, train=True: raylet.started.get(None, 0))
    monkeypatch.setattr(spares, "RETRY_S", 0.01)
    monkeypatch.setattr(spares, "TOP_UP_S", 60)
    monkeypatch.setattr("ray.get_runtime_context", lambda: type("C", (), {"get_job_id": lambda self: "0a"})())
    stop = threading.Event()
    spares.keep(count, after_s=0, stop=stop)
    time.sleep(0.5)
    stop.set()


def test_spares_the_raylet_dropped_are_asked_for_again(monkeypatch):
    raylet = Raylet(at_once=2)
    keep_for_a_while(monkeypatch, raylet, 3)
    assert raylet.started == {None: 3}
    assert [n for n, _ in raylet.requests] == [3, 1]  # the dropped one, once: then full, the next top-up


def test_a_spare_that_never_comes_is_asked_for_a_few_times_then_at_the_top_up(monkeypatch):
    raylet = Raylet(at_once=0)
    keep_for_a_while(monkeypatch, raylet, 1)
    assert raylet.started == {None: 0}
    assert len(raylet.requests) == 1 + spares.QUICK_RETRIES


def test_launch_spares_the_raylet_dropped_are_asked_for_again_and_taken_ones_are_not(monkeypatch):
    """At launch the controller takes its spare at once: counted with the busy processes,
    it is not asked for again."""
    raylet = Raylet(at_once=2)
    monkeypatch.setattr(spares, "prestart", raylet.prestart)
    monkeypatch.setattr(spares, "_ray_workers_here",
                        lambda job, idle: {True: raylet.started.get("worker", 0), False: raylet.started.get("controller", 0)})
    monkeypatch.setattr(spares, "LAUNCH_RETRY_S", 0.01)
    wanted = [(False, 2, "controller"), (True, 3, "worker")]
    for train, count, env in wanted:
        raylet.prestart(count, env)
    spares._complete_launch("0a", wanted)
    assert raylet.started == {"controller": 2, "worker": 3}
    assert raylet.requests == [(2, "controller"), (3, "worker"), (1, "worker")]
