"""Job states and the only place their transitions are defined."""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    QUEUED = "QUEUED"          # in the ledger, not yet accepted by Ray
    SUBMITTED = "SUBMITTED"    # a Ray job exists; no worker has started training
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"  # a worker or the driver failed; waiting for training to resume
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
_ACTIVE = (JobState.QUEUED, JobState.SUBMITTED, JobState.RUNNING, JobState.RECOVERING)

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.SUBMITTED, JobState.FAILED, JobState.CANCELLED}),
    JobState.SUBMITTED: frozenset({JobState.RUNNING, JobState.RECOVERING, JobState.SUCCEEDED, JobState.FAILED,
                                   JobState.CANCELLED, JobState.QUEUED}),
    JobState.RUNNING: frozenset({JobState.RECOVERING, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}),
    JobState.RECOVERING: frozenset({JobState.RUNNING, JobState.SUBMITTED, JobState.SUCCEEDED, JobState.FAILED,
                                    JobState.CANCELLED}),
    **{state: frozenset() for state in TERMINAL},
}


class IllegalTransition(ValueError):
    def __init__(self, current: JobState, target: JobState):
        super().__init__(f"a {current.value} job cannot become {target.value}")
        self.current, self.target = current, target


def check(current: JobState, target: JobState) -> None:
    if current != target and target not in TRANSITIONS[current]:
        raise IllegalTransition(current, target)


def is_active(state: JobState) -> bool:
    return state in _ACTIVE
