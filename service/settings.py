"""Service settings from ETRAIN_* environment variables (and CLI flags, which set them)."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from workers.spec import cache_dir, check_storage

# What must never reach a job: Ray jobs inherit the head's environment, and the head
# `etrain serve` starts inherits serve's.
SECRET_ENV = ("ETRAIN_TOKEN", "DATABASE_URL", "ETRAIN_DATABASE_URL")


def without_secrets(env: dict[str, str]) -> dict[str, str]:
    """`env` less what user code must not see (the service's token and database URL)."""
    return {k: v for k, v in env.items() if k not in SECRET_ENV}


def _default_data_dir() -> Path:
    return Path(cache_dir())


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ETRAIN_", extra="ignore")

    data_dir: Path = Field(default_factory=_default_data_dir, description="Ledger, token and run directories.")
    host: str = Field("127.0.0.1", description="Address the API binds to.")
    port: int = Field(8000, ge=0, le=65535)
    token: str | None = Field(None, description="Bearer token for /v1; generated into <data_dir>/token if unset.")
    database_url: str | None = Field(
        None, validation_alias=AliasChoices("ETRAIN_DATABASE_URL", "DATABASE_URL"),
        description="SQLAlchemy URL; SQLite in the data directory when unset.",
    )
    ray_address: str | None = Field(
        None, validation_alias=AliasChoices("ETRAIN_RAY_ADDRESS", "RAY_ADDRESS"),
        description="An existing Ray cluster (host:port of its GCS); else `serve` starts one.",
    )
    dashboard_url: str = Field("http://127.0.0.1:8265", description="Ray dashboard / Jobs API.")
    storage: str | None = Field(None, description="Root of run directories; <data_dir>/runs when unset.")
    ray_num_cpus: int | None = Field(None, ge=1, description="Logical CPUs of the embedded Ray head.")
    reconcile_interval_s: float = Field(1.0, gt=0, le=3600)
    max_resubmits: int = Field(3, ge=0, le=100, description="Resubmissions of a job whose Ray driver died.")
    ray_timeout_s: float = Field(5.0, gt=0, le=600, description="Limit of one call to Ray's HTTP APIs.")
    ray_long_timeout_s: float = Field(30.0, gt=0, le=3600,
                                      description="Limit of reading a job's whole log or uploading a code archive.")
    ray_kill_timeout_s: float = Field(60.0, gt=0, le=3600,
                                      description="Limit of a fault's kill job: placed on the worker's node, run, ended.")
    max_active_jobs: int | None = Field(
        None, ge=1, le=100_000, description="Jobs handed to Ray at once (submitted, running or recovering); more "
        "wait QUEUED, oldest first. Unset: no limit. Every Ray Train job costs several processes beyond its "
        "workers, so a small cluster runs many jobs better a few at a time.",
    )
    autoscaling: bool = Field(
        False, description="The Ray cluster adds nodes on demand (KubeRay's autoscaler): admission does not refuse "
        "a job for want of nodes that are not up yet.",
    )
    max_body_bytes: int = Field(1_000_000, ge=1024, description="Larger request bodies get 413.")
    python: str | None = Field(None, description="Interpreter for job entrypoints; this one when unset.")
    dataset_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="Directories jobs may read dataset files from, besides <data_dir>/datasets: a JSON list or "
        "paths joined by ':' (`etrain serve --dataset-root DIR` adds one).",
    )
    allow_code: bool = Field(
        True, description="Run users' own code: code archives (POST /v1/code), a job's `task`, `code` and model "
        "'custom'. Off (ETRAIN_ALLOW_CODE=false): only the built-in models and tasks run.",
    )
    max_code_bytes: int = Field(50 * 2**20, ge=1, description="Largest code archive POST /v1/code takes (413 above).")
    task_check_timeout_s: float = Field(
        60.0, gt=0, le=3600,
        description="Seconds a job's task may take to import when its hooks are checked at submission.",
    )

    @field_validator("storage")
    @classmethod
    def _storage_every_node_reaches(cls, value: str | None) -> str | None:
        return None if value is None else check_storage(value)

    @field_validator("dataset_roots", mode="before")
    @classmethod
    def _split_roots(cls, value):
        if isinstance(value, str):
            value = value.strip()
            if value.startswith("["):
                return json.loads(value)
            return [p for p in value.split(os.pathsep) if p]
        return value

    @property
    def runs_dir(self) -> str:
        return self.storage or str(self.data_dir / "runs")

    @property
    def allowed_data_roots(self) -> list[str]:
        return [os.path.realpath(p) for p in [self.data_dir / "datasets", *self.dataset_roots]]

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'ledger.db'}"


@lru_cache
def get_settings() -> Settings:
    return Settings()


def ensure_token(settings: Settings) -> tuple[str, bool]:
    """The API token: from settings, else read or generated once into <data_dir>/token (0600).
    Returns (token, created)."""
    if settings.token:
        return settings.token, False
    path = settings.data_dir / "token"
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if path.exists():
        return path.read_text().strip(), False
    import secrets

    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, True
