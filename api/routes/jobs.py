"""/v1/jobs: submit, list, inspect, cancel, logs, metrics, events, checkpoints, faults."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Body, Header, HTTPException, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse, StreamingResponse

from api.deps import AuthDep, GatewayDep, LedgerDep, SettingsDep
from api.schemas import EventsPublic, FaultCreate, FaultPublic, JobPublic, JobsPublic, RecordsPublic
from service import admission, jobs, ledger, rundir
from service.gateway import GatewayError
from service.lifecycle import JobState
from workers import events
from workers.spec import JobSpec

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[AuthDep])


def to_public(job: ledger.Job | ledger.JobRow, settings, gateway, sessions) -> JobPublic:
    info = jobs.view(sessions, settings, job)
    return JobPublic(
        id=job.id, state=job.state, attempts=info["attempts"], restarts=info["restarts"], resubmits=job.resubmits,
        steps_recomputed=info["steps_recomputed"], recovery_s=info["recovery_s"],
        live_recoveries=info.get("live_recoveries") or [],
        progress={**info["progress"], "phase": jobs.phase(job, info)}, latest_metrics=info["latest_metrics"],
        latest_checkpoint=info["latest_checkpoint"], result=info["result"], submission_id=job.submission_id,
        dashboard_url=f"{gateway.dashboard_url}/#/jobs/{job.submission_id}" if job.submission_id else None,
        error=info.get("error") or ({"message": job.error} if job.error else None),
        created_at=job.created_at, updated_at=job.updated_at, spec=job.spec_dict,
    )


def _answer(body: bytes, status_code: int = status.HTTP_200_OK) -> Response:
    """A response body serialised from a model built (and so validated) once. Returning the
    model instead would have FastAPI validate it all again before serialising it, and for a
    plain `def` route do that in a second trip to the thread pool: on a job view, more than
    the view itself costs. The route's response_model still documents the body."""
    return Response(body, status_code=status_code, media_type="application/json")


def _get(sessions, job_id: str) -> ledger.Job:
    return _found(ledger.get_job(sessions, job_id=job_id), job_id)


def _found(job, job_id: str):
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
    return job


# The hot routes are `async def` that make one trip to the thread pool for their blocking
# part (the ledger, storage, Ray) and answer with _answer.


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobPublic)
async def create_job(
    request: Request, sessions: LedgerDep, settings: SettingsDep, gateway: GatewayDep,
    spec: Annotated[JobSpec, Body(description="The job spec; `storage` is chosen by the service.")],
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=255)] = None,
) -> Response:
    """Submit a job. The same Idempotency-Key again returns the same job (200) and never
    starts a second Ray job."""

    def create() -> tuple[bytes, int]:
        admitted = admission.admit(spec, settings, request.app.state.capacity())
        # A generated job_id differs on every retry, so it is no part of the request; one the client chose is.
        generated_id = idempotency_key and "job_id" not in admitted.model_fields_set
        body = admitted.model_dump(mode="json", exclude={"job_id"} if generated_id else set())
        job, created = jobs.create(sessions, settings, admitted, body=body, idempotency_key=idempotency_key)
        if created:
            job = jobs.try_submit(sessions, settings, gateway, job)
        return (to_public(job, settings, gateway, sessions).model_dump_json().encode(),
                status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    return _answer(*await run_in_threadpool(create))


@router.get("", response_model=JobsPublic)
async def list_jobs(
    sessions: LedgerDep, settings: SettingsDep, gateway: GatewayDep,
    state: Annotated[JobState | None, Query(description="Only jobs in this state.")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=1_000_000_000)] = 0,
) -> Response:
    """Jobs, newest first."""

    def page() -> bytes:
        rows, count = ledger.job_rows(sessions, state=state, limit=limit, offset=offset)
        return JobsPublic(data=[to_public(j, settings, gateway, sessions) for j in rows],
                          count=count).model_dump_json().encode()

    return _answer(await run_in_threadpool(page))


@router.get("/{job_id}", response_model=JobPublic)
async def get_job(job_id: str, sessions: LedgerDep, settings: SettingsDep, gateway: GatewayDep) -> Response:
    def view() -> bytes:
        job = _found(ledger.job_row(sessions, job_id=job_id), job_id)
        return to_public(job, settings, gateway, sessions).model_dump_json().encode()

    return _answer(await run_in_threadpool(view))


@router.post("/{job_id}/cancel", response_model=JobPublic)
def cancel_job(job_id: str, sessions: LedgerDep, settings: SettingsDep, gateway: GatewayDep) -> JobPublic:
    """Stop a job. 409 when it has already ended."""
    job = jobs.cancel(sessions, gateway, _get(sessions, job_id))
    return to_public(job, settings, gateway, sessions)


@router.delete("/{job_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_job(job_id: str, sessions: LedgerDep, settings: SettingsDep) -> Response:
    """Remove a finished job: its ledger row and its run record. 409 while it runs."""
    jobs.delete(sessions, settings, _get(sessions, job_id))
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/{job_id}/logs", response_class=PlainTextResponse)
async def job_logs(
    job_id: str, sessions: LedgerDep, settings: SettingsDep, gateway: GatewayDep,
    follow: Annotated[bool, Query(description="Stream new output until the job ends.")] = False,
    tail: Annotated[int | None, Query(ge=1, le=1_000_000, description="Only the last N lines.")] = None,
):
    """The job's output: every driver's (workers' output included), oldest first, from the
    run record; with tail, its last lines only; with follow, the current driver's live from Ray."""
    job = await run_in_threadpool(_get, sessions, job_id)
    if not job.submission_id:
        return PlainTextResponse("")
    if not follow:
        kept = await run_in_threadpool(rundir.driver_output, rundir.run_dir(settings.runs_dir, job_id), tail)
        if kept is not None:  # every driver's output, kept in the run record
            return PlainTextResponse(kept)
        text = await run_in_threadpool(gateway.logs, job.submission_id)
        return PlainTextResponse("".join(rundir.split_lines(text)[-tail:]) if tail else text)

    async def stream():
        try:
            async for chunk in gateway.tail_logs(job.submission_id):
                yield chunk
        except (GatewayError, asyncio.CancelledError):
            return

    return StreamingResponse(stream(), media_type="text/plain")


@router.get("/{job_id}/metrics", response_model=RecordsPublic)
def job_metrics(
    job_id: str, sessions: LedgerDep, settings: SettingsDep,
    since_step: Annotated[int, Query(ge=0, description="Only steps after this one.")] = 0,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> RecordsPublic:
    _get(sessions, job_id)
    rows = rundir.metrics_since(rundir.run_dir(settings.runs_dir, job_id), since_step, limit)
    return RecordsPublic(data=rows, count=len(rows))


@router.get("/{job_id}/events", response_model=EventsPublic)
def job_events(
    job_id: str, sessions: LedgerDep, settings: SettingsDep,
    offset: Annotated[int, Query(ge=0, description="Only the events written after this byte offset: the "
                                                   "`next_offset` of the previous answer.")] = 0,
) -> EventsPublic:
    """The run record's events, oldest first; with offset, only the newer ones."""
    _get(sessions, job_id)
    rows, next_offset = events.events_from(rundir.run_dir(settings.runs_dir, job_id), offset)
    return EventsPublic(data=rows, count=len(rows), next_offset=next_offset)


@router.get("/{job_id}/checkpoints", response_model=RecordsPublic)
def job_checkpoints(job_id: str, sessions: LedgerDep, settings: SettingsDep) -> RecordsPublic:
    _get(sessions, job_id)
    rows = rundir.checkpoints(rundir.run_dir(settings.runs_dir, job_id))
    return RecordsPublic(data=rows, count=len(rows))


@router.post("/{job_id}/faults", status_code=status.HTTP_202_ACCEPTED, response_model=FaultPublic)
def inject_fault(
    job_id: str, sessions: LedgerDep, settings: SettingsDep, gateway: GatewayDep,
    fault: Annotated[FaultCreate, Body()] = FaultCreate(),
) -> FaultPublic:
    """Kill one worker of a training job now (by rank, or at random), to see recovery work.
    409 says what the job is doing instead (starting, recovering, ended)."""
    return FaultPublic(**jobs.inject_fault(settings, gateway, _get(sessions, job_id), fault.rank))
