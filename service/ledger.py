"""The durable job ledger: SQLAlchemy 2 tables and keyword-only repository functions.

SQLite (WAL) by default, PostgreSQL through DATABASE_URL. A job row is committed before
the API answers 201, so an acknowledged job survives any crash of the service.
"""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy import Boolean, Float, Integer, String, Text, create_engine, event, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from service import lifecycle
from service.lifecycle import JobState


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    spec: Mapped[str] = mapped_column(Text)
    request_hash: Mapped[str] = mapped_column(String(64))
    idempotency_key: Mapped[str | None] = mapped_column(String(255), unique=True, nullable=True)
    submission_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    submissions: Mapped[int] = mapped_column(Integer, default=0)
    resubmits: Mapped[int] = mapped_column(Integer, default=0)
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    resubmitted_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float, index=True)
    updated_at: Mapped[float] = mapped_column(Float)

    @property
    def spec_dict(self) -> dict[str, Any]:
        return json.loads(self.spec)


class DuplicateJob(ValueError):
    """A job with this id exists already (and was not created with the same Idempotency-Key)."""


class KeyReused(ValueError):
    """The Idempotency-Key was used before for a different request body."""


def open_ledger(url: str) -> sessionmaker[Session]:
    engine = create_engine(url, **({"connect_args": {"timeout": 30, "check_same_thread": False}}
                                   if url.startswith("sqlite") else {"pool_pre_ping": True}))
    if url.startswith("sqlite"):
        event.listen(engine, "connect", _sqlite_pragmas)
    Base.metadata.create_all(engine)
    return sessionmaker(engine, expire_on_commit=False)


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")  # an answered 201 must survive power loss too
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


def engine_of(sessions: sessionmaker[Session]) -> Engine:
    return sessions.kw["bind"]


def create_job(sessions: sessionmaker[Session], *, job_id: str, spec: dict[str, Any], request_hash: str,
               idempotency_key: str | None, submission_id: str | None = None) -> tuple[Job, bool]:
    """Insert a QUEUED job. With an Idempotency-Key already used, return that job and
    False; the unique constraint settles races between concurrent requests."""
    now = time.time()
    with sessions() as s:
        if idempotency_key is not None:
            existing = s.scalar(select(Job).where(Job.idempotency_key == idempotency_key))
            if existing is not None:
                return _same_request(existing, request_hash), False
        s.add(Job(id=job_id, state=JobState.QUEUED.value, spec=json.dumps(spec), request_hash=request_hash,
                  idempotency_key=idempotency_key, created_at=now, updated_at=now, resubmits=0,
                  submission_id=submission_id, submissions=1 if submission_id else 0,
                  restarts=0, cancel_requested=False))
        try:
            s.commit()
        except IntegrityError:
            s.rollback()
            if idempotency_key is not None:
                existing = s.scalar(select(Job).where(Job.idempotency_key == idempotency_key))
                if existing is not None:
                    return _same_request(existing, request_hash), False
            raise DuplicateJob(f"job {job_id!r} exists already") from None
        return s.get(Job, job_id), True


def _same_request(job: Job, request_hash: str) -> Job:
    if job.request_hash != request_hash:
        raise KeyReused(f"Idempotency-Key was used for job {job.id} with a different request body")
    return job


def get_job(sessions: sessionmaker[Session], *, job_id: str) -> Job | None:
    with sessions() as s:
        return s.get(Job, job_id)


def list_jobs(sessions: sessionmaker[Session], *, state: JobState | None = None, limit: int = 50,
              offset: int = 0) -> tuple[list[Job], int]:
    with sessions() as s:
        query = select(Job)
        count = select(func.count()).select_from(Job)
        if state is not None:
            query = query.where(Job.state == state.value)
            count = count.where(Job.state == state.value)
        rows = s.scalars(query.order_by(Job.created_at.desc(), Job.id).limit(limit).offset(offset)).all()
        return list(rows), s.scalar(count)


def active_jobs(sessions: sessionmaker[Session]) -> list[Job]:
    with sessions() as s:
        states = [st.value for st in JobState if lifecycle.is_active(st)]
        return list(s.scalars(select(Job).where(Job.state.in_(states)).order_by(Job.created_at)).all())


def count_by_state(sessions: sessionmaker[Session]) -> dict[str, int]:
    with sessions() as s:
        rows = s.execute(select(Job.state, func.count()).group_by(Job.state)).all()
    return {state.value: 0 for state in JobState} | {state: n for state, n in rows}


def update_job(sessions: sessionmaker[Session], *, job_id: str, state: JobState | None = None,
               **fields: Any) -> Job:
    """Change a job's fields, and its state only along a legal transition (IllegalTransition
    otherwise). The row is locked for the change so concurrent updaters serialise."""
    with sessions() as s, s.begin():
        job = s.scalar(select(Job).where(Job.id == job_id).with_for_update())
        if job is None:
            raise KeyError(job_id)
        if state is not None:
            lifecycle.check(JobState(job.state), state)
            job.state = state.value
        for name, value in fields.items():
            setattr(job, name, value)
        job.updated_at = time.time()
    return job


def ping(sessions: sessionmaker[Session]) -> None:
    with sessions() as s:
        s.execute(select(1))
