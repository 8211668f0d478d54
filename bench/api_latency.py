"""Latency and throughput of the control plane's hottest calls, under concurrent clients,
side by side with a bare FastAPI route, on the SQLite and the PostgreSQL ledger.

    python bench/api_latency.py [--ledger sqlite|postgresql|both] [--requests 2000] [--concurrency 50] ...

Per ledger, one uvicorn worker serves create_app(Settings(data_dir=<temp dir>, token=...),
FakeGateway(), reconcile=False) on 127.0.0.1 and a free port, in its own process (this
script, re-run with --serve), so the load generator does not share its GIL. Ray is not
involved: FakeGateway answers submit() at once, so what is measured is the service itself
(FastAPI, the ledger, spec.json). The PostgreSQL ledger is a real server started for the run
(tests/helpers/postgres.py: initdb into a temp dir, as the postgres user under root), with
fsync on unless --pg-fsync off, named to the service by DATABASE_URL.

That server process also answers two baselines, in --serve mode only (the product app has
neither): GET /bench/bare, a bare FastAPI route returning a constant (its own FastAPI app in
front of the service's, so none of the service's middleware), and GET /bench/bare-mw, the
same route inside the service's app, behind its middleware (auth, body limit, timing).

Then --concurrency asyncio tasks, each with its own httpx.AsyncClient holding one keep-alive
connection, send --warmup untimed requests, then --requests timed ones, of each of:

  POST /v1/jobs              {"model": "simple_cnn", "dataset": "synthetic"}: a new job each time
                             (ledger INSERT, spec.json written with fsync, the submission recorded)
  GET  /bench/bare           the baseline: a bare FastAPI route returning a constant
  GET  /bench/bare-mw        the same, behind the service's middleware
  GET  /v1/jobs/{id}         a fresh job: its summary (a run directory with spec.json only)
  GET  /v1/jobs/{id} busy    a job whose run directory holds --events events.jsonl records and
                             --metrics metrics.jsonl lines, as a long job leaves it
  GET  /v1/jobs              the newest page of 50 jobs (the default limit)

After the POSTs, each job's summary is kept in the ledger as one reconciler tick keeps it
(ledger.save_summary of rundir.summary; the reconciler itself is off), so the job views are
ledger reads, as on a running service. The GETs run in --rounds interleaved rounds (each
call's share in turn, the order rotating), so a change in the machine's load over the run
touches the bare route and the job views alike.

Reported per call: requests/s, latency p50/p90/p99/max in ms, errors (any non-2xx or failed
request), and the CPU time the server and this client used over the phase; then, per
ledger, POST/s and each GET's p50/p99 against the bare route's (the goal: GET /v1/jobs/{id}
p99 at most 2x the bare route's, POST at least 500/s on PostgreSQL). A serial, in-process
breakdown of one POST's and one GET's parts follows (same code, no HTTP), with raw SQLite
commit and fsync costs for reference. --profile runs the server under cProfile (all its
threads; slower) and writes the top functions next to the server log.

Timings are reported, never asserted: on a busy machine they are noisy, so the load
average before and after is printed with them. The exit code is 1 only when a request
errored (2 when a server would not start). Each server process (and PostgreSQL) is stopped
at the end, also on error. The table goes to --out (a .txt), the same figures as JSON next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from common import host, write_json, write_results  # bench/ is sys.path[0] when run as a script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

RESULTS = os.path.join(ROOT, "bench", "results", "api_latency.txt")
TOKEN_ENV = "ETRAIN_BENCH_TOKEN"
PROFILE_ENV = "ETRAIN_BENCH_PROFILE"
WORKERS_ENV = "ETRAIN_BENCH_WORKERS"
DATA_DIR_ENV = "ETRAIN_BENCH_DATA_DIR"
JOB_BODY = {"model": "simple_cnn", "dataset": "synthetic"}
HOST = "127.0.0.1"
BARE = "/bench/bare"  # the baseline: a bare FastAPI route returning a constant
BARE_MW = "/bench/bare-mw"  # the same route behind the service's middleware
BARE_ANSWER = {"status": "ok"}
LEDGERS = ("sqlite", "postgresql")
# The calls, in the table's order; the names are the JSON rows' "call".
POST, BARE_CALL, BARE_MW_CALL, GET, GET_BUSY, LIST = (
    "POST /v1/jobs", f"GET {BARE}", f"GET {BARE_MW}", "GET /v1/jobs/{id}", "GET /v1/jobs/{id} busy", "GET /v1/jobs")
GOAL_RATIO, GOAL_POSTS = 2.0, 500.0  # issue 13: GET p99 <= 2x the bare route's; POST >= 500/s on PostgreSQL


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the server


def serve(data_dir: str, port: int) -> None:
    """The server process: uvicorn, one worker unless WORKERS_ENV says more, no access log, no
    reconciler; the service's ledger is DATABASE_URL's (from the environment) or SQLite in data_dir."""
    _die_with_parent()
    import uvicorn

    os.environ[DATA_DIR_ENV] = data_dir
    workers = int(os.environ.get(WORKERS_ENV) or 1)
    # Keep-alive for the run: a client idle between phases must not find its connection closed.
    options = {"host": HOST, "port": port, "log_level": "warning", "access_log": False, "timeout_keep_alive": 3600}
    if workers > 1:  # uvicorn starts each worker from an import string
        uvicorn.run("api_latency:served_app", factory=True, workers=workers, app_dir=os.path.dirname(__file__),
                    **options)
        return
    with _profiled(os.environ.get(PROFILE_ENV)):
        uvicorn.run(served_app(), workers=1, **options)


def served_app():
    """The service's app (FakeGateway, no reconciler), with the two baselines in front."""
    _die_with_parent()
    from fastapi import FastAPI

    from api.app import create_app
    from service.settings import Settings
    from tests.fakes import FakeGateway

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    app = create_app(Settings(data_dir=os.environ[DATA_DIR_ENV], token=os.environ[TOKEN_ENV]), FakeGateway(),
                     reconcile=False)

    @app.get(BARE_MW, include_in_schema=False)
    async def bare_behind_middleware():
        return BARE_ANSWER

    bare = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @bare.get(BARE)
    async def bare_route():
        return BARE_ANSWER

    async def served(scope, receive, send):  # /bench/bare to the bare app, all else (lifespan too) to the service
        if scope["type"] == "http" and scope["path"] == BARE:
            return await bare(scope, receive, send)
        return await app(scope, receive, send)

    return served


@contextlib.contextmanager
def _profiled(path: str | None):
    """cProfile every thread of this process (the event loop's and the thread pool's, where
    FastAPI runs plain `def` routes) until uvicorn returns, in CPU time; the merged stats go to `path`."""
    if not path:
        yield
        return
    import cProfile
    import pstats
    import threading

    # Each thread's CPU time (thread_time), not wall time: what costs the one core, not what waits.
    profiles = [cProfile.Profile(time.thread_time)]

    def start(*_):  # the first event of each new thread: profile it from here on
        p = cProfile.Profile(time.thread_time)
        profiles.append(p)
        p.enable()

    def stop(*_):  # uvicorn re-raises the SIGTERM it shut down on, once it has: end here, stats first
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    threading.setprofile(start)
    profiles[0].enable()
    try:
        yield
    finally:
        profiles[0].disable()
        threading.setprofile(None)
        stats = None
        for p in profiles:
            try:
                p.disable()
                stats = pstats.Stats(p) if stats is None else stats.add(p)
            except Exception as e:  # noqa: BLE001  (a thread's profile lost, the others kept)
                print(f"[bench] a thread's profile was lost: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if stats is not None:
            stats.dump_stats(path)


def _die_with_parent() -> None:
    # Linux: SIGTERM this process when the bench process dies, however it dies.
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: str

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def cpu_s(self) -> tuple[float, float]:
        """(user, system) CPU seconds of the server process (all its threads) and of its live
        children (uvicorn's workers, with --workers), from /proc."""
        tick = os.sysconf("SC_CLK_TCK")
        user = system = 0.0
        for pid in [self.proc.pid, *self._children()]:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                user, system = user + int(fields[11]) / tick, system + int(fields[12]) / tick
            except (OSError, IndexError, ValueError):
                if pid == self.proc.pid:
                    return float("nan"), float("nan")
        return user, system

    def _children(self) -> list[int]:
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                return [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            return []

    def log_tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
        return ""

    def stop(self) -> None:
        """SIGTERM the server by its pid; SIGKILL it if it has not exited in 30 s (a profiled
        one writes its stats first)."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def start_server(data_dir: str, token: str, log_path: str, *, database_url: str | None = None,
                 profile: str | None = None, workers: int = 1, timeout: float = 60.0) -> Server:
    # The service reads ETRAIN_*, DATABASE_URL and RAY_ADDRESS; none of the caller's may leak in.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ETRAIN_") and k not in ("DATABASE_URL", "RAY_ADDRESS")}
    env[TOKEN_ENV] = token
    if database_url:
        env["DATABASE_URL"] = database_url
    if profile:
        env[PROFILE_ENV] = profile
    env[WORKERS_ENV] = str(workers)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    last_error = "no attempt"
    for _ in range(3):  # the free port can be taken between free_port() and the bind: retry
        port = free_port()
        with open(log_path, "ab") as out:
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", data_dir, str(port)],
                                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        server = Server(proc, port, log_path)
        try:
            last_error = _wait_ready(server, timeout)
        except BaseException:
            server.stop()
            raise
        if last_error is None:
            return server
        server.stop()
    raise RuntimeError(f"the server did not start: {last_error}\n{Server(proc, 0, log_path).log_tail()}")


def _wait_ready(server: Server, timeout: float) -> str | None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            return f"exited with {server.proc.returncode}"
        try:
            if httpx.get(f"{server.url}/healthz", timeout=2).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return f"no answer on /healthz within {timeout:.0f}s"


@contextlib.contextmanager
def postgres(fsync: bool):
    """A throwaway PostgreSQL server (tests/helpers/postgres.py), stopped and removed on exit.
    That helper starts it with fsync off (a test server); a ledger's commits are measured
    with fsync on unless asked otherwise, so it is restarted with fsync on (the last -c wins)."""
    from tests.helpers.postgres import postgres_server

    with postgres_server() as pg:
        if fsync:
            pg.stop()
            pg._run("pg_ctl", "-D", str(pg.data_dir), "-l", str(pg.log_path), "-o",
                    f"-h 127.0.0.1 -p {pg.port} -k {pg.base} -c fsync=off -c max_connections=200 -c fsync=on",
                    "-w", "-t", "60", "start")
        yield pg


def pg_facts(url: str) -> str:
    import psycopg

    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]
        on = {name: conn.execute(f"SHOW {name}").fetchone()[0]
              for name in ("fsync", "synchronous_commit", "max_connections")}
    return f"PostgreSQL {version.split()[0]} ({', '.join(f'{k}={v}' for k, v in on.items())})"


# --------------------------------------------------------------------------- the load


@dataclass
class Phase:
    name: str
    latencies_s: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    server_cpu_s: float = 0.0
    server_sys_s: float = 0.0
    client_cpu_s: float = 0.0

    @property
    def n(self) -> int:
        return len(self.latencies_s)

    @property
    def errors(self) -> int:
        return sum(c for s, c in self.statuses.items() if not s.startswith("2"))

    @property
    def rate(self) -> float:
        return self.n / self.wall_s if self.wall_s else float("nan")

    def pct_ms(self, q: float) -> float:
        """Nearest-rank percentile, in ms."""
        xs = sorted(self.latencies_s)
        if not xs:
            return float("nan")
        return 1000 * xs[min(len(xs) - 1, max(0, int(-(-q * len(xs) // 100)) - 1))]

    def add(self, other: Phase) -> None:
        """Another round of the same call."""
        self.latencies_s += other.latencies_s
        for s, c in other.statuses.items():
            self.statuses[s] = self.statuses.get(s, 0) + c
        self.error_samples += other.error_samples[:max(0, 5 - len(self.error_samples))]
        self.wall_s += other.wall_s
        self.server_cpu_s += other.server_cpu_s
        self.server_sys_s += other.server_sys_s
        self.client_cpu_s += other.client_cpu_s


async def run_phase(clients, name: str, method: str, path_of, body: dict | None, total: int,
                    server: Server | None) -> Phase:
    """`total` requests from one task per client, each sending its next request as soon as its
    last one is answered (a closed loop: what a pool of busy clients does)."""
    phase = Phase(name)
    counter = iter(range(total))

    async def worker(client):
        for i in counter:
            started = time.perf_counter()
            try:
                r = await client.request(method, path_of(i), json=body)
                status = str(r.status_code)
                if not 200 <= r.status_code < 300 and len(phase.error_samples) < 5:
                    phase.error_samples.append(f"{method} {path_of(i)} -> {r.status_code} {r.text[:200]}")
            except Exception as e:  # noqa: BLE001  (a failed request is an error too, never a crash of the bench)
                status = type(e).__name__
                if len(phase.error_samples) < 5:
                    phase.error_samples.append(f"{method} {path_of(i)} -> {type(e).__name__}: {e}"[:300])
            phase.latencies_s.append(time.perf_counter() - started)
            phase.statuses[status] = phase.statuses.get(status, 0) + 1

    cpu0, srv0, t0 = time.process_time(), server.cpu_s() if server else (0.0, 0.0), time.perf_counter()
    await asyncio.gather(*(worker(c) for c in clients))
    phase.wall_s = time.perf_counter() - t0
    phase.client_cpu_s = time.process_time() - cpu0
    if server:
        srv1 = server.cpu_s()
        phase.server_cpu_s, phase.server_sys_s = srv1[0] + srv1[1] - sum(srv0), srv1[1] - srv0[1]
    return phase


def seed_busy_run_dir(run_dir: str, n_events: int, n_metrics: int) -> int:
    """Fill a run directory as a long job leaves it: the events a worker writes (one
    checkpoint_committed per checkpoint) and one metrics line per step. Returns the events
    file's size in bytes."""
    from workers import events

    os.makedirs(run_dir, exist_ok=True)
    now = time.time()
    made = [events.JobStarted(time=now, pid=1, ray_address=None),
            events.AttemptStarted(time=now, attempt=1, world_size=2, from_step=0, checkpoint=None),
            events.TrainingStarted(time=now, attempt=1, world_size=2, total_steps=50 * max(1, n_events), from_step=0,
                                   checkpoint=None),
            events.WorkerStarted(time=now, attempt=1, rank=0, pid=2, node_id="n"),
            events.WorkerStarted(time=now, attempt=1, rank=1, pid=3, node_id="n")]
    step = 0
    while len(made) < n_events:
        step += 50
        made.append(events.CheckpointCommitted(time=now, step=step, path=f"checkpoints/step_{step:09d}", save_s=0.0123))
    records = [e.record() for e in made]
    with open(os.path.join(run_dir, events.EVENTS), "w") as f:
        f.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in records[:n_events])
    with open(os.path.join(run_dir, events.METRICS), "w") as f:
        f.writelines(json.dumps({"time": now, "step": s, "epoch": s // 128, "loss": 0.5, "lr": 0.001,
                                 "samples_per_s": 6800.0, "step_s": 0.0094, "attempt": 1},
                                separators=(",", ":")) + "\n" for s in range(1, n_metrics + 1))
    return os.path.getsize(os.path.join(run_dir, events.EVENTS))


def keep_summaries(db_url: str, runs_dir: str) -> int:
    """What one reconciler tick keeps for each active job: its run record's summary, in the
    ledger (Reconciler._keep_summary), so the job views read no run record. Returns the jobs."""
    from service import ledger, rundir

    sessions = ledger.open_ledger(db_url)
    try:
        active = ledger.active_jobs(sessions)
        for job in active:
            ledger.save_summary(sessions, job_id=job.id, summary=rundir.summary(rundir.run_dir(runs_dir, job.id)))
        return len(active)
    finally:
        ledger.engine_of(sessions).dispose()


async def load(server: Server, token: str, args, runs_dir: str, db_url: str) -> tuple[list[Phase], dict[str, Any]]:
    import httpx

    # One client (one connection) per task: a single AsyncClient shared by 50 tasks spends
    # milliseconds of CPU per request in its connection pool and becomes the bottleneck.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    facts: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Bearer {token}"}, limits=limits,
            timeout=args.request_timeout)) for _ in range(args.concurrency)]
        client = clients[0]
        ids = []
        for _ in range(2):
            r = await client.post("/v1/jobs", json=JOB_BODY)
            if r.status_code != 201:
                raise RuntimeError(f"setup POST /v1/jobs answered {r.status_code}: {r.text[:500]}")
            ids.append(r.json()["id"])
        quiet_id, busy_id = ids
        facts["busy_events_bytes"] = seed_busy_run_dir(os.path.join(runs_dir, busy_id), args.events, args.metrics)

        async def warm_up(name, method, path_of, body) -> None:
            if args.warmup:
                log(f"{name}: warm-up, {args.warmup} requests")
                warm = await run_phase(clients, name, method, path_of, body, args.warmup, None)
                if warm.errors:
                    log(f"{name}: {warm.errors} errors in the warm-up: {warm.error_samples[:2]}")

        def said(p: Phase) -> None:
            log(f"{p.name}: {p.rate:.0f} req/s, p50 {p.pct_ms(50):.1f} ms, p99 {p.pct_ms(99):.1f} ms, "
                f"{p.errors} errors")

        await warm_up(POST, "POST", lambda i: "/v1/jobs", JOB_BODY)
        log(f"{POST}: {args.requests} requests from {args.concurrency} clients")
        posts = await run_phase(clients, POST, "POST", lambda i: "/v1/jobs", JOB_BODY, args.requests, server)
        said(posts)

        facts["summaries_kept"] = await asyncio.to_thread(keep_summaries, db_url, runs_dir)
        r = await client.get(f"/v1/jobs/{busy_id}")
        if r.status_code != 200:
            raise RuntimeError(f"setup GET of the busy job answered {r.status_code}: {r.text[:500]}")
        facts["busy_progress"] = r.json()["progress"]
        facts["busy_response_bytes"] = len(r.content)
        r = await client.get(f"/v1/jobs/{quiet_id}")
        facts["quiet_state"], facts["quiet_response_bytes"] = r.json()["state"], len(r.content)
        r = await client.get("/v1/jobs")
        facts["list_response_bytes"], facts["jobs_in_ledger"] = len(r.content), r.json().get("count")

        reads = [(BARE_CALL, lambda i: BARE), (BARE_MW_CALL, lambda i: BARE_MW),
                 (GET, lambda i: f"/v1/jobs/{quiet_id}"), (GET_BUSY, lambda i: f"/v1/jobs/{busy_id}"),
                 (LIST, lambda i: "/v1/jobs")]
        if args.events <= 0:
            reads = [c for c in reads if c[0] != GET_BUSY]
        merged = {name: Phase(name) for name, _ in reads}
        for name, path_of in reads:
            await warm_up(name, "GET", path_of, None)
        rounds = min(args.rounds, args.requests)
        log(f"the GETs: {args.requests} requests each from {args.concurrency} clients, in {rounds} interleaved rounds")
        for k in range(rounds):
            share = args.requests // rounds + (1 if k < args.requests % rounds else 0)
            for name, path_of in reads[k % len(reads):] + reads[:k % len(reads)]:  # the order rotates
                merged[name].add(await run_phase(clients, name, "GET", path_of, None, share, server))
        for name, _ in reads:
            said(merged[name])
    return [posts, *merged.values()], facts


# --------------------------------------------------------------------------- in-process breakdown


def _timed(rows: list, label: str, fn, count: int) -> None:
    xs = []
    for i in range(count):
        t = time.perf_counter()
        fn(i)
        xs.append(time.perf_counter() - t)
    xs.sort()
    rows.append((label, 1000 * statistics.median(xs), 1000 * xs[int(0.9 * (len(xs) - 1))]))


def breakdown(n: int, n_events: int, n_metrics: int, db_url: str | None) -> list[tuple[str, float, float]]:
    """Median and p90 ms of each part of a POST and a GET, serially, in this process, on a
    fresh data dir and ledger (SQLite in it, or `db_url`; no HTTP, no concurrency): where one
    request's time goes."""
    from api.routes.jobs import to_public
    from service import jobs, ledger, rundir
    from service.admission import admit
    from service.lifecycle import JobState
    from service.settings import Settings
    from tests.fakes import FakeGateway
    from workers.spec import JobSpec

    tmp = tempfile.mkdtemp(prefix="etrain-bench-parts-")
    rows: list[tuple[str, float, float]] = []
    sessions = None
    try:
        settings = Settings(data_dir=os.path.join(tmp, "data"), token="x", database_url=db_url)
        os.makedirs(settings.data_dir, exist_ok=True)
        sessions = ledger.open_ledger(settings.db_url)
        gateway = FakeGateway()
        specs = [admit(JobSpec.model_validate(JOB_BODY), settings, gateway.cluster()) for _ in range(2 * n)]
        created: list[ledger.Job] = []

        def timed(label, fn, count=n):
            _timed(rows, label, fn, count)

        timed("POST: validate + admit the spec", lambda i: admit(JobSpec.model_validate(JOB_BODY), settings,
                                                                  gateway.cluster()))
        timed("POST: jobs.create (ledger INSERT + commit)", lambda i: created.append(jobs.create(
            sessions, settings, specs[i], body=specs[i].model_dump(mode="json"), idempotency_key=None)[0]))
        timed("POST: write spec.json (mkdir, fsync, rename)", lambda i: jobs.write_spec(settings, specs[i]))
        timed("POST: ledger update_job (state) + commit",
              lambda i: ledger.update_job(sessions, job_id=created[i].id, state=JobState.SUBMITTED))
        more = [jobs.create(sessions, settings, specs[n + i], body=specs[n + i].model_dump(mode="json"),
                            idempotency_key=None)[0] for i in range(n)]
        timed("POST: jobs.try_submit (spec.json, Ray, ledger)",
              lambda i: jobs.try_submit(sessions, settings, gateway, more[i]))
        timed("POST: to_public of the new job (no summary yet)",
              lambda i: to_public(more[i], settings, gateway, sessions), min(n, 50))

        quiet, busy = created[0], created[1]
        seed_busy_run_dir(rundir.run_dir(settings.runs_dir, busy.id), n_events, n_metrics)
        timed(f"GET: rundir.summary, run dir with {n_events} events", lambda i: rundir.summary(
            rundir.run_dir(settings.runs_dir, busy.id)), max(20, n // 4))
        for job in ledger.active_jobs(sessions):  # what one reconciler tick keeps
            ledger.save_summary(sessions, job_id=job.id,
                                summary=rundir.summary(rundir.run_dir(settings.runs_dir, job.id)))
        timed("GET: ledger.job_row (the view's read)", lambda i: ledger.job_row(sessions, job_id=quiet.id))
        quiet, busy = ledger.job_row(sessions, job_id=quiet.id), ledger.job_row(sessions, job_id=busy.id)
        timed("GET: to_public, summary in the ledger (fresh job)", lambda i: to_public(quiet, settings, gateway,
                                                                                        sessions))
        timed("GET: to_public, summary in the ledger (busy job)", lambda i: to_public(busy, settings, gateway,
                                                                                       sessions))
        page, _ = ledger.job_rows(sessions)
        timed(f"GET list: ledger.job_rows ({len(page)} jobs, count)", lambda i: ledger.job_rows(sessions),
              max(20, n // 4))
        timed(f"GET list: to_public of {len(page)} jobs", lambda i: [to_public(j, settings, gateway, sessions)
                                                                      for j in page], max(20, n // 4))
    finally:
        if sessions is not None:
            ledger.engine_of(sessions).dispose()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def references(n: int) -> list[tuple[str, float, float]]:
    """For reference: a commit with plain sqlite3 (WAL, synchronous FULL vs NORMAL), and a
    small file written with fsync, on the temp dir's file system."""
    tmp = tempfile.mkdtemp(prefix="etrain-bench-refs-")
    rows: list[tuple[str, float, float]] = []
    try:
        for mode in ("FULL", "NORMAL"):
            con = sqlite3.connect(os.path.join(tmp, f"raw-{mode}.db"), isolation_level=None)
            con.execute("PRAGMA journal_mode=WAL")
            con.execute(f"PRAGMA synchronous={mode}")
            con.execute("CREATE TABLE t (id TEXT PRIMARY KEY, v TEXT)")
            _timed(rows, f"ref: sqlite3 INSERT+commit, WAL, synchronous={mode}",
                   lambda i, con=con: con.execute("INSERT INTO t VALUES (?, ?)", (uuid.uuid4().hex, "x" * 600)), n)
            con.close()

        def write_fsync(i):
            with open(os.path.join(tmp, f"fsync-{i}.bin"), "w") as f:
                f.write("x" * 1500)
                f.flush()
                os.fsync(f.fileno())

        _timed(rows, "ref: write a new 1.5 kB file + fsync", write_fsync, n)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def profile_summary(path: str, top: int = 40) -> str:
    """The profiled server's top functions, by own time and by cumulative time."""
    import io
    import pstats

    out = io.StringIO()
    stats = pstats.Stats(path, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


# --------------------------------------------------------------------------- report


@dataclass
class Run:
    """One ledger's server, load and breakdown."""
    ledger: str
    db: str = ""  # what the ledger is, in words
    phases: list[Phase] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    parts: list[tuple[str, float, float]] = field(default_factory=list)
    profile: str | None = None

    def call(self, name: str) -> Phase | None:
        return next((p for p in self.phases if p.name == name), None)

    def vs_bare(self, name: str, q: float) -> float:
        p, bare = self.call(name), self.call(BARE_CALL)
        return p.pct_ms(q) / bare.pct_ms(q) if p and bare and bare.pct_ms(q) > 0 else float("nan")


def filesystem_of(path: str) -> str:
    best, kind = "", "?"
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")) \
                    and len(parts[1]) >= len(best):
                best, kind = parts[1], f"{parts[2]} on {parts[1]}"
    return kind


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def versions() -> str:
    out = []
    for name in ("fastapi", "starlette", "uvicorn", "httpx", "sqlalchemy", "pydantic", "psycopg"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out.append(f"{name} {importlib.metadata.version(name)}")
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return ", ".join(out) + f"; uvicorn loop={loop} http={http}"


def goals(runs: list[Run]) -> dict[str, Any]:
    """Issue 13's goal, per ledger: GET /v1/jobs/{id} p99 at most 2x the bare route's; POST
    at least 500/s on PostgreSQL."""
    out: dict[str, Any] = {}
    for run in runs:
        ratio = run.vs_bare(GET, 99)
        posts = run.call(POST)
        out[run.ledger] = {"get_p99_vs_bare": ratio, "get_p99_met": bool(ratio <= GOAL_RATIO),
                           "post_per_s": posts.rate if posts else None}
        if run.ledger == "postgresql":
            out[run.ledger]["post_met"] = bool(posts and posts.rate >= GOAL_POSTS)
    return out


def report(args, runs: list[Run], refs, load_before, load_after, workdir) -> str:
    cpus = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    facts = runs[0].facts if runs else {}
    lines = [
        (f"elastic-train API latency: {'one uvicorn worker' if args.workers == 1 else f'{args.workers} uvicorn workers'}"
         f" per ledger ({', '.join(r.ledger for r in runs)}), "
         "FakeGateway (no Ray), reconciler off (each job's summary kept in the ledger as one tick keeps it)"),
        (f"load: {args.concurrency} concurrent clients (asyncio tasks, one httpx.AsyncClient and keep-alive "
         f"connection each), closed loop; {args.warmup} warm-up + {args.requests} timed requests per call; "
         f"the GETs in {min(args.rounds, args.requests)} interleaved rounds"),
        (f"host: {platform.node() or '?'}, {cpus} cores ({usable} usable), {cpu_model()}, "
         f"python {platform.python_version()}, {platform.system()} {platform.release()}"),
        (f"load avg (1/5/15 min): {' '.join(f'{x:.2f}' for x in load_before)} before, "
         f"{' '.join(f'{x:.2f}' for x in load_after)} after; "
         f"{datetime.now(UTC).strftime('%Y-%m-%d %H:%M:%S')} UTC"),
        f"data dir: {filesystem_of(workdir)}; {versions()}",
        (f"busy job: {args.events} events ({facts.get('busy_events_bytes', 0) / 1024:.0f} KiB events.jsonl), "
         f"{args.metrics} metrics lines; responses: {facts.get('quiet_response_bytes')} B (fresh job), "
         f"{facts.get('busy_response_bytes')} B (busy job), {facts.get('list_response_bytes')} B (list, 50 jobs)"),
        (f"baselines: {BARE_CALL} is a bare FastAPI route returning a constant (no middleware); "
         f"{BARE_MW_CALL} is that route behind the service's middleware (auth, body limit, timing)"),
    ]
    if args.profile:
        lines.append("PROFILED: the server ran under cProfile (all threads), so every figure is slower than it is")
    header = (f"{'call':<26}{'requests':>9}{'errors':>7}{'req/s':>8}{'p50 ms':>8}{'p90 ms':>8}{'p99 ms':>8}"
              f"{'max ms':>8}{'srv cpu':>8}{'of it sys':>10}{'cli cpu':>8}{'srv ms/req':>11}")
    for run in runs:
        lines += ["", f"ledger: {run.ledger}: {run.db}; jobs in the ledger at the end: {run.facts.get('jobs_in_ledger')}",
                  header]
        for p in run.phases:
            lines.append(f"{p.name:<26}{p.n:>9}{p.errors:>7}{p.rate:>8.0f}{p.pct_ms(50):>8.1f}"
                         f"{p.pct_ms(90):>8.1f}{p.pct_ms(99):>8.1f}{p.pct_ms(100):>8.1f}"
                         f"{100 * p.server_cpu_s / p.wall_s:>7.0f}%{100 * p.server_sys_s / p.wall_s:>9.0f}%"
                         f"{100 * p.client_cpu_s / p.wall_s:>7.0f}%"
                         f"{1000 * p.server_cpu_s / p.n:>11.2f}")
    lines.append("srv cpu / cli cpu: CPU time of the server process (all threads; its workers too) / of this client over the "
                 "phase, in % of one core (of it sys: the server's time in the kernel: fsync, file reads, "
                 "sockets); srv ms/req: server CPU time per request")
    lines += ["", f"against the bare route ({BARE_CALL}), same server, same clients, same rounds:",
              f"{'ledger':<12}{'call':<26}{'p50 ms':>8}{'p99 ms':>8}{'p50 x bare':>11}{'p99 x bare':>11}"]
    for run in runs:
        for name in (BARE_MW_CALL, GET, GET_BUSY, LIST):
            p = run.call(name)
            if p is not None:
                lines.append(f"{run.ledger:<12}{name:<26}{p.pct_ms(50):>8.1f}{p.pct_ms(99):>8.1f}"
                             f"{run.vs_bare(name, 50):>10.2f}x{run.vs_bare(name, 99):>10.2f}x")
    verdicts = goals(runs)
    said = []
    for run in runs:
        g = verdicts[run.ledger]
        said.append(f"{run.ledger}: GET /v1/jobs/{{id}} p99 {g['get_p99_vs_bare']:.2f}x bare "
                    f"({'met' if g['get_p99_met'] else 'NOT met'}), POST {g['post_per_s']:.0f}/s"
                    + (f" ({'met' if g['post_met'] else 'NOT met'})" if "post_met" in g else ""))
    lines.append(f"goal (issue 13, {args.concurrency} clients): GET /v1/jobs/{{id}} p99 <= {GOAL_RATIO:g}x the bare "
                 f"route's, POST >= {GOAL_POSTS:g}/s on PostgreSQL; " + "; ".join(said))
    for run in runs:
        for p in run.phases:
            if p.errors:
                lines.append(f"{run.ledger} {p.name}: statuses {dict(sorted(p.statuses.items()))}")
                lines.extend(f"  {s}" for s in p.error_samples)
    for run in runs:
        if run.parts:
            title = f"in-process, serial (no HTTP, no concurrency), {run.ledger} ledger, up to {args.parts} calls each:"
            lines += ["", title, f"{'part':<56}{'median ms':>10}{'p90 ms':>8}"]
            lines.extend(f"{label:<56}{med:>10.3f}{p90:>8.3f}" for label, med, p90 in run.parts)
    if refs:
        lines += ["", f"for reference, on the data dir's file system, {args.parts} calls each:",
                  f"{'part':<56}{'median ms':>10}{'p90 ms':>8}"]
        lines.extend(f"{label:<56}{med:>10.3f}{p90:>8.3f}" for label, med, p90 in refs)
    errors = sum(p.errors for run in runs for p in run.phases)
    lines += ["", f"errors: {errors}" + ("" if errors else " (all requests answered 2xx)")]
    return "\n".join(lines) + "\n"


def as_data(args, runs: list[Run], refs, load_before, load_after) -> dict:
    """The table's figures as JSON (bench/results/api_latency.json)."""
    return {
        "bench": "api_latency",
        "quick": False,
        "host": host(load_before, load_after, packages=("fastapi", "uvicorn", "sqlalchemy", "pydantic", "psycopg")),
        "load": {"concurrency": args.concurrency, "workers": args.workers, "warmup": args.warmup,
                 "requests": args.requests,
                 "rounds": min(args.rounds, args.requests), "events": args.events, "metrics": args.metrics,
                 "profiled": bool(args.profile)},
        "goal": {"get_p99_max_vs_bare": GOAL_RATIO, "post_min_per_s_postgresql": GOAL_POSTS, **goals(runs)},
        "ledgers": {run.ledger: {"db": run.db, "facts": run.facts} for run in runs},
        "rows": [{"ledger": run.ledger, "call": p.name, "requests": p.n, "errors": p.errors,
                  "req_per_s": p.rate if p.wall_s else None,
                  **{f"p{q}_ms": p.pct_ms(q) for q in (50, 90, 99)}, "max_ms": p.pct_ms(100),
                  "p50_vs_bare": run.vs_bare(p.name, 50), "p99_vs_bare": run.vs_bare(p.name, 99),
                  "server_cpu_pct": 100 * p.server_cpu_s / p.wall_s if p.wall_s else None,
                  "server_sys_pct": 100 * p.server_sys_s / p.wall_s if p.wall_s else None,
                  "client_cpu_pct": 100 * p.client_cpu_s / p.wall_s if p.wall_s else None,
                  "server_ms_per_request": 1000 * p.server_cpu_s / p.n if p.n else None}
                 for run in runs for p in run.phases],
        "parts": [{"ledger": run.ledger, "part": label, "median_ms": med, "p90_ms": p90}
                  for run in runs for label, med, p90 in run.parts]
                 + [{"ledger": None, "part": label, "median_ms": med, "p90_ms": p90} for label, med, p90 in refs],
    }


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/api_latency.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ledger", choices=(*LEDGERS, "both"), default="both",
                   help="the ledger(s) to serve from, one server each: SQLite in the data dir, or a PostgreSQL "
                        "server started for the run")
    p.add_argument("--requests", type=int, default=2000, help="timed requests per call")
    p.add_argument("--warmup", type=int, default=200, help="untimed requests per call, first")
    p.add_argument("--concurrency", type=int, default=50, help="concurrent clients (tasks, connections)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds the GETs' requests are split into")
    p.add_argument("--events", type=int, default=2000,
                   help="events.jsonl records of the busy job (0: skip that call); 2000 is a 100k-step job "
                        "checkpointing every 50 steps")
    p.add_argument("--metrics", type=int, default=20000, help="metrics.jsonl lines of the busy job")
    p.add_argument("--parts", type=int, default=200, help="calls per part in the in-process breakdown (0: skip)")
    p.add_argument("--pg-fsync", choices=("on", "off"), default="on",
                   help="PostgreSQL's fsync (off: as the test suite runs it)")
    p.add_argument("--workers", type=int, default=1,
                   help="uvicorn workers (processes) serving: 1 is the measurement's setup; more, for comparison")
    p.add_argument("--profile", action="store_true",
                   help="run the server under cProfile (all threads, CPU time; slower) and write its top functions to "
                        "profile-<ledger>.txt in the kept work dir")
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds before a request counts as failed")
    p.add_argument("--workdir", help="parent of the temp data dir (None: the system temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the data dir (and the server log)")
    p.add_argument("--out", default=RESULTS, help="where the table is written")
    p.add_argument("--serve", nargs=2, metavar=("DATA_DIR", "PORT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return args
    if args.profile and args.workers > 1:
        p.error("--profile profiles one worker: leave --workers at 1")
    for name in ("requests", "concurrency", "rounds", "workers"):
        if not 1 <= getattr(args, name) <= 1_000_000:
            p.error(f"--{name} must be within 1..1000000")
    for name in ("warmup", "events", "metrics", "parts"):
        if not 0 <= getattr(args, name) <= 1_000_000:
            p.error(f"--{name} must be within 0..1000000")
    return args


def measure(args, ledger_name: str, workdir: str, token: str, stack: contextlib.ExitStack) -> Run:
    """One ledger: its server, the load, then the server stopped and the in-process breakdown."""
    run = Run(ledger_name)
    data_dir = os.path.join(workdir, ledger_name, "data")
    os.makedirs(data_dir)
    database_url = parts_url = None
    if ledger_name == "postgresql":
        log(f"starting PostgreSQL (fsync {args.pg_fsync})")
        pg = stack.enter_context(postgres(args.pg_fsync == "on"))
        database_url, parts_url = pg.create_database("etrain_bench"), pg.create_database("etrain_bench_parts")
        run.db = pg_facts(database_url)
    else:
        run.db = f"SQLite, WAL, synchronous=FULL, {filesystem_of(data_dir)}"
    profile = os.path.join(workdir, f"server-{ledger_name}.prof") if args.profile else None
    log(f"{ledger_name}: data dir {data_dir}; starting the server")
    server = start_server(data_dir, token, os.path.join(workdir, f"server-{ledger_name}.log"),
                          database_url=database_url, profile=profile, workers=args.workers)
    try:
        log(f"{ledger_name}: server pid {server.proc.pid} on {server.url}")
        db_url = database_url or f"sqlite:///{os.path.join(data_dir, 'ledger.db')}"
        run.phases, run.facts = asyncio.run(load(server, token, args, os.path.join(data_dir, "runs"), db_url))
    finally:
        server.stop()
    if server.proc.returncode not in (0, -signal.SIGTERM):
        log(f"{ledger_name}: server exited with {server.proc.returncode}:\n{server.log_tail()}")
    if profile and os.path.exists(profile):
        path = os.path.join(workdir, f"profile-{ledger_name}.txt")
        with open(path, "w") as f:
            f.write(profile_summary(profile))
        run.profile = path
        log(f"{ledger_name}: server profile in {path}")
    if args.parts:
        log(f"{ledger_name}: in-process breakdown, {args.parts} calls per part")
        run.parts = breakdown(args.parts, args.events or 2000, args.metrics, parts_url)
    return run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return 0
    workdir = tempfile.mkdtemp(prefix="etrain-bench-api-", dir=args.workdir)
    token = uuid.uuid4().hex
    load_before = list(os.getloadavg())
    runs: list[Run] = []
    failed = True
    try:
        with contextlib.ExitStack() as stack:  # PostgreSQL, stopped and removed on the way out
            for ledger_name in (LEDGERS if args.ledger == "both" else (args.ledger,)):
                runs.append(measure(args, ledger_name, workdir, token, stack))
        refs = references(args.parts) if args.parts else []
        load_after = list(os.getloadavg())
        text = report(args, runs, refs, load_before, load_after, workdir)
        print(text, end="", flush=True)
        write_results(text, os.path.abspath(args.out))
        log(f"written to {os.path.relpath(os.path.abspath(args.out), os.getcwd())}")
        path = write_json(as_data(args, runs, refs, load_before, load_after), os.path.abspath(args.out))
        log(f"JSON written to {os.path.relpath(path, os.getcwd())}")
        failed = any(p.errors for run in runs for p in run.phases)
        return 1 if failed else 0
    except RuntimeError as e:  # a server would not start, or the setup requests failed
        log(str(e))
        return 2
    except Exception:  # noqa: BLE001  (anything else: say what; the servers are stopped already)
        traceback.print_exc()
        return 2
    finally:
        if args.keep or args.profile or failed:
            log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
