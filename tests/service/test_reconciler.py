"""The reconciler on a FakeGateway and hand-written run directories: Ray's status plus
the events the workers would write decide each job's state (DESIGN.md invariants 4, 5)."""

from __future__ import annotations

import os
import shutil
import time

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.exc import OperationalError

from api.app import create_app
from service import jobs, ledger, reconciler, rundir
from service.gateway import GatewayError
from service.settings import Settings
from tests.fakes import FakeGateway
from workers import events

TOKEN = "reconciler-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_RESUBMITS = 2


class FlakyGateway(FakeGateway):
    """A FakeGateway whose Ray can be switched off (submit and stop refused), and whose
    submit runs `during()` while the request is with Ray: what another replica does meanwhile."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.down = False
        self.during = None

    def submit(self, **kw) -> None:
        if self.during is not None:
            self.during()
        if self.down:
            raise GatewayError("connection refused")
        super().submit(**kw)

    def stop(self, submission_id: str) -> None:
        if self.down:
            raise GatewayError("connection refused")
        super().stop(submission_id)


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(data_dir=tmp_path / "data", token=TOKEN, storage=None, max_resubmits=MAX_RESUBMITS)


@pytest.fixture
def gateway() -> FlakyGateway:
    return FlakyGateway()


def submit(client, job_id: str) -> dict:
    body = {"job_id": job_id, "workers": 2, "dataset": {"name": "synthetic", "size": 64},
            "training": {"max_steps": 20, "global_batch_size": 8}}
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def tick(app) -> None:
    app.state.reconciler.tick()


def job(app, job_id: str) -> ledger.Job:
    return ledger.get_job(app.state.ledger, job_id=job_id)


def rd(settings, job_id: str) -> str:
    path = os.path.join(settings.runs_dir, job_id)
    os.makedirs(path, exist_ok=True)
    return path


def set_ray(gateway, job_id: str, status: str) -> None:
    """Ray's status of the job's newest submission."""
    newest = [sid for sid, v in gateway.submitted.items() if v["job_id"] == job_id][-1]
    gateway.statuses[newest] = status


def step(run: str, n: int = 1, attempt: int = 1, **fields) -> None:
    """A metrics line: a worker of `attempt` completed step `n`."""
    events.log_metrics(run, step=n, epoch=0, loss=1.0, attempt=attempt, **fields)


def test_submitted_job_becomes_running_once_a_worker_completes_a_step(client, app, settings, gateway):
    submit(client, "a")
    run = rd(settings, "a")
    set_ray(gateway, "a", "RUNNING")
    tick(app)
    assert job(app, "a").state == "SUBMITTED"  # Ray runs the driver, no worker trains yet
    events.emit(run, "job_started", pid=1)
    events.emit(run, "worker_started", attempt=1, rank=0, pid=10, node_id="n1")
    events.emit(run, "attempt_started", attempt=1, world_size=2, total_steps=20)
    tick(app)
    # Workers up, data and model loaded: still not training, so not RUNNING (a fault
    # request now would find nothing to act on).
    assert job(app, "a").state == "SUBMITTED"
    assert client.get("/v1/jobs/a").json()["progress"]["phase"] == "starting"
    step(run)
    tick(app)
    assert job(app, "a").state == "RUNNING"
    assert client.get("/v1/jobs/a").json()["progress"]["phase"] == "training"
    tick(app)  # stable
    assert job(app, "a").state == "RUNNING"
    assert client.get("/v1/jobs/a").json()["state"] == "RUNNING"


def test_worker_failure_means_recovering_until_resumed(client, app, settings, gateway):
    submit(client, "b")
    run = rd(settings, "b")
    set_ray(gateway, "b", "RUNNING")
    t0 = time.time()
    events.emit(run, "attempt_started", attempt=1, total_steps=20, time=t0)
    step(run, time=t0 + 0.5)
    tick(app)
    assert job(app, "b").state == "RUNNING"

    events.emit(run, "worker_failed", rank=1, classification="infrastructure", time=t0 + 1)
    tick(app)
    assert job(app, "b").state == "RECOVERING"
    tick(app)
    assert job(app, "b").state == "RECOVERING"  # a new attempt alone is not recovery
    events.emit(run, "attempt_started", attempt=2, total_steps=20, time=t0 + 2)
    tick(app)
    assert job(app, "b").state == "RECOVERING"

    events.emit(run, "resumed", from_step=10, lost_steps=3, recovery_s=4.5, time=t0 + 3)
    tick(app)
    assert job(app, "b").state == "RUNNING"
    assert job(app, "b").restarts == 1
    public = client.get("/v1/jobs/b").json()
    assert public["restarts"] == 1 and public["steps_recomputed"] == 3
    registry = app.state.metrics.registry
    assert registry.get_sample_value("etrain_job_restarts_total") == 1
    assert registry.get_sample_value("etrain_steps_recomputed_total") == 3

    events.emit(run, "fault_injected", rank=0, time=t0 + 4)  # a failure after the resume: recovering again
    tick(app)
    assert job(app, "b").state == "RECOVERING"


def test_ray_succeeded_with_finished_event_is_succeeded(client, app, settings, gateway):
    submit(client, "c")
    run = rd(settings, "c")
    events.emit(run, "attempt_started", attempt=1, total_steps=20)
    set_ray(gateway, "c", "RUNNING")
    tick(app)
    events.emit(run, "finished", attempt=1, final_step=20, loss=0.25)
    set_ray(gateway, "c", "SUCCEEDED")
    tick(app)
    assert job(app, "c").state == "SUCCEEDED"
    public = client.get("/v1/jobs/c").json()
    assert public["result"]["final_step"] == 20 and public["progress"]["step"] == 20
    gateway.statuses.clear()  # a finished job is not looked at again
    tick(app)
    assert job(app, "c").state == "SUCCEEDED"


def test_ray_failed_with_failed_event_is_failed_with_the_error(client, app, settings, gateway):
    submit(client, "d")
    run = rd(settings, "d")
    events.emit(run, "attempt_started", attempt=1, total_steps=20)
    events.emit(run, "worker_failed", rank=0, classification="deterministic",
                traceback='Traceback (most recent call last):\n  File "loop.py"\nValueError: bad shape')
    events.emit(run, "failed", rank=0, classification="deterministic", error="ValueError: bad shape")
    set_ray(gateway, "d", "FAILED")
    tick(app)
    failed = job(app, "d")
    assert failed.state == "FAILED"
    assert failed.error == "ValueError: bad shape"
    assert failed.resubmits == 0 and len(gateway.submitted) == 1  # a user's error is not retried
    public = client.get("/v1/jobs/d").json()
    assert public["error"]["message"] == "ValueError: bad shape"
    assert "ValueError: bad shape" in public["error"]["traceback"]


@pytest.mark.parametrize("lost_status", ["FAILED", None])
@pytest.mark.parametrize("was", ["SUBMITTED", "RUNNING"])
def test_lost_driver_is_resubmitted_and_recovers(client, app, settings, gateway, lost_status, was):
    first = submit(client, "e")
    run = rd(settings, "e")
    events.emit(run, "job_started", pid=1)
    if was == "RUNNING":
        events.emit(run, "attempt_started", attempt=1, total_steps=20)
        step(run)
        set_ray(gateway, "e", "RUNNING")
        tick(app)
    assert job(app, "e").state == was
    if lost_status is None:
        del gateway.statuses[first["submission_id"]]  # Ray forgot the job (its head restarted)
    else:
        set_ray(gateway, "e", lost_status)

    tick(app)
    lost = job(app, "e")
    assert lost.state == "RECOVERING"
    assert lost.submission_id == "etrain-e-2" and lost.submission_id.endswith("-2")
    assert lost.resubmits == 1 and lost.resubmitted_at is not None
    assert list(gateway.submitted) == ["etrain-e-1", "etrain-e-2"]
    assert gateway.submitted["etrain-e-2"]["spec_path"] == os.path.join(run, "spec.json")
    assert client.get("/v1/jobs/e").json()["resubmits"] == 1

    # The new driver runs, but training has not resumed yet: still recovering.
    gateway.statuses["etrain-e-2"] = "RUNNING"
    events.emit(run, "job_started", pid=2)
    events.emit(run, "attempt_started", attempt=1, total_steps=20)
    tick(app)
    assert job(app, "e").state == "RECOVERING"
    events.emit(run, "resumed", from_step=10, lost_steps=2, recovery_s=3.0)
    tick(app)
    assert job(app, "e").state == "RUNNING"
    assert len(gateway.submitted) == 2


def test_driver_lost_too_often_fails_the_job(client, app, settings, gateway):
    submit(client, "f")
    rd(settings, "f")
    for n in range(1, MAX_RESUBMITS + 1):
        gateway.statuses[f"etrain-f-{n}"] = "FAILED"
        tick(app)
        assert job(app, "f").state == "RECOVERING"
        assert job(app, "f").resubmits == n and job(app, "f").submission_id == f"etrain-f-{n + 1}"
    gateway.statuses[f"etrain-f-{MAX_RESUBMITS + 1}"] = "FAILED"
    tick(app)
    final = job(app, "f")
    assert final.state == "FAILED"
    assert final.resubmits == MAX_RESUBMITS
    assert "lost" in final.error and str(MAX_RESUBMITS + 1) in final.error
    assert len(gateway.submitted) == MAX_RESUBMITS + 1
    tick(app)
    assert len(gateway.submitted) == MAX_RESUBMITS + 1  # terminal: never resubmitted again


def test_cancel_requested_and_ray_stopped_is_cancelled(client, app, settings, gateway):
    submit(client, "g")
    run = rd(settings, "g")
    events.emit(run, "attempt_started", attempt=1, total_steps=20)
    step(run)
    set_ray(gateway, "g", "RUNNING")
    tick(app)
    assert client.post("/v1/jobs/g/cancel").status_code == 200
    assert gateway.stopped == ["etrain-g-1"]
    gateway.statuses["etrain-g-1"] = "RUNNING"  # Ray has not stopped it yet
    tick(app)
    assert job(app, "g").state == "RUNNING"
    assert gateway.stopped == ["etrain-g-1", "etrain-g-1"]  # asked again
    tick(app)
    assert job(app, "g").state == "CANCELLED"
    assert job(app, "g").resubmits == 0 and len(gateway.submitted) == 1  # a stopped job is not "lost"


def test_cancelled_job_that_finished_first_is_succeeded(client, app, settings, gateway):
    submit(client, "h")
    run = rd(settings, "h")
    events.emit(run, "attempt_started", attempt=1, total_steps=20)
    client.post("/v1/jobs/h/cancel")
    events.emit(run, "finished", attempt=1, final_step=20, loss=0.1)
    gateway.statuses["etrain-h-1"] = "SUCCEEDED"
    tick(app)
    assert job(app, "h").state == "SUCCEEDED"


def _age(app, job_id: str, seconds: float) -> None:
    with app.state.ledger() as s:
        row = s.get(ledger.Job, job_id)
        row.updated_at -= seconds
        s.commit()


def test_queued_job_is_submitted_after_the_grace_period(client, app, settings, gateway):
    gateway.down = True
    queued = submit(client, "q")
    assert queued["state"] == "QUEUED" and gateway.submitted == {}
    gateway.down = False
    tick(app)
    assert job(app, "q").state == "QUEUED" and gateway.submitted == {}  # fresh: the request may still submit it
    _age(app, "q", reconciler.QUEUED_GRACE_S + 1)
    tick(app)
    assert job(app, "q").state == "SUBMITTED"
    assert list(gateway.submitted) == ["etrain-q-1"]  # the id recorded before Ray was first asked
    assert os.path.exists(os.path.join(settings.runs_dir, "q", "spec.json"))


def test_queued_job_stays_queued_while_ray_is_down(client, app, gateway):
    gateway.down = True
    submit(client, "r")
    _age(app, "r", reconciler.QUEUED_GRACE_S + 1)
    tick(app)
    assert job(app, "r").state == "QUEUED"
    gateway.down = False
    _age(app, "r", reconciler.QUEUED_GRACE_S + 1)
    tick(app)
    assert job(app, "r").state == "SUBMITTED"


def test_job_cancelled_while_queued_is_never_started(client, app, settings, gateway):
    gateway.down = True
    submit(client, "s")
    assert client.post("/v1/jobs/s/cancel").status_code == 200
    gateway.down = False
    _age(app, "s", reconciler.QUEUED_GRACE_S + 1)
    tick(app)
    tick(app)
    assert job(app, "s").state == "CANCELLED"
    assert gateway.submitted == {}


def test_one_failing_job_does_not_stop_the_others(client, app, settings, gateway, monkeypatch):
    submit(client, "t1")
    submit(client, "t2")
    for name in ("t1", "t2"):
        events.emit(rd(settings, name), "attempt_started", attempt=1, total_steps=20)
        step(rd(settings, name))
        set_ray(gateway, name, "RUNNING")
    summary = rundir.summary

    def unreadable_t1(path: str, *history) -> dict:
        if path.endswith("t1"):
            raise OSError("t1's run record is unreadable")
        return summary(path, *history)

    monkeypatch.setattr(rundir, "summary", unreadable_t1)
    tick(app)
    assert job(app, "t1").state == "SUBMITTED"
    assert job(app, "t2").state == "RUNNING"


def test_job_cancelled_while_queued_that_ray_took_after_all_is_stopped(client, app, settings, gateway):
    gateway.down = True
    submit(client, "u")
    # The submission timed out here but reached Ray: Ray runs it under the recorded id.
    gateway.submitted["etrain-u-1"] = {"spec_path": "", "job_id": "u"}
    gateway.statuses["etrain-u-1"] = "PENDING"
    assert client.post("/v1/jobs/u/cancel").status_code == 200  # Ray unreachable for the stop
    gateway.down = False
    _age(app, "u", reconciler.QUEUED_GRACE_S + 1)
    tick(app)
    assert gateway.stopped == ["etrain-u-1"]
    tick(app)
    assert job(app, "u").state == "CANCELLED"
    assert list(gateway.submitted) == ["etrain-u-1"]


def test_a_restart_without_a_failure_keeps_the_job_running(client, app, settings, gateway):
    # An elastic job grown by Ray restarts its workers: starting again, but it was and
    # stays RUNNING (no state goes back to SUBMITTED).
    submit(client, "grow")
    run = rd(settings, "grow")
    set_ray(gateway, "grow", "RUNNING")
    events.emit(run, "job_started", pid=1)
    events.emit(run, "attempt_started", attempt=1, world_size=1, total_steps=20)
    step(run)
    tick(app)
    assert job(app, "grow").state == "RUNNING"
    events.emit(run, "attempt_started", attempt=2, world_size=2, total_steps=20)
    tick(app)
    assert job(app, "grow").state == "RUNNING"
    assert client.get("/v1/jobs/grow").json()["progress"]["phase"] == "starting"
    r = client.post("/v1/jobs/grow/faults", json={"rank": 0})
    assert r.status_code == 409 and "restarting its workers (attempt 2)" in r.json()["detail"], r.text


# ---------------------------------------------------------------- the phase, as a table

T = 1000.0


def ev(kind: str, t: float, **fields) -> dict:
    return {"event": kind, "time": T + t, **fields}


def metric(t: float, attempt: int | None = 1) -> dict:
    return {"step": 1, "time": T + t, **({"attempt": attempt} if attempt is not None else {})}


UP = [ev("job_started", 0), ev("worker_started", 1, attempt=1, rank=0, pid=9), ev("attempt_started", 2, attempt=1)]
PHASES = [
    # (events, newest metrics line, phase)
    ([], None, "starting"),
    (UP[:1], None, "starting"),
    (UP, None, "starting"),
    (UP, metric(3), "training"),
    (UP, metric(3, attempt=None), "training"),  # lines written before metrics carried `attempt`
    (UP + [ev("worker_failed", 4, rank=1)], metric(3), "recovering"),
    (UP + [ev("worker_failed", 2.5, rank=1)], None, "recovering"),  # before the first step
    (UP + [ev("worker_failed", 4, rank=1), ev("attempt_started", 5, attempt=2)], metric(3), "recovering"),
    (UP + [ev("worker_failed", 4, rank=1), ev("attempt_started", 5, attempt=2), ev("resumed", 6)], metric(3),
     "training"),
    (UP + [ev("worker_failed", 4, rank=1), ev("attempt_started", 5, attempt=2)], metric(6, attempt=2), "training"),
    (UP + [ev("attempt_started", 5, attempt=2)], metric(3), "starting"),  # restarted without a failure
    (UP + [ev("attempt_started", 5, attempt=2)], metric(6, attempt=1), "starting"),  # a late line of attempt 1
    # A lost driver is dated by its last sign of life: its last step.
    (UP + [ev("driver_lost", 3)], metric(3), "recovering"),
    (UP + [ev("driver_lost", 3), ev("job_started", 10), ev("attempt_started", 12, attempt=2)], metric(3),
     "recovering"),
    (UP + [ev("driver_lost", 3), ev("job_started", 10), ev("attempt_started", 12, attempt=2), ev("resumed", 13)],
     metric(13, attempt=2), "training"),
    (UP + [ev("finished", 9)], metric(8), "finished"),
    (UP + [ev("failed", 9)], metric(8), "failed"),
    (UP + [ev("failed", 9), ev("job_started", 10)], metric(8), "starting"),  # a new driver: the old verdict is past
]


@pytest.mark.parametrize(("history", "latest", "expected"), PHASES, ids=[f"{i}-{p[2]}" for i, p in enumerate(PHASES)])
def test_phase_from_the_run_record(history, latest, expected):
    assert rundir.phase(history, latest) == expected


def test_phase_during_a_back_off_is_recovering_and_says_so():
    history = UP + [ev("worker_failed", 4, rank=1, hung=True, error="hung: no progress"),
                    ev("backoff", 4.5, attempt=2, delay_s=8), ev("attempt_started", 5, attempt=2)]
    assert rundir.phase(history, metric(3)) == "recovering"
    assert rundir.recovery_note(history, metric(3)) == ("a failure of rank 1 (hung); its workers are being restarted, "
                                                        "after a back-off of 8s (repeated failures at one step)")


def test_a_job_stopped_through_ray_itself_is_cancelled_not_resubmitted(client, app, settings, gateway):
    submit(client, "v")
    run = rd(settings, "v")
    events.emit(run, "attempt_started", attempt=1, total_steps=20)
    step(run)
    set_ray(gateway, "v", "RUNNING")
    tick(app)
    set_ray(gateway, "v", "STOPPED")  # `ray job stop`, not the service
    tick(app)
    stopped = job(app, "v")
    assert stopped.state == "CANCELLED" and "stopped through Ray" in stopped.error
    assert list(gateway.submitted) == ["etrain-v-1"]


def test_a_resubmission_ray_refuses_spends_no_budget_and_is_sent_again(client, app, settings, gateway):
    submit(client, "w")
    rd(settings, "w")
    set_ray(gateway, "w", "FAILED")  # the driver is lost ...
    gateway.down = True  # ... and Ray refuses submissions (its head is restarting)
    for _ in range(MAX_RESUBMITS + 3):
        tick(app)
    claimed = job(app, "w")
    assert claimed.state == "RECOVERING" and claimed.pending_submission
    assert claimed.submission_id == "etrain-w-2" and claimed.resubmits == 0  # one id claimed, none spent
    gateway.down = False
    tick(app)
    sent = job(app, "w")
    assert list(gateway.submitted) == ["etrain-w-1", "etrain-w-2"]
    assert sent.resubmits == 1 and not sent.pending_submission and sent.state == "RECOVERING"


def test_a_resubmission_whose_answer_was_lost_is_counted_once(client, app, settings, gateway):
    submit(client, "x")
    rd(settings, "x")
    set_ray(gateway, "x", "FAILED")
    gateway.down = True
    tick(app)
    # Ray took etrain-x-2 after all (the answer timed out): the next tick counts it, once.
    gateway.down = False
    gateway.submitted["etrain-x-2"] = {"spec_path": "", "job_id": "x"}
    gateway.statuses["etrain-x-2"] = "PENDING"
    tick(app)
    tick(app)
    assert job(app, "x").resubmits == 1 and not job(app, "x").pending_submission
    assert list(gateway.submitted) == ["etrain-x-1", "etrain-x-2"]


def test_a_cancel_while_the_request_sends_to_ray_never_lets_ray_take_a_cancelled_job(client, app, settings, gateway):
    # CI saw it with two replicas: the cancel landed while the POST was with Ray, the other
    # replica's tick found a cancelled QUEUED job Ray did not know yet and marked it
    # CANCELLED, then Ray took the submission.
    seen_during = []

    def during():
        jobs.cancel(app.state.ledger, gateway, job(app, "q2"))
        tick(app)  # the other replica: the send is in flight, so it waits for Ray's answer
        seen_during.append(job(app, "q2").state)
        gateway.during = None

    gateway.during = during
    submit(client, "q2")
    assert seen_during == ["QUEUED"]
    assert gateway.stopped[-1] == "etrain-q2-1"  # the request stopped what Ray took, at once
    tick(app)
    assert job(app, "q2").state == "CANCELLED" and job(app, "q2").sending_since is None
    assert list(gateway.submitted) == ["etrain-q2-1"]


def test_a_cancelled_job_whose_sender_died_mid_send_is_cancelled_once_the_send_window_passed(client, app, settings, gateway):
    submit(client, "q4")
    with app.state.ledger() as s:  # the row as a request that died while sending leaves it
        row = s.get(ledger.Job, "q4")
        row.state, row.sending_since = "QUEUED", time.time()
        s.commit()
    gateway.submitted.clear()
    gateway.statuses.clear()
    jobs.cancel(app.state.ledger, gateway, job(app, "q4"))
    tick(app)
    assert job(app, "q4").state == "QUEUED"  # Ray may take it yet
    with app.state.ledger() as s:
        s.get(ledger.Job, "q4").sending_since -= reconciler.SEND_WINDOW_S + 1
        s.commit()
    tick(app)
    assert job(app, "q4").state == "CANCELLED" and gateway.submitted == {}


def test_no_send_begins_once_a_cancel_is_recorded(client, app, settings, gateway):
    gateway.down = True
    submit(client, "q5")  # Ray refused the request's send: no send in flight
    assert job(app, "q5").sending_since is None
    seen = job(app, "q5")
    jobs.cancel(app.state.ledger, gateway, seen)
    gateway.down = False
    with pytest.raises(ledger.Conflict):  # a replica that read the row before the cancel
        jobs.submit(app.state.ledger, settings, gateway, seen)
    assert gateway.submitted == {}
    tick(app)
    assert job(app, "q5").state == "CANCELLED"


def test_cancel_wins_over_a_resubmission_claimed_by_another_replica(client, app, settings, gateway):
    submit(client, "y")
    rd(settings, "y")
    set_ray(gateway, "y", "FAILED")
    seen = job(app, "y")  # a replica saw the lost driver ...
    assert client.post("/v1/jobs/y/cancel").status_code == 200  # ... then the cancel landed
    with pytest.raises(ledger.Conflict):
        jobs.resubmit(app.state.ledger, settings, gateway, seen)
    assert list(gateway.submitted) == ["etrain-y-1"]  # never sent
    tick(app)
    assert job(app, "y").state == "CANCELLED"


def test_two_replicas_that_see_one_lost_driver_start_one_new_driver(client, app, settings, gateway):
    submit(client, "z")
    rd(settings, "z")
    set_ray(gateway, "z", "FAILED")
    seen = job(app, "z")
    jobs.resubmit(app.state.ledger, settings, gateway, seen)  # replica A
    with pytest.raises(ledger.Conflict):
        jobs.resubmit(app.state.ledger, settings, gateway, seen)  # replica B, on what it read before
    assert list(gateway.submitted) == ["etrain-z-1", "etrain-z-2"] and job(app, "z").resubmits == 1


def claimed_and_refused(client, app, settings, gateway, job_id: str) -> None:
    """A job whose driver was lost: its next submission claimed, and refused by Ray."""
    submit(client, job_id)
    rd(settings, job_id)
    set_ray(gateway, job_id, "FAILED")
    gateway.down = True
    tick(app)
    gateway.down = False
    assert job(app, job_id).pending_submission and job(app, job_id).sending_since is None


def test_a_cancel_after_the_claim_stops_the_new_driver_once_ray_has_it(client, app, settings, gateway):
    claimed_and_refused(client, app, settings, gateway, "c2")
    seen_during = []

    def during():  # the cancel lands while a replica sends the claimed submission again
        gateway.during = None
        assert client.post("/v1/jobs/c2/cancel").status_code == 200
        tick(app)
        seen_during.append(job(app, "c2").state)

    gateway.during = during
    tick(app)  # sends etrain-c2-2 again
    assert seen_during == ["RECOVERING"]  # Ray might take it yet: not CANCELLED before Ray answered
    assert "etrain-c2-2" in gateway.stopped  # the cancel recorded meanwhile wins at once
    tick(app)
    assert job(app, "c2").state == "CANCELLED"


def test_a_claimed_submission_is_not_sent_again_once_a_cancel_is_recorded(client, app, settings, gateway):
    claimed_and_refused(client, app, settings, gateway, "c3")
    claimed = job(app, "c3")
    assert client.post("/v1/jobs/c3/cancel").status_code == 200
    with pytest.raises(ledger.Conflict):  # a replica that read the claim before the cancel
        jobs.send(app.state.ledger, settings, gateway, claimed)
    tick(app)
    assert job(app, "c3").state == "CANCELLED" and list(gateway.submitted) == ["etrain-c3-1"]


def test_the_job_view_is_read_from_the_ledger_not_the_run_record(client, app, settings, gateway):
    submit(client, "view")
    run = rd(settings, "view")
    set_ray(gateway, "view", "RUNNING")
    events.emit(run, "attempt_started", attempt=1, total_steps=20)
    step(run, 7)
    tick(app)
    shutil.rmtree(run)  # storage out of reach: the view is the reconciler's copy
    public = client.get("/v1/jobs/view").json()
    assert public["progress"]["step"] == 7 and public["progress"]["phase"] == "training"
    assert client.get("/v1/jobs").json()["data"][0]["progress"]["step"] == 7


def test_a_failing_tick_is_retried_and_readyz_says_why(settings, gateway, monkeypatch):
    import asyncio

    app = create_app(settings, gateway, reconcile=False)  # its loop is driven here
    app.state.reconciling = True
    rec = app.state.reconciler
    calls = []

    def broken(_sessions):
        calls.append(1)
        if len(calls) < 3:
            raise OperationalError("SELECT", {}, Exception("the database is down"))
        return []

    monkeypatch.setattr(ledger, "active_jobs", broken)
    monkeypatch.setattr(reconciler, "MAX_BACKOFF_S", 0.05)
    settings.reconcile_interval_s = 0.01

    async def run_until(n: int) -> None:
        task = asyncio.create_task(rec.run_forever())
        while len(calls) < n:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(run_until(2))
    assert "the database is down" in rec.health.problem()
    with TestClient(app, headers=AUTH) as client:
        r = client.get("/readyz")
        assert r.status_code == 503 and "the database is down" in r.json()["reconciler"]
    asyncio.run(run_until(4))  # the loop outlived the failures and ticks again
    assert rec.health.problem() is None


def test_max_active_jobs_hands_queued_jobs_to_ray_oldest_first_as_room_frees(tmp_path, gateway):
    limited = Settings(data_dir=tmp_path / "data", token=TOKEN, storage=None, max_active_jobs=2)
    app = create_app(limited, gateway, reconcile=False)
    with TestClient(app, headers=AUTH) as client:
        states = [submit(client, f"m{i}")["state"] for i in range(4)]
        assert states == ["SUBMITTED", "SUBMITTED", "QUEUED", "QUEUED"]  # two on Ray, two wait
        for i in (2, 3):
            _age(app, f"m{i}", reconciler.QUEUED_GRACE_S + 1)
        tick(app)
        assert job(app, "m2").state == job(app, "m3").state == "QUEUED"  # still no room
        rd(limited, "m0")
        events.emit(rd(limited, "m0"), "finished", attempt=1, final_step=20, loss=0.1)
        set_ray(gateway, "m0", "SUCCEEDED")
        tick(app)  # m0 ends, and its room goes to the oldest waiting job in the same tick
        assert job(app, "m0").state == "SUCCEEDED"
        assert job(app, "m2").state == "SUBMITTED" and job(app, "m3").state == "QUEUED"
        assert list(gateway.submitted) == ["etrain-m0-1", "etrain-m1-1", "etrain-m2-1"]
