"""Failure classification (DESIGN.md invariant 4), blame and back-off.

Free of Ray, so the service reads run records with the same rules the workers write
them by; the controller-side recorder is workers/recorder.py.
"""

from __future__ import annotations

import traceback
from typing import Any

from workers import events, metrics_read
from workers.events import Kind

INFRASTRUCTURE = "infrastructure"
DETERMINISTIC = "deterministic"
TRANSIENT = "transient"

# Errors a rank sees when a peer dies or stalls: these are the peer's failure, not a bug.
_COMMUNICATION = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe",
                  "timed out", "timeout", "peer", "socket", "process group", "distbackenderror")


class DeterministicTrainingError(RuntimeError):
    """Training code failed in a way a retry would repeat; carries the original error."""


def signature(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# The errors a program makes of its own: whatever their message says ("timeout must be
# positive", "peer list is empty"), they are the training code's, never a peer's.
_PROGRAMMING = (ValueError, TypeError, LookupError, AttributeError, NameError, AssertionError, ArithmeticError,
                NotImplementedError, ImportError, SyntaxError)


def is_communication_error(exc: BaseException) -> bool:
    """A peer's or the network's failure, as a rank sees it. torch's collectives and gloo
    raise RuntimeError (or its DistError subclasses) with the cause only in the message,
    so the message is read, but only for errors that are not a program's own mistakes."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, _PROGRAMMING):
        return False
    text = f"{type(exc).__name__} {exc}".lower()
    return any(marker in text for marker in _COMMUNICATION)


def classify(exc: BaseException, *, step: int, completed_steps: int, history: list[dict[str, Any]]) -> str:
    """INFRASTRUCTURE: a peer or the network failed. DETERMINISTIC: the user's code
    failed before any step completed, or failed the same way at the same step before.
    TRANSIENT: anything else; retried like infrastructure."""
    from workers.faults import InjectedFault

    if isinstance(exc, InjectedFault) or is_communication_error(exc):
        return INFRASTRUCTURE
    if completed_steps == 0:
        return DETERMINISTIC
    sig = signature(exc)
    if any(h.get("signature") == sig and h.get("step") == step for h in history):
        return DETERMINISTIC
    return TRANSIENT


def record_worker_error(run_dir: str, exc: BaseException, *, rank: int, step: int, attempt: int | None,
                        completed_steps: int, activity: str | None = None) -> str:
    """Called by a worker on its own exception: write `worker_failed`, return the class."""
    history = events.events(run_dir, Kind.WORKER_FAILED)
    kind = classify(exc, step=step, completed_steps=completed_steps, history=history)
    events.emit(run_dir, events.WorkerFailed(
        rank=rank, step=step, attempt=attempt, classification=kind, signature=signature(exc), error=str(exc)[:2000],
        activity=activity, traceback="".join(traceback.format_exception(exc))[-4000:]))
    return kind


def culprit(failed: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What failed first-hand among one attempt's failure events: an injected fault, a
    hung or dead process or driver, then a non-communication error; peers' connection
    errors are only echoes of it."""
    for match in (lambda e: e["event"] == Kind.FAULT_INJECTED,
                  lambda e: e.get("hung") or e.get("process_died") or e["event"] == Kind.DRIVER_LOST,
                  lambda e: e.get("classification") != INFRASTRUCTURE,
                  lambda e: True):
        hit = next((e for e in failed if match(e)), None)
        if hit is not None:
            return hit
    return None


BACKOFF_BASE_S, BACKOFF_MAX_S = 2.0, 60.0


def backoff_s(run_dir: str, attempt: int) -> float:
    """How long attempt `attempt` waits before it starts: nothing after one failure, then
    2, 4, 8 ... up to 60 s while the attempts before it keep failing at the same step.
    So an unlimited retry budget (max_failures: -1) cannot spin without pause."""
    if attempt <= 2:
        return 0.0
    starts = {e["attempt"]: e.get("from_step", 0) for e in events.events(run_dir, Kind.ATTEMPT_STARTED)}
    reached = metrics_read.reached(run_dir)
    # The step each earlier attempt failed at: one past the last it completed.
    failed_at = [reached.get(a, starts.get(a, 0)) + 1 for a in range(1, attempt)]
    repeats = 1
    while repeats < len(failed_at) and failed_at[-1 - repeats] == failed_at[-1]:
        repeats += 1
    return 0.0 if repeats < 2 else min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (repeats - 2))
