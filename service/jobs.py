"""Job operations shared by the API and the reconciler: create, submit, cancel, fault."""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from service import code, ledger, rundir
from service.gateway import Gateway, GatewayError
from service.lifecycle import IllegalTransition, JobState
from service.settings import Settings
from workers import events
from workers.spec import JobSpec, write_spec_json


class NotRunning(ValueError):
    """The job has no live worker to act on."""


class RunDirTaken(ValueError):
    """The job_id names a run directory that holds another job's spec."""


def request_hash(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def submission_name(job_id: str, n: int) -> str:
    return f"etrain-{job_id}-{n}"


def spec_path(settings: Settings, job_id: str) -> str:
    return os.path.join(rundir.run_dir(settings.runs_dir, job_id), "spec.json")


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
        with open(path) as f:
            return JobSpec.model_validate_json(f.read()).model_dump(mode="json")
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
    return ledger.create_job(sessions, job_id=spec.job_id, spec=spec.model_dump(mode="json"),
                             request_hash=request_hash(body), idempotency_key=idempotency_key,
                             submission_id=submission_name(spec.job_id, 1))


def submit(sessions: sessionmaker[Session], settings: Settings, gateway: Gateway, job: ledger.Job,
           *, resubmit: bool = False) -> ledger.Job:
    """Hand a job to Ray. The submission id is recorded before Ray is asked, and Ray
    refuses a second job with the same id, so a crash at any point never starts two.
    A job whose run directory holds another spec fails here and never reaches Ray."""
    spec = JobSpec.model_validate(job.spec_dict)
    try:
        path = write_spec(settings, spec)
    except RunDirTaken as e:
        return ledger.update_job(sessions, job_id=job.id, state=JobState.FAILED, error=str(e))
    # A resubmitted job runs the very code it was accepted with: the spec keeps the
    # archive's id, and archives are never replaced (their name is their digest).
    archive = code.stored(settings, spec.code) if spec.code else None
    if spec.code and archive is None:
        return ledger.update_job(sessions, job_id=job.id, state=JobState.FAILED,
                                 error=f"code archive {spec.code} is no longer stored under {code.code_dir(settings)}")
    if resubmit or not job.submission_id:
        n = job.submissions + 1
        extra = {"resubmits": job.resubmits + 1, "resubmitted_at": time.time()} if resubmit else {}
        job = ledger.update_job(sessions, job_id=job.id, submission_id=submission_name(job.id, n), submissions=n, **extra)
    gateway.submit(submission_id=job.submission_id, spec_path=path, job_id=job.id,
                   code_path=str(archive) if archive else None, requirements=spec.requirements)
    target = JobState.RECOVERING if resubmit else JobState.SUBMITTED
    try:
        return ledger.update_job(sessions, job_id=job.id, state=target)
    except IllegalTransition:
        # Cancelled while Ray was taking it: Ray must not run it.
        gateway.stop(job.submission_id)
        raise


def try_submit(sessions, settings, gateway, job: ledger.Job) -> ledger.Job:
    """Submit now if Ray takes it; otherwise the job stays QUEUED for the reconciler."""
    try:
        return submit(sessions, settings, gateway, job)
    except (GatewayError, IllegalTransition):
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


FINISHING = "finishing"  # the workers are done; Ray has not ended the job yet
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
    latest = rundir.latest_metrics(rd)
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
        gateway.kill_process(pid=where["pid"], node_id=where.get("node_id"))
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
        attempts = [e for e in rundir.current_run(history) if e["event"] == "attempt_started"]
        if attempts and attempts[-1].get("attempt", 1) > 1:
            raise NotRunning(f"job {job.id} is restarting its workers (attempt {attempts[-1]['attempt']}); "
                             "try again once it is training")
        raise NotRunning(f"job {job.id} is starting: its workers are not up yet; try again once it is training")
    if now == rundir.RECOVERING:
        raise NotRunning(f"job {job.id} is recovering from {rundir.recovery_note(history, latest)}")
    raise NotRunning(f"job {job.id} is {now}: its workers have stopped training")
