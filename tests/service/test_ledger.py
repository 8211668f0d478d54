"""service/ledger.py on SQLite and on a real PostgreSQL (tests/helpers/postgres.py): the
repository functions, update_job as a compare-and-set under racing writers, and the
Alembic upgrade of fresh, release-0.1 and concurrently opened ledgers."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, text
from sqlalchemy.orm import sessionmaker

from service import ledger
from service.lifecycle import IllegalTransition, JobState
from tests.conftest import ROOT
from tests.helpers.postgres import postgres_session_server, postgres_url  # noqa: F401 (fixtures)

# What release 0.1's `Base.metadata.create_all` made (the same DDL on SQLite and PostgreSQL).
RELEASE_0_1_SCHEMA = [
    """CREATE TABLE jobs (
	id VARCHAR(64) NOT NULL,
	state VARCHAR(16) NOT NULL,
	spec TEXT NOT NULL,
	request_hash VARCHAR(64) NOT NULL,
	idempotency_key VARCHAR(255),
	submission_id VARCHAR(128),
	submissions INTEGER NOT NULL,
	resubmits INTEGER NOT NULL,
	restarts INTEGER NOT NULL,
	cancel_requested BOOLEAN NOT NULL,
	resubmitted_at FLOAT,
	error TEXT,
	created_at FLOAT NOT NULL,
	updated_at FLOAT NOT NULL,
	PRIMARY KEY (id),
	UNIQUE (idempotency_key)
)""",
    "CREATE INDEX ix_jobs_state ON jobs (state)",
    "CREATE INDEX ix_jobs_created_at ON jobs (created_at)",
]


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def opened():
    """open_ledger, with every engine disposed after the test (PostgreSQL counts connections)."""
    engines = []

    def open_(url: str):
        sessions = ledger.open_ledger(url)
        engines.append(ledger.engine_of(sessions))
        return sessions

    yield open_
    for engine in engines:
        engine.dispose()


@pytest.fixture
def sessions(url, opened):
    return opened(url)


def new_job(sessions, job_id: str, *, to: tuple[JobState, ...] = (), **kw) -> ledger.Job:
    job, created = ledger.create_job(sessions, job_id=job_id, spec={"job_id": job_id}, request_hash="h",
                                     idempotency_key=kw.pop("idempotency_key", None), **kw)
    assert created
    for state in to:
        job = ledger.update_job(sessions, job_id=job_id, state=state)
    return job


def version(url: str) -> str | None:
    engine = create_engine(ledger.engine_url(url))
    try:
        with engine.connect() as conn:
            return conn.scalar(text("SELECT version_num FROM alembic_version"))
    finally:
        engine.dispose()


# --- the repository functions ---------------------------------------------------------


def test_create_get_list_update_delete(sessions):
    a = new_job(sessions, "a", idempotency_key="k1")
    assert (a.state, a.submissions, a.pending_submission, a.summary, a.summary_dict) == ("QUEUED", 0, False, None,
                                                                                         None)
    again, created = ledger.create_job(sessions, job_id="other", spec={}, request_hash="h", idempotency_key="k1")
    assert not created and again.id == "a"
    with pytest.raises(ledger.DuplicateJob):
        ledger.create_job(sessions, job_id="a", spec={}, request_hash="h", idempotency_key=None)
    new_job(sessions, "b", submission_id="b-1")
    assert ledger.get_job(sessions, job_id="b").submissions == 1
    assert ledger.get_job(sessions, job_id="missing") is None

    rows, total = ledger.job_rows(sessions)
    assert total == 2 and {j.id for j in rows} == {"a", "b"}
    job = ledger.update_job(sessions, job_id="a", state=JobState.SUBMITTED, pending_submission=True,
                            waiting_since=12.5, submission_id="a-1")
    assert (job.state, job.pending_submission, job.waiting_since, job.submission_id) == ("SUBMITTED", True, 12.5,
                                                                                         "a-1")
    assert ledger.get_job(sessions, job_id="a").pending_submission is True
    assert [j.id for j in ledger.job_rows(sessions, state=JobState.SUBMITTED)[0]] == ["a"]
    assert ledger.count_by_state(sessions)["SUBMITTED"] == 1

    assert ledger.delete_job(sessions, job_id="a") is True
    assert ledger.delete_job(sessions, job_id="a") is False
    assert ledger.get_job(sessions, job_id="a") is None
    assert [j.id for j in ledger.active_jobs(sessions)] == ["b"]


def test_update_keeps_its_refusals(sessions):
    with pytest.raises(KeyError):
        ledger.update_job(sessions, job_id="missing", state=JobState.SUBMITTED)
    new_job(sessions, "j")
    with pytest.raises(IllegalTransition):
        ledger.update_job(sessions, job_id="j", state=JobState.RUNNING, error="ignored")
    job = ledger.get_job(sessions, job_id="j")
    assert (job.state, job.error) == ("QUEUED", None)
    # A field-only update applies in any state, terminal too (cancel_requested on a finished job).
    ledger.update_job(sessions, job_id="j", state=JobState.CANCELLED)
    assert ledger.update_job(sessions, job_id="j", cancel_requested=True).cancel_requested is True


def test_save_summary_leaves_the_state_alone(sessions):
    before = new_job(sessions, "j", to=(JobState.SUBMITTED, JobState.RUNNING))
    time.sleep(0.01)
    assert ledger.save_summary(sessions, job_id="j", summary={"step": 7, "loss": 0.5}, restarts=2) is True
    job = ledger.get_job(sessions, job_id="j")
    assert job.summary_dict == {"step": 7, "loss": 0.5} and job.restarts == 2
    assert job.summary_at >= before.updated_at and job.updated_at == before.updated_at and job.state == "RUNNING"
    ledger.save_summary(sessions, job_id="j", summary={"step": 8})
    assert ledger.get_job(sessions, job_id="j").restarts == 2  # restarts=None keeps it
    ledger.delete_job(sessions, job_id="j")
    assert ledger.save_summary(sessions, job_id="j", summary={"step": 9}) is False  # deleted meanwhile: no error


# --- compare-and-set ------------------------------------------------------------------


def race(*calls) -> list[BaseException | object]:
    """Run the calls at once, each on its own thread; what each returned or raised."""
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)

    def run(i, call):
        barrier.wait()
        try:
            results[i] = call()
        except BaseException as e:  # noqa: BLE001 - the test judges it
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_a_racing_update_never_moves_a_job_out_of_a_terminal_state(url, opened):
    # Two writers with their own engines (as two API processes): one finishes a RUNNING
    # job, the other starts recovering it. Either order is legal, but SUCCEEDED must win.
    first, second = opened(url), opened(url)
    refused = 0
    for i in range(60):
        job_id = f"race-{i}"
        new_job(first, job_id, to=(JobState.SUBMITTED, JobState.RUNNING))
        done, recovering = race(lambda j=job_id: ledger.update_job(first, job_id=j, state=JobState.SUCCEEDED),
                                lambda j=job_id: ledger.update_job(second, job_id=j, state=JobState.RECOVERING))
        assert isinstance(done, ledger.Job), done
        if isinstance(recovering, IllegalTransition):
            refused += 1  # SUCCEEDED came first; RECOVERING re-read it and was refused
        else:
            assert isinstance(recovering, ledger.Job), recovering
        assert ledger.get_job(first, job_id=job_id).state == "SUCCEEDED"
    print(f"{refused} of 60 RECOVERING updates lost the race")


def test_expect_conflict_names_the_job_and_fields(sessions):
    new_job(sessions, "j", submission_id="j-1")
    with pytest.raises(ledger.Conflict) as info:
        ledger.update_job(sessions, job_id="j", state=JobState.SUBMITTED, expect={"submissions": 0, "resubmits": 0})
    assert isinstance(info.value, ValueError) and info.value.job_id == "j" and info.value.fields == {"submissions": 0}
    assert "'j'" in str(info.value) and "submissions" in str(info.value)
    assert ledger.get_job(sessions, job_id="j").state == "QUEUED"  # nothing changed
    job = ledger.update_job(sessions, job_id="j", submissions=2, expect={"submissions": 1, "resubmitted_at": None})
    assert job.submissions == 2
    with pytest.raises(KeyError):
        ledger.update_job(sessions, job_id="missing", expect={"submissions": 0})


def test_only_one_of_racing_claims_wins(url, opened):
    first, second = opened(url), opened(url)
    new_job(first, "j", submission_id="j-1", to=(JobState.SUBMITTED, JobState.RECOVERING))
    for n in range(1, 21):
        def claim(sessions, n=n):
            return lambda: ledger.update_job(sessions, job_id="j", state=JobState.SUBMITTED, submissions=n + 1,
                                             submission_id=f"j-{n + 1}", expect={"submissions": n})

        results = race(claim(first), claim(second))
        assert sorted(type(r).__name__ for r in results) == ["Conflict", "Job"], results
        assert ledger.get_job(first, job_id="j").submissions == n + 1
        ledger.update_job(first, job_id="j", state=JobState.RECOVERING)


def test_cancel_wins_over_a_concurrent_reconcile(sessions):
    # The reconciler read submissions=1 before a cancel landed; its claim must not apply.
    new_job(sessions, "j", submission_id="j-1", to=(JobState.SUBMITTED, JobState.RECOVERING))
    ledger.update_job(sessions, job_id="j", state=JobState.CANCELLED, cancel_requested=True)
    with pytest.raises(IllegalTransition):
        ledger.update_job(sessions, job_id="j", state=JobState.SUBMITTED, submissions=2, expect={"submissions": 1})
    with pytest.raises(ledger.Conflict):
        ledger.update_job(sessions, job_id="j", pending_submission=True, expect={"cancel_requested": False})
    job = ledger.get_job(sessions, job_id="j")
    assert (job.state, job.submissions, job.pending_submission) == ("CANCELLED", 1, False)


def test_seen_saves_a_read_but_never_a_check(sessions):
    # `seen` is what the caller last read: when it still holds, the update skips the read;
    # when the row moved on since, the update reads it and judges as without it.
    job = new_job(sessions, "j", submission_id="j-1")
    moved = ledger.update_job(sessions, job_id="j", state=JobState.SUBMITTED, seen=job)
    assert (moved.state, moved.submission_id) == ("SUBMITTED", "j-1")
    ledger.update_job(sessions, job_id="j", state=JobState.CANCELLED)
    with pytest.raises(IllegalTransition):  # seen says SUBMITTED; the row is CANCELLED
        ledger.update_job(sessions, job_id="j", state=JobState.RUNNING, seen=moved)
    with pytest.raises(ledger.Conflict):  # a stale `seen` does not stand in for `expect`
        ledger.update_job(sessions, job_id="j", submissions=5, expect={"submissions": 0}, seen=moved)
    assert ledger.get_job(sessions, job_id="j").state == "CANCELLED"
    assert ledger.update_job(sessions, job_id="j", error="x", seen=moved).error == "x"  # field-only, any state


def test_job_rows_are_the_jobs_columns_read_only(sessions):
    new_job(sessions, "a", submission_id="a-1")
    ledger.save_summary(sessions, job_id="a", summary={"progress": {"step": 3}}, restarts=1)
    time.sleep(0.01)
    new_job(sessions, "b")
    row, job = ledger.job_row(sessions, job_id="a"), ledger.get_job(sessions, job_id="a")
    assert {c: getattr(row, c) for c in ledger.JobRow.__slots__} == {c: getattr(job, c) for c in ledger.JobRow.__slots__}
    assert row.summary_dict == {"progress": {"step": 3}} and row.spec_dict == {"job_id": "a"} and row.restarts == 1
    with pytest.raises(AttributeError):
        row.state = "RUNNING"
    assert ledger.job_row(sessions, job_id="missing") is None
    rows, count = ledger.job_rows(sessions)
    assert count == 2 and [r.id for r in rows] == ["b", "a"]  # newest first
    assert [r.id for r in ledger.job_rows(sessions, state=JobState.QUEUED, limit=1, offset=1)[0]] == ["a"]


# --- the schema ----------------------------------------------------------------------


def test_a_fresh_ledger_is_at_head_and_matches_the_model(url, opened):
    sessions = opened(url)
    assert version(url) == ledger.head_revision() == "0002"
    with ledger.engine_of(sessions).connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), ledger.Base.metadata) == []
    opened(url)  # opening again is a no-op
    assert version(url) == "0002"


def test_a_release_0_1_ledger_is_upgraded_in_place(url, opened):
    engine = create_engine(ledger.engine_url(url))
    with engine.begin() as conn:
        for ddl in RELEASE_0_1_SCHEMA:
            conn.execute(text(ddl))
        insert = text("INSERT INTO jobs (id, state, spec, request_hash, idempotency_key, submission_id, submissions,"
                      " resubmits, restarts, cancel_requested, resubmitted_at, error, created_at, updated_at) VALUES"
                      " (:id, :state, :spec, 'h', :key, :sub, 1, :resubmits, 0, :cancel, NULL, :error, :t, :t)")
        conn.execute(insert, [
            {"id": "old-running", "state": "RUNNING", "spec": '{"job_id": "old-running"}', "key": "k",
             "sub": "old-running-1", "resubmits": 0, "cancel": False, "error": None, "t": 100.0},
            {"id": "old-failed", "state": "FAILED", "spec": "{}", "key": None, "sub": "old-failed-1",
             "resubmits": 2, "cancel": True, "error": "boom", "t": 200.0},
        ])
    engine.dispose()

    sessions = opened(url)
    assert version(url) == "0002"
    running, failed = ledger.get_job(sessions, job_id="old-running"), ledger.get_job(sessions, job_id="old-failed")
    assert (running.state, running.spec_dict, running.idempotency_key, running.submission_id) == (
        "RUNNING", {"job_id": "old-running"}, "k", "old-running-1")
    assert (failed.state, failed.error, failed.resubmits, failed.cancel_requested) == ("FAILED", "boom", 2, True)
    assert (running.summary, running.summary_at, running.pending_submission, running.waiting_since) == (
        None, None, False, None)
    assert ledger.update_job(sessions, job_id="old-running", state=JobState.SUCCEEDED).state == "SUCCEEDED"
    with ledger.engine_of(sessions).connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), ledger.Base.metadata) == []


# Sleeps until a common start time once imported, so the processes open the ledger together.
OPEN_AT = ("import sys, time; from service import ledger; time.sleep(max(0, float(sys.argv[2]) - time.time()));"
           " ledger.open_ledger(sys.argv[1]); print('opened', time.time() - float(sys.argv[2]))")


def test_processes_opening_a_fresh_ledger_at_once_all_succeed(url):
    # Several API processes starting together on one fresh ledger: one migrates, the
    # others wait for it (advisory lock / SQLite write lock) and then find it at head.
    go = time.time() + 4  # importing takes ~1 s
    procs = [subprocess.Popen([sys.executable, "-c", OPEN_AT, url, str(go)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(4)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outputs
    assert all(out.startswith("opened") for out in outputs), outputs
    assert version(url) == "0002"


def test_threads_opening_a_fresh_ledger_at_once_all_succeed(url):
    # The same within one process (Alembic's context is process-global).
    results = race(*[lambda: ledger.open_ledger(url) for _ in range(4)])
    try:
        assert all(isinstance(r, sessionmaker) for r in results), results
        assert version(url) == "0002"
    finally:
        for r in results:
            if isinstance(r, sessionmaker):
                ledger.engine_of(r).dispose()


# --- PostgreSQL specifics --------------------------------------------------------------


@pytest.mark.parametrize(("given", "used"), [
    ("postgresql://u:p@h:5/db", "postgresql+psycopg://u:p@h:5/db"),
    ("postgres://u@h/db", "postgresql+psycopg://u@h/db"),
    ("postgresql+psycopg://u@h/db", "postgresql+psycopg://u@h/db"),
    ("sqlite:////tmp/x.db", "sqlite:////tmp/x.db"),
])
def test_postgresql_urls_mean_psycopg(given, used):
    assert ledger.engine_url(given).render_as_string(hide_password=False) == used


def test_postgres_plain_url_and_outage(postgres_session_server, postgres_url, opened):  # noqa: F811
    sessions = opened(postgres_url.replace("postgresql+psycopg://", "postgresql://"))
    assert ledger.engine_of(sessions).dialect.driver == "psycopg"
    new_job(sessions, "j")
    postgres_session_server.stop()
    try:
        with pytest.raises(Exception):  # noqa: B017 - whatever the driver says while it is down
            ledger.get_job(sessions, job_id="j")
    finally:
        postgres_session_server.start()
    assert ledger.get_job(sessions, job_id="j").state == "QUEUED"  # pool_pre_ping replaced the dead connections
