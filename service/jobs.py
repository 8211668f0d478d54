"""Job operations shared by the API and the reconciler: create, submit, cancel, fault."""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from service import ledger, rundir
from service.gateway import Gateway, GatewayError
from service.lifecycle import IllegalTransition, JobState
from service.settings import Settings
from workers.spec import JobSpec, write_spec_json


class NotRunning(ValueError):
    """The job has no live worker to act on."""


def request_hash(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def submission_name(job_id: str, n: int) -> str:
    return f"etrain-{job_id}-{n}"


def spec_path(settings: Settings, job_id: str) -> str:
    return os.path.join(rundir.run_dir(settings.runs_dir, job_id), "spec.json")


def write_spec(settings: Settings, spec: JobSpec) -> str:
    """spec.json is immutable: written once, before the first submission."""
    return write_spec_json(spec.model_copy(update={"storage": settings.runs_dir}))


def create(sessions: sessionmaker[Session], settings: Settings, spec: JobSpec, *, body: dict[str, Any],
           idempotency_key: str | None) -> tuple[ledger.Job, bool]:
    # The first submission id is fixed at insert: one commit fewer on every POST.
    return ledger.create_job(sessions, job_id=spec.job_id, spec=spec.model_dump(mode="json"),
                             request_hash=request_hash(body), idempotency_key=idempotency_key,
                             submission_id=submission_name(spec.job_id, 1))


def submit(sessions: sessionmaker[Session], settings: Settings, gateway: Gateway, job: ledger.Job,
           *, resubmit: bool = False) -> ledger.Job:
    """Hand a job to Ray. The submission id is recorded before Ray is asked, and Ray
    refuses a second job with the same id, so a crash at any point never starts two."""
    spec = JobSpec.model_validate(job.spec_dict)
    path = write_spec(settings, spec)
    if resubmit or not job.submission_id:
        n = job.submissions + 1
        extra = {"resubmits": job.resubmits + 1, "resubmitted_at": time.time()} if resubmit else {}
        job = ledger.update_job(sessions, job_id=job.id, submission_id=submission_name(job.id, n), submissions=n, **extra)
    gateway.submit(submission_id=job.submission_id, spec_path=path, job_id=job.id)
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


def inject_fault(settings: Settings, gateway: Gateway, job: ledger.Job, rank: int | None) -> dict[str, Any]:
    """SIGKILL one worker of a running job, through Ray on the worker's node."""
    if JobState(job.state) not in (JobState.RUNNING, JobState.RECOVERING):
        raise NotRunning(f"job {job.id} is {job.state}; faults need a RUNNING job")
    workers = job.spec_dict["workers"]
    if isinstance(workers, dict):  # elastic: the ranks that may exist; the lookup below finds the live ones
        workers = workers["max"]
    if rank is None:
        rank = random.randrange(workers)
    if not 0 <= rank < workers:
        raise ValueError(f"rank {rank} does not exist: job {job.id} has ranks 0..{workers - 1}")
    where = rundir.worker_pid(rundir.run_dir(settings.runs_dir, job.id), rank)
    if where is None:
        raise NotRunning(f"job {job.id} has no worker of rank {rank} running yet")
    try:
        gateway.kill_process(pid=where["pid"], node_id=where.get("node_id"))
    except ProcessLookupError as e:
        raise NotRunning(f"worker {rank} of job {job.id} is not running (restarting?)") from e
    return {"job_id": job.id, "rank": rank, "pid": where["pid"], "node_id": where.get("node_id")}
