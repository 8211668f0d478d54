"""What the reconciler does about one job: a pure function from what it sees to an action.

Decide, then do (Ray Train v2's FailurePolicy.make_decision): `decide` reads nothing and
changes nothing, so every case is a row in a table test; service.reconciler carries the
action out against the ledger and Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from service import rundir
from service.gateway import DEFAULT_TIMEOUT_S, LONG_TIMEOUT_S
from service.lifecycle import JobState

LIVE = frozenset({"PENDING", "RUNNING"})  # Ray job statuses with a driver that may still run
QUEUED_GRACE_S = 2.0  # leave a fresh job to the request that created it
# A send to Ray unanswered this long was abandoned (its sender died): longer than a send's
# own timeouts (a code archive's upload, then the submission), with room for Ray's reply.
SEND_WINDOW_S = 2 * (LONG_TIMEOUT_S + DEFAULT_TIMEOUT_S)

# Phases of a live Ray job to its state: RUNNING only once a worker of the newest attempt
# has completed a step; while starting, the state stays as it is.
_LIVE_PHASE = {rundir.TRAINING: JobState.RUNNING, rundir.RECOVERING: JobState.RECOVERING}


class Do(str, Enum):
    NOTHING = "nothing"
    SUBMIT = "submit"              # a QUEUED job's first submission
    RESUBMIT = "resubmit"          # the driver was lost: claim the next submission id and send it
    RETRY_SUBMIT = "retry_submit"  # a claimed submission Ray has not accepted yet: send the same id again
    CONFIRM = "confirm"            # Ray has the claimed submission: count it against the budget
    STOP = "stop"                  # stop the Ray job; then set `state` when one is given
    SET_STATE = "set_state"
    SYNC = "sync"                  # copy the restarts count; the state stays


@dataclass(frozen=True)
class Seen:
    """One job as the reconciler sees it in one tick."""

    state: JobState
    cancel_requested: bool = False
    ray_status: str | None = None      # of the newest submission; None: Ray does not know it
    phase: str = "queued"              # jobs.phase: the run record's phase with the ledger's view
    pending_submission: bool = False   # the newest submission id is claimed, not yet accepted by Ray
    resubmits: int = 0                 # resubmissions Ray accepted
    max_resubmits: int = 3
    idle_s: float = 0.0                # since the ledger row last changed
    room: bool = True                  # fewer jobs on Ray than ETRAIN_MAX_ACTIVE_JOBS
    waiting_s: float | None = None     # since Ray accepted it, while no worker has completed a step
    sending_s: float | None = None     # since a send to Ray began, while it is unanswered
    scheduling_timeout_s: float | None = None
    run_error: str | None = None       # the run record's failure message
    restarts_changed: bool = False


@dataclass(frozen=True)
class Action:
    do: Do
    state: JobState | None = None
    error: str | None = None


NOTHING = Action(Do.NOTHING)


def decide(seen: Seen) -> Action:
    if seen.state == JobState.QUEUED and not seen.cancel_requested:
        # Never started: submit once the creating request had its chance to.
        return Action(Do.SUBMIT) if seen.idle_s > QUEUED_GRACE_S and seen.room else NOTHING
    live = seen.ray_status in LIVE
    finished = seen.phase in (rundir.FINISHED, rundir.FINISHING)
    if seen.cancel_requested:
        # Cancel wins: stop whatever Ray runs, and end the job only once Ray confirms.
        if live:
            return Action(Do.STOP)
        if seen.ray_status is None and seen.sending_s is not None and seen.sending_s < SEND_WINDOW_S:
            # Ray may take it yet: the sender stops it once Ray answers (jobs.submit, accepted).
            # Ended now, Ray could run a job the ledger already calls CANCELLED.
            return NOTHING
        return Action(Do.SET_STATE, JobState.SUCCEEDED if finished else JobState.CANCELLED)
    if seen.pending_submission:
        # Budget is spent only on what Ray accepted: a refused send is retried, same id.
        return Action(Do.CONFIRM) if seen.ray_status is not None else Action(Do.RETRY_SUBMIT)
    if live:
        return _while_live(seen)
    # The Ray job has ended, or Ray no longer knows it.
    if finished:
        return Action(Do.SET_STATE, JobState.SUCCEEDED)
    if seen.phase == rundir.FAILED:
        return Action(Do.SET_STATE, JobState.FAILED, seen.run_error)
    if seen.ray_status == "STOPPED":
        # Only cancel and the scheduling timeout stop jobs here, and both are handled
        # above: someone stopped it through Ray itself, which is a cancel too.
        return Action(Do.SET_STATE, JobState.CANCELLED, "the Ray job was stopped through Ray, not this service")
    if seen.resubmits < seen.max_resubmits:
        return Action(Do.RESUBMIT)  # the driver died without a verdict; it resumes from its checkpoint
    return Action(Do.SET_STATE, JobState.FAILED,
                  f"the job's Ray driver was lost {seen.resubmits + 1} times (last Ray status "
                  f"{seen.ray_status}); giving up")


def _while_live(seen: Seen) -> Action:
    timeout = seen.scheduling_timeout_s
    if timeout is not None and seen.waiting_s is not None and seen.waiting_s > timeout:
        return Action(Do.STOP, JobState.FAILED,
                      f"no worker completed a step within scheduling_timeout_s ({timeout:g}s): the cluster has not "
                      "given the job its resources (or its start-up took longer); raise the timeout or free resources")
    target = _LIVE_PHASE.get(seen.phase)
    if target is not None and target != seen.state:
        return Action(Do.SET_STATE, target)
    return Action(Do.SYNC) if seen.restarts_changed else NOTHING
