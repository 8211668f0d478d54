"""Job operations shared by the API and the reconciler: create, submit, cancel, fault."""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import time
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from service import code, ledger, rundir
from service.gateway import Gateway, GatewayError
from service.lifecycle import TERMINAL, IllegalTransition, JobState
from service.settings import Settings
from workers import events, metrics_read, storage
from workers.events import Kind
from workers.spec import JobSpec, write_spec_json


class NotRunning(ValueError):
    """The job has no live worker to act on."""


class StillActive(ValueError):
    """The job may still run: it cannot be deleted yet."""


class RunDirTaken(ValueError):
    """The job_id names a run directory that holds another job's spec."""


def request_hash(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def submission_name(job_id: str, n: int) -> str:
    return f"etrain-{job_id}-{n}"


def spec_path(settings: Settings, job_id: str) -> str:
    return storage.join(rundir.run_dir(settings.runs_dir, job_id), "spec.json")


def write_spec(settings: Settings, spec: JobSpec) -> str:
    """spec.json is immutable: written once, before the first submission. One that is
    there already must be this very spec, or the driver would run the other one."""
    spec = spec.model_copy(update={"storage": settings.runs_dir})
    path = write_spec_json(spec)
    if _stored_spec(path) != spec.model_dump(mode="json"):
        raise RunDirTaken(_taken(spec.job_id))
    return path


def _stored_spec(path: str) -> dict[str, Any] | None:
    """The spec in a spec.json, or None when there is none; {} when it cannot be read."""
    try:
        return JobSpec.model_validate_json(storage.read_bytes(path)).model_dump(mode="json")
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def _taken(job_id: str) -> str:
    return (f"job_id {job_id!r} names a run directory that already holds another job's spec; "
            "choose another job_id")


def create(sessions: sessionmaker[Session], settings: Settings, spec: JobSpec, *, body: dict[str, Any],
           idempotency_key: str | None) -> tuple[ledger.Job, bool]:
    stored = _stored_spec(spec_path(settings, spec.job_id))
    if stored is not None:
        # Left by a run this ledger does not hold (`python -m workers.run` with the same
        # storage, a lost ledger), or by the same job_id with another spec: answering 201
        # would run that spec, not this one.
        known = ledger.get_job(sessions, job_id=spec.job_id)
        admitted = spec.model_copy(update={"storage": settings.runs_dir}).model_dump(mode="json")
        if known is None or stored != admitted:
            raise RunDirTaken(_taken(spec.job_id))
    # The first submission id is fixed at insert: one commit fewer on every POST.
    # Without ETRAIN_MAX_ACTIVE_JOBS the request sends it to Ray next (try_submit): the row
    # claims that send at insert, so a cancel arriving meanwhile waits for Ray's answer.
    return ledger.create_job(sessions, job_id=spec.job_id, spec=spec.model_dump(mode="json"),
                             request_hash=request_hash(body), idempotency_key=idempotency_key,
                             submission_id=submission_name(spec.job_id, 1),
                             sending=settings.max_active_jobs is None)


def _prepared(sessions: sessionmaker[Session], settings: Settings, job: ledger.Job) -> dict[str, Any] | None:
    """What Ray is handed for a job: its spec.json and code archive. None, with the job
    FAILED, when either cannot be: a run directory holding another spec, a lost archive."""
    spec = JobSpec.model_validate(job.spec_dict)
    try:
        path = write_spec(settings, spec)
    except RunDirTaken as e:
        ledger.update_job(sessions, job_id=job.id, state=JobState.FAILED, error=str(e))
        return None
    # A resubmitted job runs the very code it was accepted with: the spec keeps the
    # archive's id, and archives are never replaced (their name is their digest).
    archive = code.stored(settings, spec.code) if spec.code else None
    if spec.code and archive is None:
        ledger.update_job(sessions, job_id=job.id, state=JobState.FAILED,
                          error=f"code archive {spec.code} is no longer stored under {code.code_dir(settings)}")
        return None
    return {"spec_path": path, "job_id": job.id, "code_path": str(archive) if archive else None,
            "requirements": spec.requirements}


def submit(sessions: sessionmaker[Session], settings: Settings, gateway: Gateway, job: ledger.Job) -> ledger.Job:
    """Hand a QUEUED job to Ray. Its submission id was fixed when it was created and Ray
    refuses a second job with one id, so replicas and retries never start two."""
    prepared = _prepared(sessions, settings, job)
    if prepared is None:
        return ledger.get_job(sessions, job_id=job.id)
    if not job.submission_id:  # a row from before ids were fixed at creation
        job = ledger.update_job(sessions, job_id=job.id, submission_id=submission_name(job.id, 1), submissions=1,
                                expect={"submission_id": None})
    if job.sending_since is None:  # ledger.Conflict once a cancel is recorded: nothing is sent
        job = _claim_send(sessions, job, {"state": JobState.QUEUED.value})
    _send(sessions, gateway, job, prepared)  # GatewayError: it stays QUEUED
    try:
        job = ledger.update_job(sessions, job_id=job.id, state=JobState.SUBMITTED, waiting_since=time.time(),
                                sending_since=None, seen=job)
    except IllegalTransition:
        # Ended while Ray was taking it (a sender silent past decide.SEND_WINDOW_S): Ray must not run it.
        gateway.stop(job.submission_id)
        raise
    if job.cancel_requested:  # cancelled while Ray was taking it: cancel wins
        gateway.stop(job.submission_id)
    return job


def resubmit(sessions: sessionmaker[Session], settings: Settings, gateway: Gateway, job: ledger.Job) -> ledger.Job:
    """Run a job whose driver was lost again; it resumes from its newest checkpoint.

    The next submission id is claimed in the ledger first, by a compare-and-set on the
    submission count (the job's fencing token): of several replicas that saw the same loss
    one claims it, and none does once a cancel is recorded (ledger.Conflict)."""
    n = job.submissions
    now = time.time()
    job = ledger.update_job(sessions, job_id=job.id, state=JobState.RECOVERING, submission_id=submission_name(job.id, n + 1),
                            submissions=n + 1, pending_submission=True, resubmitted_at=now, sending_since=now,
                            expect={"submissions": n, "cancel_requested": False})
    return send(sessions, settings, gateway, job)


def send(sessions: sessionmaker[Session], settings: Settings, gateway: Gateway, job: ledger.Job) -> ledger.Job:
    """Hand a claimed submission to Ray; a refusal (GatewayError) leaves it claimed, to be
    sent again with the same id, and spends none of the job's resubmission budget."""
    prepared = _prepared(sessions, settings, job)
    if prepared is None:
        return ledger.get_job(sessions, job_id=job.id)
    if job.sending_since is None:  # sent again after a refusal
        job = _claim_send(sessions, job, {"submissions": job.submissions, "pending_submission": True})
    _send(sessions, gateway, job, prepared)
    return accepted(sessions, gateway, job)


def _claim_send(sessions: sessionmaker[Session], job: ledger.Job, expect: dict[str, Any]) -> ledger.Job:
    """Record that a send of the job's submission id begins. Only while no cancel is
    recorded: from then on the reconciler ends the job only once no send is in flight
    (decide), so Ray is never handed a job after the ledger called it CANCELLED."""
    return ledger.update_job(sessions, job_id=job.id, sending_since=time.time(),
                             expect={**expect, "cancel_requested": False})


def _send(sessions: sessionmaker[Session], gateway: Gateway, job: ledger.Job, prepared: dict[str, Any]) -> None:
    try:
        gateway.submit(submission_id=job.submission_id, **prepared)
    except GatewayError:
        # Ray answered (or timed out): no send is in flight now. A newer claim keeps its own mark.
        with contextlib.suppress(ledger.Conflict, KeyError):
            ledger.update_job(sessions, job_id=job.id, sending_since=None,
                              expect={"sending_since": job.sending_since})
        raise


def accepted(sessions: sessionmaker[Session], gateway: Gateway, job: ledger.Job) -> ledger.Job:
    """Ray holds the claimed submission: count it. A cancel recorded meanwhile wins."""
    try:
        job = ledger.update_job(sessions, job_id=job.id, resubmits=job.resubmits + 1, pending_submission=False,
                                waiting_since=time.time(), sending_since=None,
                                expect={"submissions": job.submissions, "pending_submission": True})
    except ledger.Conflict:  # counted already (another replica), or superseded
        return ledger.get_job(sessions, job_id=job.id)
    if job.cancel_requested:
        gateway.stop(job.submission_id)
    return job


def try_submit(sessions, settings, gateway, job: ledger.Job) -> ledger.Job:
    """Submit now if Ray takes it and ETRAIN_MAX_ACTIVE_JOBS leaves room (replicas racing
    may pass it by one or two); otherwise the job stays QUEUED for the reconciler."""
    if settings.max_active_jobs is not None:
        counts = ledger.count_by_state(sessions)
        on_ray = sum(counts[s.value] for s in (JobState.SUBMITTED, JobState.RUNNING, JobState.RECOVERING))
        if on_ray >= settings.max_active_jobs or counts[JobState.QUEUED.value] > 1:
            return job  # no room, or older jobs wait: the reconciler hands them over oldest first
    try:
        return submit(sessions, settings, gateway, job)
    except (GatewayError, IllegalTransition, ledger.Conflict):
        return ledger.get_job(sessions, job_id=job.id)


def cancel(sessions: sessionmaker[Session], gateway: Gateway, job: ledger.Job) -> ledger.Job:
    state = JobState(job.state)
    if state in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
        raise IllegalTransition(state, JobState.CANCELLED)
    if not job.submission_id:  # never named to Ray, so never on it
        return ledger.update_job(sessions, job_id=job.id, state=JobState.CANCELLED, cancel_requested=True)
    # Even a QUEUED job may have reached Ray: the reconciler marks it CANCELLED once
    # Ray confirms it is not running.
    job = ledger.update_job(sessions, job_id=job.id, cancel_requested=True)
    try:
        gateway.stop(job.submission_id)
    except GatewayError:
        pass  # the reconciler stops it again until Ray confirms
    return job


def view(sessions: sessionmaker[Session], settings: Settings, job: ledger.Job) -> dict[str, Any]:
    """A job's summary as the reconciler last kept it in the ledger: a job view reads no
    run record. Only a job the reconciler has not seen yet (just accepted, or ended before
    the ledger kept summaries) is read from its run record; an ended one is kept then."""
    info = job.summary_dict
    if info is not None:
        return info
    info = rundir.summary(rundir.run_dir(settings.runs_dir, job.id))
    if JobState(job.state) in TERMINAL:
        ledger.save_summary(sessions, job_id=job.id, summary=info)
    return info


def delete(sessions: sessionmaker[Session], settings: Settings, job: ledger.Job) -> None:
    """Remove an ended job and its run record; StillActive while it may still run."""
    state = JobState(job.state)
    if state not in TERMINAL:
        raise StillActive(f"job {job.id} is {job.state}: cancel it and wait until it has ended before deleting it")
    ledger.delete_job(sessions, job_id=job.id)
    storage.remove_tree(rundir.run_dir(settings.runs_dir, job.id))


FINISHING = rundir.FINISHING
PHASES = ("queued", rundir.STARTING, rundir.TRAINING, rundir.RECOVERING, FINISHING, rundir.FINISHED, rundir.FAILED,
          "cancelled")


def phase(job: ledger.Job, info: dict[str, Any]) -> str:
    """What a job is doing: the run record's phase (rundir.phase), with the ledger's word
    where the run record cannot know: queued, cancelled, ended, or driver resubmitted."""
    state = JobState(job.state)
    if state == JobState.QUEUED:
        return "queued"
    if state == JobState.CANCELLED:
        return "cancelled"
    if state == JobState.SUCCEEDED:
        return rundir.FINISHED
    if state == JobState.FAILED:
        return rundir.FAILED
    run_phase = info["phase"]
    if run_phase == rundir.FINISHED:
        return FINISHING
    if run_phase == rundir.TRAINING and job.resubmitted_at and (info["last_step_at"] or 0) < job.resubmitted_at:
        # The run record shows the lost driver's steps until the new driver writes.
        return rundir.RECOVERING
    return run_phase


def inject_fault(settings: Settings, gateway: Gateway, job: ledger.Job, rank: int | None) -> dict[str, Any]:
    """SIGKILL one worker of a training job, through Ray on the worker's node: only a
    process of the newest attempt, and only while it trains (never one that ended)."""
    state = JobState(job.state)
    if state in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
        raise NotRunning(f"job {job.id} has ended ({job.state}); it has no workers to kill")
    workers = job.spec_dict["workers"]
    if isinstance(workers, dict):  # elastic: the ranks that may exist; the lookup below finds the live ones
        workers = workers["max"]
    if rank is not None and not 0 <= rank < workers:
        raise ValueError(f"rank {rank} does not exist: job {job.id} has ranks 0..{workers - 1}")
    rd = rundir.run_dir(settings.runs_dir, job.id)
    history = events.events(rd)
    latest = metrics_read.latest(rd)
    now = phase(job, {"phase": rundir.phase(history, latest), "last_step_at": rundir.last_step_at(history, latest)})
    _check_training(job, now, history, latest)
    if rank is None:
        live = rundir.live_ranks(history)
        rank = random.choice(live) if live else random.randrange(workers)
    where = rundir.worker(history, rank)
    if where is None:
        raise NotRunning(f"job {job.id} has no worker of rank {rank} in its current attempt "
                         f"(ranks running: {', '.join(map(str, rundir.live_ranks(history))) or 'none'})")
    try:
        gateway.kill_process(pid=where["pid"], node_id=where.get("node_id"), submission_id=job.submission_id,
                             job_id=job.id)
    except ProcessLookupError as e:
        raise NotRunning(f"worker {rank} of job {job.id} has already exited; the job is recovering") from e
    return {"job_id": job.id, "rank": rank, "pid": where["pid"], "node_id": where.get("node_id")}


def _check_training(job: ledger.Job, now: str, history: list[dict[str, Any]], latest: dict[str, Any] | None) -> None:
    """409 with what is happening, unless the job is training."""
    if now == rundir.TRAINING:
        return
    if now == "queued":
        raise NotRunning(f"job {job.id} is queued: Ray has not taken it yet; try again once it is training")
    if now == rundir.STARTING:
        attempts = [e for e in rundir.current_run(history) if e["event"] == Kind.ATTEMPT_STARTED]
        if attempts and attempts[-1].get("attempt", 1) > 1:
            raise NotRunning(f"job {job.id} is restarting its workers (attempt {attempts[-1]['attempt']}); "
                             "try again once it is training")
        raise NotRunning(f"job {job.id} is starting: its workers are not up yet; try again once it is training")
    if now == rundir.RECOVERING:
        raise NotRunning(f"job {job.id} is recovering from {rundir.recovery_note(history, latest)}")
    raise NotRunning(f"job {job.id} is {now}: its workers have stopped training")
