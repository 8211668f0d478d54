"""workers/failures.py (classification, blame, back-off) and workers/recorder.py (the controller callback)."""

from __future__ import annotations

import pytest
from ray.exceptions import RayActorError
from ray.train.v2._internal.exceptions import UserExceptionWithTraceback, WorkerHealthCheckFailedError

from workers import events
from workers.failures import (
    DETERMINISTIC,
    INFRASTRUCTURE,
    TRANSIENT,
    DeterministicTrainingError,
    classify,
    record_worker_error,
    signature,
)
from workers.faults import InjectedFault
from workers.recorder import FailureRecorder


@pytest.mark.parametrize("exc", [
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5000"),
    ConnectionResetError(104, "Connection reset by peer"),
    TimeoutError("operation did not finish"),
    RuntimeError("[Rank 1] Watchdog caught collective operation timed out after 30000 milliseconds"),
    RuntimeError("Socket Timeout"),
    type("DistBackendError", (RuntimeError,), {})("the communicator was aborted"),
    InjectedFault("injected exception at step 3 on rank 0"),
], ids=["gloo", "connection-reset", "timeout-error", "timed-out", "socket-timeout", "dist-backend", "injected"])
@pytest.mark.parametrize("completed", [0, 12])
def test_communication_errors_and_injected_faults_are_infrastructure(exc, completed):
    history = [{"signature": signature(exc), "step": 13}]
    assert classify(exc, step=13, completed_steps=completed, history=history) == INFRASTRUCTURE


@pytest.mark.parametrize("exc", [
    ValueError("timeout must be positive, got -1"),
    KeyError("peer"),
    TypeError("socket_path must be str"),
    AssertionError("gloo backend expected"),
], ids=["value", "key", "type", "assert"])
def test_a_programs_own_error_mentioning_the_network_is_not_infrastructure(exc):
    # Before: any error whose text said "timeout", "peer", "socket" or "gloo" was taken
    # for a peer's failure and retried, however often it repeated.
    assert classify(exc, step=1, completed_steps=0, history=[]) == DETERMINISTIC
    history = [{"signature": signature(exc), "step": 13}]
    assert classify(exc, step=13, completed_steps=12, history=history) == DETERMINISTIC


def test_an_error_before_the_first_step_is_deterministic():
    exc = ValueError("mat1 and mat2 shapes cannot be multiplied (64x784 and 100x10)")
    assert classify(exc, step=1, completed_steps=0, history=[]) == DETERMINISTIC


def test_the_same_error_at_the_same_step_again_is_deterministic():
    exc = ZeroDivisionError("division by zero")
    history = [{"event": "worker_failed", "signature": "ZeroDivisionError: division by zero", "step": 41}]
    assert classify(exc, step=41, completed_steps=40, history=history) == DETERMINISTIC


@pytest.mark.parametrize("history", [
    [],
    [{"signature": "ZeroDivisionError: division by zero", "step": 40}],   # same error, other step
    [{"signature": "KeyError: 'x'", "step": 41}],                          # other error, same step
    [{"rank": 1, "classification": INFRASTRUCTURE, "process_died": True}],  # a death has no signature
], ids=["no-history", "other-step", "other-error", "death"])
def test_otherwise_transient(history):
    exc = ZeroDivisionError("division by zero")
    assert classify(exc, step=41, completed_steps=40, history=history) == TRANSIENT


def test_record_worker_error_writes_the_event_with_traceback(tmp_path):
    def user_code():
        raise KeyError("label")

    try:
        user_code()
    except KeyError as e:
        exc = e
    kind = record_worker_error(str(tmp_path), exc, rank=1, step=5, attempt=2, completed_steps=4)
    assert kind == TRANSIENT
    (event,) = events.events(str(tmp_path), "worker_failed")
    assert event["rank"] == 1 and event["step"] == 5 and event["attempt"] == 2
    assert event["classification"] == TRANSIENT
    assert event["signature"] == "KeyError: 'label'"
    assert "user_code" in event["traceback"] and "KeyError: 'label'" in event["traceback"]
    # The same error at the same step in the next attempt is the user's.
    assert record_worker_error(str(tmp_path), exc, rank=1, step=5, attempt=3, completed_steps=4) == DETERMINISTIC
    assert [e["classification"] for e in events.events(str(tmp_path), "worker_failed")] == [TRANSIENT, DETERMINISTIC]


# ---------------------------------------------------------------- FailureRecorder

def dead_worker() -> Exception:
    return WorkerHealthCheckFailedError("worker 1 failed a health check", RayActorError())


def wrapped(exc: BaseException) -> UserExceptionWithTraceback:
    return UserExceptionWithTraceback(exc, f"Traceback (most recent call last):\n  ...\n{signature(exc)}\n")


def test_a_dead_process_is_recorded_as_infrastructure(tmp_path):
    recorder = FailureRecorder(str(tmp_path))
    recorder.after_exception(None, {1: dead_worker(), 0: RayActorError()})  # no raise: Ray retries
    failed = events.events(str(tmp_path), "worker_failed")
    assert [e["rank"] for e in failed] == [0, 1]
    for e in failed:
        assert e["classification"] == INFRASTRUCTURE
        assert e["process_died"] is True
        assert "worker process died" in e["error"]
    assert events.events(str(tmp_path), "failed") == []


def test_ordinary_worker_errors_are_left_to_ray(tmp_path):
    recorder = FailureRecorder(str(tmp_path))
    recorder.after_exception(None, {0: wrapped(InjectedFault("injected")), 1: RuntimeError("gloo: connection closed")})
    assert events.events(str(tmp_path)) == []


@pytest.mark.parametrize("wrap", [lambda e: e, wrapped], ids=["bare", "ray-wrapped"])
def test_a_deterministic_error_ends_the_run(tmp_path, wrap):
    message = "ValueError: shape bug in Broken.forward (step 1, rank 1)"
    recorder = FailureRecorder(str(tmp_path))
    with pytest.raises(DeterministicTrainingError) as info:
        recorder.after_exception(None, {0: RuntimeError("gloo: connection closed by peer"),
                                         1: wrap(DeterministicTrainingError(message))})
    assert str(info.value) == message
    (failed,) = events.events(str(tmp_path), "failed")
    assert failed["rank"] == 1
    assert failed["classification"] == DETERMINISTIC
    assert failed["error"] == message
    assert events.events(str(tmp_path), "worker_failed") == []


def test_a_death_is_recorded_before_a_deterministic_error_ends_the_run(tmp_path):
    recorder = FailureRecorder(str(tmp_path))
    with pytest.raises(DeterministicTrainingError):
        recorder.after_exception(None, {0: wrapped(DeterministicTrainingError("KeyError: 'x' (step 1, rank 0)")),
                                         1: dead_worker()})
    assert [(e["event"], e["rank"]) for e in events.events(str(tmp_path))] == [("worker_failed", 1), ("failed", 0)]


def _attempt(run_dir, attempt, from_step, reached):
    events.emit(run_dir, "attempt_started", attempt=attempt, from_step=from_step)
    for step in range(from_step + 1, reached + 1):
        events.log_metrics(run_dir, step=step, attempt=attempt)


def test_repeated_failures_at_one_step_back_off_up_to_a_minute(tmp_path):
    from workers.failures import BACKOFF_MAX_S, backoff_s

    run_dir = str(tmp_path)
    delays = []
    for attempt in range(1, 12):
        delays.append(backoff_s(run_dir, attempt))
        _attempt(run_dir, attempt, from_step=10, reached=13)  # each fails at step 14
    assert delays[:6] == [0, 0, 2, 4, 8, 16]  # attempt 1 has nothing before it; 2 follows one failure
    assert delays[-1] == BACKOFF_MAX_S and max(delays) == BACKOFF_MAX_S


def test_progress_resets_the_back_off(tmp_path):
    from workers.failures import backoff_s

    run_dir = str(tmp_path)
    for attempt, reached in enumerate([13, 13, 13], start=1):
        _attempt(run_dir, attempt, from_step=10, reached=reached)
    assert backoff_s(run_dir, 4) == 4
    _attempt(run_dir, 4, from_step=10, reached=17)  # got further: a new failure, not the same one
    assert backoff_s(run_dir, 5) == 0
    # Failures before any step (set-up) repeat at the step after the checkpoint.
    _attempt(run_dir, 5, from_step=10, reached=10)
    _attempt(run_dir, 6, from_step=10, reached=10)
    assert backoff_s(run_dir, 7) == 2
