"""Response and request bodies (JobSpec itself is the request body of POST /v1/jobs)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from service.jobs import PHASES


class Progress(BaseModel):
    phase: str = Field("queued", description=f"What the job is doing: {', '.join(PHASES)}. `starting`: Ray has it but "
                       "no worker of the current attempt has completed a step; faults can be injected only while "
                       "`training`.")
    step: int = Field(0, description="Steps completed.")
    total_steps: int | None = Field(None, description="Steps the job will run.")
    epoch: int | None = Field(None, description="Epoch of the latest step.")


class JobError(BaseModel):
    message: str = Field(description="Why the job failed.")
    traceback: str = Field("", description="The end of the failing worker's traceback.")


class JobPublic(BaseModel):
    id: str = Field(description="Job id; names the run directory.")
    state: str = Field(description="QUEUED, SUBMITTED, RUNNING, RECOVERING, SUCCEEDED, FAILED or CANCELLED.")
    attempts: int = Field(0, description="Worker-group attempts started.")
    restarts: int = Field(0, description="Attempts after the first (recoveries).")
    resubmits: int = Field(0, description="Times the Ray driver was lost and the job resubmitted.")
    steps_recomputed: int = Field(0, description="Steps trained again after failures.")
    recovery_s: list[float | None] = Field(default_factory=list,
                                           description="Seconds from each failure to the next completed step.")
    live_recoveries: list[dict[str, Any]] = Field(
        default_factory=list,
        description="failure.mode live: each failure the others trained through (failed_ranks, stall_s, rejoin_s, "
                    "survivor_steps, samples_skipped, survivors_restarted false).")
    progress: Progress = Field(default_factory=Progress)
    latest_metrics: dict[str, Any] | None = Field(None, description="The newest metrics line.")
    latest_checkpoint: dict[str, Any] | None = Field(None, description="The newest committed checkpoint.")
    result: dict[str, Any] | None = Field(None, description="Final loss, accuracy and weights digest.")
    submission_id: str | None = Field(None, description="Ray job submission id.")
    dashboard_url: str | None = Field(None, description="The job in the Ray dashboard.")
    error: JobError | None = None
    created_at: float
    updated_at: float
    spec: dict[str, Any] = Field(description="The job spec as accepted.")


class JobsPublic(BaseModel):
    data: list[JobPublic]
    count: int = Field(description="Jobs matching the filter, all pages together.")


class RecordsPublic(BaseModel):
    data: list[dict[str, Any]]
    count: int


class EventsPublic(RecordsPublic):
    next_offset: int = Field(description="Where the next read starts: pass it as ?offset= for the newer events.")


class FaultCreate(BaseModel):
    rank: int | None = Field(None, ge=0, description="World rank to kill; a random one when omitted.")


class FaultPublic(BaseModel):
    job_id: str
    rank: int
    pid: int
    node_id: str | None = None


class ResourceCount(BaseModel):
    total: float
    free: float


class ClusterPublic(BaseModel):
    nodes: int
    cpus: ResourceCount
    gpus: ResourceCount
    ray_version: str
    dashboard_url: str


class Message(BaseModel):
    detail: str


class CodePublic(BaseModel):
    id: str = Field(description="The archive's SHA-256; name it in a job's `code`.")
    size: int = Field(description="Bytes.")
    created: float = Field(description="When it was stored (Unix time).")
