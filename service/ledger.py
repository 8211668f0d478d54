"""The durable job ledger: SQLAlchemy 2 tables and keyword-only repository functions.

SQLite (WAL) by default, PostgreSQL (psycopg 3) through DATABASE_URL. A job row is
committed before the API answers 201, so an acknowledged job survives any crash of the
service. The schema is owned by the Alembic revisions in service/migrations, applied by
`open_ledger`; the model below must match their head.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import (
    Boolean,
    Float,
    Integer,
    String,
    Text,
    create_engine,
    delete,
    event,
    false,
    func,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from service import lifecycle
from service.lifecycle import JobState

MIGRATIONS = Path(__file__).with_name("migrations")
BASELINE = "0001"  # the schema release 0.1 made with create_all, before Alembic
# Any fixed 64-bit key: every process opening one PostgreSQL ledger takes the same lock.
_MIGRATION_LOCK = 0x65747261696E  # "etrain"
_CAS_TRIES = 5
# Alembic's command API keeps its context in module globals: one migration at a time per
# process, whichever ledgers they are for.
_alembic_lock = threading.Lock()


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
    # Revision 0002.
    summary: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON, kept by the reconciler
    summary_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    pending_submission: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    waiting_since: Mapped[float | None] = mapped_column(Float, nullable=True)

    @property
    def spec_dict(self) -> dict[str, Any]:
        return json.loads(self.spec)

    @property
    def summary_dict(self) -> dict[str, Any] | None:
        return json.loads(self.summary) if self.summary else None


class DuplicateJob(ValueError):
    """A job with this id exists already (and was not created with the same Idempotency-Key)."""


class KeyReused(ValueError):
    """The Idempotency-Key was used before for a different request body."""


class Conflict(ValueError):
    """An update's `expect` did not hold: another writer changed the job first."""

    def __init__(self, job_id: str, fields: dict[str, Any]):
        super().__init__(f"job {job_id!r} changed concurrently: expected "
                         + ", ".join(f"{k}={v!r}" for k, v in fields.items()))
        self.job_id, self.fields = job_id, fields


def engine_url(url: str | URL) -> URL:
    """`postgresql://` (and `postgres://`) mean psycopg 3, the driver we ship."""
    u = make_url(url)
    return u.set(drivername="postgresql+psycopg") if u.drivername in ("postgresql", "postgres") else u


def open_ledger(url: str) -> sessionmaker[Session]:
    u = engine_url(url)
    sqlite = u.get_backend_name() == "sqlite"
    engine = create_engine(u, **({"connect_args": {"timeout": 30, "check_same_thread": False}}
                                 if sqlite else {"pool_pre_ping": True}))
    if sqlite:
        event.listen(engine, "connect", _sqlite_pragmas)
    upgrade(engine)
    return sessionmaker(engine, expire_on_commit=False)


def upgrade(engine: Engine) -> None:
    """Bring the schema to head in one transaction, serialised against other processes
    opening the same ledger: a PostgreSQL advisory lock, released when the transaction
    ends, or SQLite's write lock taken up front (BEGIN IMMEDIATE; pysqlite would otherwise
    run the DDL outside any transaction)."""
    with _alembic_lock, engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})
        elif conn.dialect.name == "sqlite":
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        config = _alembic_config(conn)
        tables = inspect(conn).get_table_names()  # after the lock: what the previous holder left
        if "jobs" in tables and "alembic_version" not in tables:
            command.stamp(config, BASELINE)  # a ledger made by create_all, before Alembic
        command.upgrade(config, "head")


def _alembic_config(conn: Connection | None) -> Config:
    # No alembic.ini: an installed service finds its revisions next to this module.
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("path_separator", "os")
    config.attributes["connection"] = conn
    return config


def head_revision() -> str:
    return ScriptDirectory.from_config(_alembic_config(None)).get_current_head()


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
               expect: dict[str, Any] | None = None, **fields: Any) -> Job:
    """Change a job's fields, and its state only along a legal transition (IllegalTransition
    otherwise). With `expect`, only if those columns hold those values now (Conflict
    otherwise): how a caller claims a change another process may be making too.

    A compare-and-set, not a row lock: SQLite ignores FOR UPDATE, so two updaters could
    both pass the transition check on the same read. The UPDATE applies only if the state
    is still the one checked; if another writer got there first, read and check again."""
    expect = expect or {}
    for _ in range(_CAS_TRIES):
        with sessions() as s, s.begin():
            job = s.get(Job, job_id)
            if job is None:
                raise KeyError(job_id)
            differing = {k: v for k, v in expect.items() if getattr(job, k) != v}
            if differing:
                raise Conflict(job_id, differing)
            values = {**fields, "updated_at": time.time()}
            if state is not None:
                lifecycle.check(JobState(job.state), state)
                values["state"] = state.value
            guard = [Job.id == job_id, Job.state == job.state, *(getattr(Job, k) == v for k, v in expect.items())]
            changed = s.execute(update(Job).where(*guard).values(values)
                                .execution_options(synchronize_session=False)).rowcount
            if changed:
                s.refresh(job)
                return job
    raise Conflict(job_id, {"state": job.state, **expect})  # kept losing to other writers


def delete_job(sessions: sessionmaker[Session], *, job_id: str) -> bool:
    """Remove a job's row; False if there was none."""
    with sessions() as s, s.begin():
        return s.execute(delete(Job).where(Job.id == job_id)).rowcount > 0


def save_summary(sessions: sessionmaker[Session], *, job_id: str, summary: dict[str, Any],
                 restarts: int | None = None) -> bool:
    """Keep the reconciler's latest summary of a job. Not a state change, so updated_at
    (which times how long a job sits in its state) stays; a job deleted meanwhile is no
    error (False)."""
    values: dict[str, Any] = {"summary": json.dumps(summary), "summary_at": time.time()}
    if restarts is not None:
        values["restarts"] = restarts
    with sessions() as s, s.begin():
        return s.execute(update(Job).where(Job.id == job_id).values(values)
                         .execution_options(synchronize_session=False)).rowcount > 0


def ping(sessions: sessionmaker[Session]) -> None:
    with sessions() as s:
        s.execute(select(1))
