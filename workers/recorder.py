"""The Ray Train controller's side of failure handling.

A policy returns a decision; the Ray Train controller acts on it. Ray Train retries
every worker-group error up to FailureConfig.max_failures and has no public hook to
mark an error final, but an exception raised from a UserCallback ends the run at
once as a non-retryable controller error: that is how a deterministic user error
stops the job within one attempt.
"""

from __future__ import annotations

from ray.train import UserCallback

from workers import events
from workers.failures import DETERMINISTIC, INFRASTRUCTURE, DeterministicTrainingError


def _unwrap(exc: BaseException) -> BaseException:
    # Ray wraps a worker's exception with its traceback string, and a dead actor's
    # error in a health-check error; look through both.
    for attr in ("_base_exc", "health_check_failure"):
        inner = getattr(exc, attr, None)
        if isinstance(inner, BaseException):
            return inner
    return exc


def _is_process_death(exc: BaseException) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(_unwrap(exc), RayActorError)


class FailureRecorder(UserCallback):
    """Runs in the Ray Train controller: records deaths workers cannot record themselves
    and ends the run when a worker reports a deterministic error."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        for rank, exc in sorted(worker_exceptions.items()):
            if _is_process_death(exc):
                events.emit(self.run_dir, events.WorkerFailed(
                    rank=rank, classification=INFRASTRUCTURE, error="worker process died",
                    detail=str(_unwrap(exc))[:1000], process_died=True))
        for rank, exc in sorted(worker_exceptions.items()):
            inner = _unwrap(exc)
            if isinstance(inner, DeterministicTrainingError) or "DeterministicTrainingError" in str(exc):
                message = str(inner.args[0]) if isinstance(inner, DeterministicTrainingError) else str(exc)
                events.emit(self.run_dir, events.Failed(rank=rank, classification=DETERMINISTIC, error=message[:4000]))
                raise DeterministicTrainingError(message)
