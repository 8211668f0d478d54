"""service.decide as a table: what the reconciler does for each (ledger row, Ray status,
run record) it can see."""

from __future__ import annotations

import pytest

from service.decide import SEND_WINDOW_S, Action, Do, Seen, decide
from service.lifecycle import JobState

Q, S, RUN, REC = JobState.QUEUED, JobState.SUBMITTED, JobState.RUNNING, JobState.RECOVERING
OK, FAIL, CANC = JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED

CASES = [
    # (what it sees, what it does, why)
    (Seen(Q, idle_s=0.5), Action(Do.NOTHING), "a fresh job is left to the request that created it"),
    (Seen(Q, idle_s=5), Action(Do.SUBMIT), "a queued job is submitted after the grace period"),
    (Seen(Q, cancel_requested=True, ray_status=None), Action(Do.SET_STATE, CANC),
     "cancelled before Ray took it: cancelled, never started"),
    (Seen(Q, cancel_requested=True, ray_status=None, sending_s=0.2), Action(Do.NOTHING),
     "cancelled while the request sends it to Ray: wait for Ray's answer, the sender stops it"),
    (Seen(Q, cancel_requested=True, ray_status=None, sending_s=SEND_WINDOW_S + 1), Action(Do.SET_STATE, CANC),
     "cancelled, and the sender went silent past the send window: it died, cancelled"),
    (Seen(Q, cancel_requested=True, ray_status="STOPPED", sending_s=0.2), Action(Do.SET_STATE, CANC),
     "cancelled, and Ray took the send and stopped it: cancelled"),
    (Seen(REC, pending_submission=True, cancel_requested=True, ray_status=None, sending_s=0.2), Action(Do.NOTHING),
     "cancelled while a resubmission is with Ray: wait for Ray's answer"),
    (Seen(Q, cancel_requested=True, ray_status="PENDING"), Action(Do.STOP),
     "cancelled, but Ray took it after all: stop it first"),
    (Seen(S, ray_status="PENDING", phase="starting"), Action(Do.NOTHING), "starting: no state change"),
    (Seen(S, ray_status="RUNNING", phase="training"), Action(Do.SET_STATE, RUN), "a completed step: RUNNING"),
    (Seen(RUN, ray_status="RUNNING", phase="training"), Action(Do.NOTHING), "training on"),
    (Seen(RUN, ray_status="RUNNING", phase="training", restarts_changed=True), Action(Do.SYNC),
     "a restart without a failure keeps it running"),
    (Seen(RUN, ray_status="RUNNING", phase="recovering"), Action(Do.SET_STATE, REC), "a worker failed"),
    (Seen(REC, ray_status="RUNNING", phase="training"), Action(Do.SET_STATE, RUN), "resumed"),
    (Seen(RUN, ray_status="RUNNING", phase="finishing"), Action(Do.NOTHING), "done; Ray ends the job next"),
    (Seen(RUN, ray_status="SUCCEEDED", phase="finishing"), Action(Do.SET_STATE, OK), "succeeded"),
    (Seen(RUN, ray_status="FAILED", phase="failed", run_error="boom"), Action(Do.SET_STATE, FAIL, "boom"),
     "the driver's verdict: failed, with its error"),
    (Seen(RUN, ray_status="FAILED", phase="training", resubmits=0), Action(Do.RESUBMIT),
     "driver lost without a verdict: resubmit"),
    (Seen(RUN, ray_status=None, phase="training", resubmits=2), Action(Do.RESUBMIT),
     "Ray forgot the job (a head restart): resubmit"),
    (Seen(RUN, ray_status="FAILED", phase="training", resubmits=3, max_resubmits=3),
     Action(Do.SET_STATE, FAIL, "the job's Ray driver was lost 4 times (last Ray status FAILED); giving up"),
     "lost too often"),
    (Seen(RUN, ray_status="STOPPED", phase="training"),
     Action(Do.SET_STATE, CANC, "the Ray job was stopped through Ray, not this service"),
     "stopped through Ray directly: cancelled, never resubmitted"),
    (Seen(REC, pending_submission=True, ray_status=None, phase="training"), Action(Do.RETRY_SUBMIT),
     "a resubmission Ray refused is sent again, same id, no budget spent"),
    (Seen(REC, pending_submission=True, ray_status="PENDING", phase="training"), Action(Do.CONFIRM),
     "Ray has the claimed submission (its answer was lost): count it"),
    (Seen(REC, pending_submission=True, cancel_requested=True, ray_status=None), Action(Do.SET_STATE, CANC),
     "cancel wins over a pending resubmission"),
    (Seen(REC, pending_submission=True, cancel_requested=True, ray_status="RUNNING"), Action(Do.STOP),
     "cancel wins over a resubmission Ray already took"),
    (Seen(RUN, cancel_requested=True, ray_status="RUNNING", phase="training"), Action(Do.STOP), "cancel: stop"),
    (Seen(RUN, cancel_requested=True, ray_status="STOPPED", phase="training"), Action(Do.SET_STATE, CANC),
     "cancel confirmed by Ray"),
    (Seen(RUN, cancel_requested=True, ray_status="SUCCEEDED", phase="finished"), Action(Do.SET_STATE, OK),
     "finished before the cancel reached it"),
    (Seen(RUN, cancel_requested=True, ray_status="FAILED", phase="training", resubmits=0), Action(Do.SET_STATE, CANC),
     "a cancelled job whose driver died is never resubmitted"),
    (Seen(S, ray_status="PENDING", phase="starting", waiting_s=30, scheduling_timeout_s=60), Action(Do.NOTHING),
     "waiting for resources within its timeout"),
    (Seen(S, ray_status="RUNNING", phase="starting", waiting_s=61, scheduling_timeout_s=60),
     Action(Do.STOP, FAIL, "no worker completed a step within scheduling_timeout_s (60s): the cluster has not given "
            "the job its resources (or its start-up took longer); raise the timeout or free resources"),
     "waited past its scheduling timeout: stopped and failed, saying why"),
    (Seen(S, ray_status="RUNNING", phase="starting", waiting_s=10_000), Action(Do.NOTHING),
     "no scheduling timeout: wait for ever"),
]


@pytest.mark.parametrize("seen, action, why", CASES, ids=[c[2] for c in CASES])
def test_decide(seen, action, why):
    assert decide(seen) == action


def test_every_action_is_in_the_table():
    assert {a.do for _, a, _ in CASES} == set(Do)


def test_a_queued_job_waits_for_room_under_max_active_jobs():
    assert decide(Seen(Q, idle_s=5, room=False)) == Action(Do.NOTHING)
    assert decide(Seen(Q, idle_s=5, room=True)) == Action(Do.SUBMIT)
    assert decide(Seen(Q, idle_s=5, room=False, cancel_requested=True)) == Action(Do.SET_STATE, CANC)
