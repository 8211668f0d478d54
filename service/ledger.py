"""The durable job ledger: SQLAlchemy 2 tables and keyword-only repository functions.

SQLite (WAL) by default, PostgreSQL (psycopg 3) through DATABASE_URL. A job row is
committed before the API answers 201, so an acknowledged job survives any crash of the
service. The schema is owned by the Alembic revisions in service/migrations, applied by
`open_ledger`; the model below must match their head.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
import weakref
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
    bindparam,
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
    # When a send of submission_id to Ray began, while unanswered: a cancel must not end
    # the job while Ray may still take it (decide.SEND_WINDOW_S).
    sending_since: Mapped[float | None] = mapped_column(Float, nullable=True)

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


# Connections kept open per process: as many as its requests use at once, so that none is
# closed on return and opened again on the next request (SQLAlchemy's default, 5 kept and 10
# more opened and closed as needed, churned connections under 50 clients: a new PostgreSQL
# backend, or SQLite's pragmas, each time). Never more than the default's 15 at once.
POOL = {"pool_size": 15, "max_overflow": 0}


def open_ledger(url: str) -> sessionmaker[Session]:
    u = engine_url(url)
    sqlite = u.get_backend_name() == "sqlite"
    pool = POOL if u.database and u.database != ":memory:" else {}  # an in-memory SQLite has one connection
    engine = create_engine(u, **pool, **({"connect_args": {"timeout": 30, "check_same_thread": False}}
                                         if sqlite else {"pool_pre_ping": True}))
    if sqlite:
        event.listen(engine, "connect", _sqlite_pragmas)
    upgrade(engine)
    sessions = sessionmaker(engine, expire_on_commit=False)
    if sqlite:
        _WRITE_LOCKS[sessions] = threading.Lock()
    else:
        # Reads outside a transaction: a SELECT alone, not BEGIN, SELECT, ROLLBACK (two round
        # trips fewer). The same rows: under READ COMMITTED each statement reads its own
        # snapshot either way. (pysqlite begins no transaction for a SELECT anyway.)
        _READERS[sessions] = sessionmaker(engine.execution_options(isolation_level="AUTOCOMMIT"),
                                          expire_on_commit=False)
    return sessions


_READERS: weakref.WeakKeyDictionary[sessionmaker, sessionmaker] = weakref.WeakKeyDictionary()
_WRITE_LOCKS: weakref.WeakKeyDictionary[sessionmaker, threading.Lock] = weakref.WeakKeyDictionary()


def _writing(sessions: sessionmaker[Session]) -> contextlib.AbstractContextManager:
    """Held around each write to a SQLite ledger: its writers take turns in this process
    rather than in SQLite's busy handler, which sleeps and polls (up to 100 ms a time) for
    the database lock; under 50 clients that sleeping made POST's p99 seconds. Writers in
    other processes still meet in the busy handler. PostgreSQL locks rows, not the database."""
    return _WRITE_LOCKS.get(sessions) or contextlib.nullcontext()


def _reading(sessions: sessionmaker[Session]) -> Session:
    """A session for reads only (see open_ledger)."""
    return _READERS.get(sessions, sessions)()


def _read_engine(sessions: sessionmaker[Session]) -> Engine:
    return engine_of(_READERS.get(sessions, sessions))


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
    cur.execute("PRAGMA busy_timeout=30000")
    _wal(cur)
    cur.execute("PRAGMA synchronous=FULL")  # an answered 201 must survive power loss too
    cur.close()


def _wal(cur, patience_s: float = 30.0) -> None:
    """Switch to WAL. SQLite answers the switch with "database is locked" at once, not
    through the busy handler, while another connection holds the file: several processes
    opening one fresh ledger together (once in CI; here, 1 of 15 rounds of 10 processes)."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def engine_of(sessions: sessionmaker[Session]) -> Engine:
    return sessions.kw["bind"]


def create_job(sessions: sessionmaker[Session], *, job_id: str, spec: dict[str, Any], request_hash: str,
               idempotency_key: str | None, submission_id: str | None = None,
               sending: bool = False) -> tuple[Job, bool]:
    """Insert a QUEUED job. With an Idempotency-Key already used, return that job and
    False; the unique constraint settles races between concurrent requests. `sending`:
    the caller sends `submission_id` to Ray next, so the row claims that send already."""
    now = time.time()
    with _writing(sessions), sessions() as s:
        if idempotency_key is not None:
            existing = s.scalar(select(Job).where(Job.idempotency_key == idempotency_key))
            if existing is not None:
                return _same_request(existing, request_hash), False
        # Every column given: nothing for the database to fill in, so nothing to read back.
        job = Job(id=job_id, state=JobState.QUEUED.value, spec=json.dumps(spec), request_hash=request_hash,
                  idempotency_key=idempotency_key, created_at=now, updated_at=now, resubmits=0,
                  submission_id=submission_id, submissions=1 if submission_id else 0,
                  restarts=0, cancel_requested=False, resubmitted_at=None, error=None, summary=None,
                  summary_at=None, pending_submission=False, waiting_since=None,
                  sending_since=now if sending else None)
        s.add(job)
        try:
            s.commit()
        except IntegrityError:
            s.rollback()
            if idempotency_key is not None:
                existing = s.scalar(select(Job).where(Job.idempotency_key == idempotency_key))
                if existing is not None:
                    return _same_request(existing, request_hash), False
            raise DuplicateJob(f"job {job_id!r} exists already") from None
        return job, True


def _same_request(job: Job, request_hash: str) -> Job:
    if job.request_hash != request_hash:
        raise KeyReused(f"Idempotency-Key was used for job {job.id} with a different request body")
    return job


def get_job(sessions: sessionmaker[Session], *, job_id: str) -> Job | None:
    with _reading(sessions) as s:
        return s.get(Job, job_id)


def _page(query, state: JobState | None, limit: int, offset: int):
    """A page of jobs, newest first, and the count of all that match."""
    count = select(func.count()).select_from(Job)
    if state is not None:
        query = query.where(Job.state == state.value)
        count = count.where(Job.state == state.value)
    return query.order_by(Job.created_at.desc(), Job.id).limit(limit).offset(offset), count


class JobRow:
    """A job's row as read for a view (GET /v1/jobs and /v1/jobs/{id}): Job's columns, its
    spec_dict and summary_dict, read-only. Building an ORM object costs more than reading
    its row, and a view needs neither a session nor change tracking."""

    __slots__ = tuple(c.key for c in Job.__table__.c)
    spec_dict = Job.spec_dict
    summary_dict = Job.summary_dict

    def __init__(self, row) -> None:
        for name, value in zip(self.__slots__, row, strict=True):
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"a JobRow is read-only ({name})")


_JOBS = Job.__table__
_ROW_BY_ID = select(*(_JOBS.c[name] for name in JobRow.__slots__)).where(_JOBS.c.id == bindparam("job_id"))


def job_row(sessions: sessionmaker[Session], *, job_id: str) -> JobRow | None:
    """get_job for a view."""
    with _read_engine(sessions).connect() as conn:
        row = conn.execute(_ROW_BY_ID, {"job_id": job_id}).first()
    return JobRow(row) if row is not None else None


def job_rows(sessions: sessionmaker[Session], *, state: JobState | None = None, limit: int = 50,
             offset: int = 0) -> tuple[list[JobRow], int]:
    """A page of jobs, newest first, for a view (GET /v1/jobs), and the count of all that match."""
    query, count = _page(select(*(_JOBS.c[name] for name in JobRow.__slots__)), state, limit, offset)
    with _read_engine(sessions).connect() as conn:
        rows = conn.execute(query).all()
        return [JobRow(row) for row in rows], conn.scalar(count)


def active_jobs(sessions: sessionmaker[Session]) -> list[Job]:
    with _reading(sessions) as s:
        states = [st.value for st in JobState if lifecycle.is_active(st)]
        return list(s.scalars(select(Job).where(Job.state.in_(states)).order_by(Job.created_at)).all())


def count_by_state(sessions: sessionmaker[Session]) -> dict[str, int]:
    with _reading(sessions) as s:
        rows = s.execute(select(Job.state, func.count()).group_by(Job.state)).all()
    return {state.value: 0 for state in JobState} | {state: n for state, n in rows}


def update_job(sessions: sessionmaker[Session], *, job_id: str, state: JobState | None = None,
               expect: dict[str, Any] | None = None, seen: Job | None = None, **fields: Any) -> Job:
    """Change a job's fields, and its state only along a legal transition (IllegalTransition
    otherwise). With `expect`, only if those columns hold those values now (Conflict
    otherwise): how a caller claims a change another process may be making too.

    A compare-and-set, not a row lock: SQLite ignores FOR UPDATE, so two updaters could
    both pass the transition check on the same read. The UPDATE applies only if the state
    is still the one checked; if another writer got there first, read and check again.

    `seen`: the row as the caller has just read or written it. The first compare-and-set is
    tried on its state without reading the row again (a statement fewer); if it no longer
    holds, the row is read and checked as above."""
    expect = expect or {}
    hint = seen if seen is not None and seen.id == job_id else None
    job = hint
    for _ in range(_CAS_TRIES + (hint is not None)):
        with _writing(sessions), sessions() as s, s.begin():
            if hint is not None and (state is None or _legal(hint.state, state)):
                current = hint.state
            else:
                job = s.get(Job, job_id)
                if job is None:
                    raise KeyError(job_id)
                differing = {k: v for k, v in expect.items() if getattr(job, k) != v}
                if differing:
                    raise Conflict(job_id, differing)
                if state is not None:
                    lifecycle.check(JobState(job.state), state)
                current = job.state
            hint = None
            values = {**fields, "updated_at": time.time()}
            if state is not None:
                values["state"] = state.value
            guard = [Job.id == job_id, Job.state == current, *(getattr(Job, k) == v for k, v in expect.items())]
            changed = _update(s, job_id, guard, values)
            if changed is not None:
                return changed
    raise Conflict(job_id, {"state": job.state, **expect})  # kept losing to other writers


def _legal(current: str, target: JobState) -> bool:
    try:
        lifecycle.check(JobState(current), target)
    except lifecycle.IllegalTransition:
        return False
    return True


def _update(s: Session, job_id: str, guard: list, values: dict[str, Any]) -> Job | None:
    """UPDATE the job where `guard` holds; the row as it left it, or None if no row matched."""
    change = update(Job).where(*guard).values(values).execution_options(synchronize_session=False)
    if s.get_bind().dialect.name == "postgresql":
        # The row in the same statement: a round trip fewer than reading it again. (Not on
        # SQLite: its RETURNING gives 1 for a REAL 1.0, where a SELECT gives 1.0.)
        return s.scalars(change.returning(Job), execution_options={"populate_existing": True}).first()
    if s.execute(change).rowcount:
        return s.get(Job, job_id, populate_existing=True)
    return None


def delete_job(sessions: sessionmaker[Session], *, job_id: str) -> bool:
    """Remove a job's row; False if there was none."""
    with _writing(sessions), sessions() as s, s.begin():
        return s.execute(delete(Job).where(Job.id == job_id)).rowcount > 0


def save_summary(sessions: sessionmaker[Session], *, job_id: str, summary: dict[str, Any],
                 restarts: int | None = None) -> bool:
    """Keep the reconciler's latest summary of a job. Not a state change, so updated_at
    (which times how long a job sits in its state) stays; a job deleted meanwhile is no
    error (False)."""
    values: dict[str, Any] = {"summary": json.dumps(summary), "summary_at": time.time()}
    if restarts is not None:
        values["restarts"] = restarts
    with _writing(sessions), sessions() as s, s.begin():
        return s.execute(update(Job).where(Job.id == job_id).values(values)
                         .execution_options(synchronize_session=False)).rowcount > 0


def ping(sessions: sessionmaker[Session]) -> None:
    with _reading(sessions) as s:
        s.execute(select(1))
