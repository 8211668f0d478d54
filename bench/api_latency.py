"""Latency and throughput of the control plane's two hottest calls, under concurrent clients.

    python bench/api_latency.py [--requests 2000] [--concurrency 50] [--warmup 200] ...

One uvicorn worker serves create_app(Settings(data_dir=<temp dir>, token=...), FakeGateway(),
reconcile=False) on 127.0.0.1 and a free port, in its own process (this script, re-run with
--serve), so the load generator does not share its GIL. Ray is not involved: FakeGateway
answers submit() at once, so what is measured is the service itself (FastAPI, the SQLite
ledger, spec.json, the run directory reads).

Then --concurrency asyncio tasks, each with its own httpx.AsyncClient holding one keep-alive
connection, send --warmup untimed requests, then --requests timed ones, of each of:

  POST /v1/jobs              {"model": "simple_cnn", "dataset": "synthetic"}: a new job each time
                             (ledger INSERT, spec.json written with fsync, two ledger updates)
  GET  /v1/jobs/{id}         a job whose run directory holds only spec.json (a fresh job)
  GET  /v1/jobs/{id} (busy)  a job whose run directory holds --events events.jsonl records and
                             --metrics metrics.jsonl lines, as a long job leaves it

Reported per call: requests/s, latency p50/p90/p99/max in ms, errors (any non-2xx or failed
request), and the CPU time the server and this client used over the phase. A serial,
in-process breakdown of one POST's and one GET's parts follows (same code, no HTTP), with
raw SQLite commit and fsync costs for reference.

Timings are reported, never asserted: on a busy machine they are noisy, so the load
average before and after is printed with them. The exit code is 1 only when a request
errored (2 when the server would not start). The server process is stopped by its pid at
the end, also on error. The table goes to --out (a .txt), the same figures as JSON next to it.
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
JOB_BODY = {"model": "simple_cnn", "dataset": "synthetic"}
HOST = "127.0.0.1"


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the server


def serve(data_dir: str, port: int) -> None:
    """The server process: one uvicorn worker, no access log, no reconciler."""
    _die_with_parent()
    import uvicorn

    from api.app import create_app
    from service.settings import Settings
    from tests.fakes import FakeGateway

    app = create_app(Settings(data_dir=data_dir, token=os.environ[TOKEN_ENV]), FakeGateway(), reconcile=False)
    uvicorn.run(app, host=HOST, port=port, workers=1, log_level="warning", access_log=False)


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
        """(user, system) CPU seconds of the server process (all its threads), from /proc."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            tick = os.sysconf("SC_CLK_TCK")
            return int(fields[11]) / tick, int(fields[12]) / tick
        except (OSError, IndexError, ValueError):
            return float("nan"), float("nan")

    def log_tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
        return ""

    def stop(self) -> None:
        """SIGTERM the server by its pid; SIGKILL it if it has not exited in 10 s."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def start_server(data_dir: str, token: str, log_path: str, timeout: float = 60.0) -> Server:
    # The service reads ETRAIN_*, DATABASE_URL and RAY_ADDRESS; none of the caller's may leak in.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ETRAIN_") and k not in ("DATABASE_URL", "RAY_ADDRESS")}
    env[TOKEN_ENV] = token
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

    def pct_ms(self, q: float) -> float:
        """Nearest-rank percentile, in ms."""
        xs = sorted(self.latencies_s)
        if not xs:
            return float("nan")
        return 1000 * xs[min(len(xs) - 1, max(0, int(-(-q * len(xs) // 100)) - 1))]


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
    records = [{"event": "job_started", "time": now, "pid": 1, "ray_address": None},
               {"event": "attempt_started", "time": now, "attempt": 1, "world_size": 2, "from_step": 0,
                "checkpoint": None},
               {"event": "training_started", "time": now, "attempt": 1, "world_size": 2,
                "total_steps": 50 * max(1, n_events), "from_step": 0, "checkpoint": None},
               {"event": "worker_started", "time": now, "attempt": 1, "rank": 0, "pid": 2, "node_id": "n"},
               {"event": "worker_started", "time": now, "attempt": 1, "rank": 1, "pid": 3, "node_id": "n"}]
    step = 0
    while len(records) < n_events:
        step += 50
        records.append({"event": "checkpoint_committed", "time": now, "step": step,
                        "path": f"checkpoints/step_{step:09d}", "save_s": 0.0123})
    with open(os.path.join(run_dir, events.EVENTS), "w") as f:
        f.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in records[:n_events])
    with open(os.path.join(run_dir, events.METRICS), "w") as f:
        f.writelines(json.dumps({"time": now, "step": s, "epoch": s // 128, "loss": 0.5, "lr": 0.001,
                                 "samples_per_s": 6800.0, "step_s": 0.0094, "attempt": 1},
                                separators=(",", ":")) + "\n" for s in range(1, n_metrics + 1))
    return os.path.getsize(os.path.join(run_dir, events.EVENTS))


async def load(server: Server, token: str, args, runs_dir: str) -> tuple[list[Phase], dict[str, Any]]:
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
        r = await client.get(f"/v1/jobs/{busy_id}")
        if r.status_code != 200:
            raise RuntimeError(f"setup GET of the busy job answered {r.status_code}: {r.text[:500]}")
        facts["busy_progress"] = r.json()["progress"]
        facts["quiet_state"] = (await client.get(f"/v1/jobs/{quiet_id}")).json()["state"]

        plan = [
            ("POST /v1/jobs", "POST", lambda i: "/v1/jobs", JOB_BODY),
            ("GET /v1/jobs/{id}", "GET", lambda i: f"/v1/jobs/{quiet_id}", None),
            ("GET /v1/jobs/{id} busy", "GET", lambda i: f"/v1/jobs/{busy_id}", None),
        ]
        if args.events <= 0:
            plan.pop()
        phases = []
        for name, method, path_of, body in plan:
            if args.warmup:
                log(f"{name}: warm-up, {args.warmup} requests")
                warm = await run_phase(clients, name, method, path_of, body, args.warmup, None)
                if warm.errors:
                    log(f"{name}: {warm.errors} errors in the warm-up: {warm.error_samples[:2]}")
            log(f"{name}: {args.requests} requests from {args.concurrency} clients")
            phase = await run_phase(clients, name, method, path_of, body, args.requests, server)
            log(f"{name}: {phase.n / phase.wall_s:.0f} req/s, p50 {phase.pct_ms(50):.1f} ms, "
                f"p99 {phase.pct_ms(99):.1f} ms, {phase.errors} errors")
            phases.append(phase)
        r = await client.get("/v1/jobs", params={"limit": 1})
        facts["jobs_in_ledger"] = r.json().get("count") if r.status_code == 200 else None
    return phases, facts


# --------------------------------------------------------------------------- in-process breakdown


def breakdown(n: int, n_events: int, n_metrics: int) -> list[tuple[str, float, float]]:
    """Median and p90 ms of each part of a POST and a GET, serially, in this process, on a
    fresh data dir (no HTTP, no concurrency): where one request's time goes."""
    from service import jobs, ledger, rundir
    from service.admission import admit
    from service.settings import Settings
    from tests.fakes import FakeGateway
    from workers import events
    from workers.spec import JobSpec

    tmp = tempfile.mkdtemp(prefix="etrain-bench-parts-")
    rows: list[tuple[str, float, float]] = []

    def timed(label: str, fn, count: int = n) -> None:
        xs = []
        for i in range(count):
            t = time.perf_counter()
            fn(i)
            xs.append(time.perf_counter() - t)
        xs.sort()
        rows.append((label, 1000 * statistics.median(xs), 1000 * xs[int(0.9 * (len(xs) - 1))]))

    try:
        settings = Settings(data_dir=os.path.join(tmp, "data"), token="x")
        os.makedirs(settings.data_dir, exist_ok=True)
        sessions = ledger.open_ledger(settings.db_url)
        gateway = FakeGateway()
        specs = [admit(JobSpec.model_validate(JOB_BODY), settings, gateway.cluster()) for _ in range(n)]
        created: list[ledger.Job] = []

        timed("POST: validate + admit the spec", lambda i: admit(JobSpec.model_validate(JOB_BODY), settings,
                                                                  gateway.cluster()))
        timed("POST: ledger INSERT + commit", lambda i: created.append(jobs.create(
            sessions, settings, specs[i], body=specs[i].model_dump(mode="json"), idempotency_key=None)[0]))
        timed("POST: write spec.json (mkdir, fsync, rename)", lambda i: jobs.write_spec(settings, specs[i]))
        from service.lifecycle import JobState
        timed("POST: ledger update_job (state) + commit",
              lambda i: ledger.update_job(sessions, job_id=created[i].id, state=JobState.SUBMITTED))
        job = created[0]
        timed("GET: ledger get_job", lambda i: ledger.get_job(sessions, job_id=job.id))
        from api.routes.jobs import to_public
        timed("GET: to_public, run dir with spec.json only", lambda i: to_public(job, settings, gateway))
        busy = created[1]
        seed_busy_run_dir(rundir.run_dir(settings.runs_dir, busy.id), n_events, n_metrics)
        timed(f"GET: to_public, run dir with {n_events} events", lambda i: to_public(busy, settings, gateway),
              max(20, n // 4))
        timed("  of which reading and parsing events.jsonl",
              lambda i: events.events(rundir.run_dir(settings.runs_dir, busy.id)), max(20, n // 4))

        # For reference: the same commit with plain sqlite3, WAL, synchronous FULL vs NORMAL.
        for mode in ("FULL", "NORMAL"):
            con = sqlite3.connect(os.path.join(tmp, f"raw-{mode}.db"), isolation_level=None)
            con.execute("PRAGMA journal_mode=WAL")
            con.execute(f"PRAGMA synchronous={mode}")
            con.execute("CREATE TABLE t (id TEXT PRIMARY KEY, v TEXT)")
            timed(f"ref: sqlite3 INSERT+commit, WAL, synchronous={mode}",
                  lambda i, con=con: con.execute("INSERT INTO t VALUES (?, ?)", (uuid.uuid4().hex, "x" * 600)))
            con.close()
        def write_fsync(i):
            with open(os.path.join(tmp, f"fsync-{i}.bin"), "w") as f:
                f.write("x" * 1500)
                f.flush()
                os.fsync(f.fileno())
        timed("ref: write a new 1.5 kB file + fsync", write_fsync)
        engine = ledger.engine_of(sessions)
        engine.dispose()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


# --------------------------------------------------------------------------- report


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
    for name in ("fastapi", "starlette", "uvicorn", "httpx", "sqlalchemy", "pydantic"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out.append(f"{name} {importlib.metadata.version(name)}")
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return ", ".join(out) + f"; uvicorn loop={loop} http={http}"


def report(args, phases: list[Phase], facts: dict[str, Any], parts, load_before, load_after, data_dir) -> str:
    cpus = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    lines = [
        "elastic-train API latency: one uvicorn worker, FakeGateway (no Ray), SQLite ledger, reconciler off",
        (f"load: {args.concurrency} concurrent clients (asyncio tasks, one httpx.AsyncClient and keep-alive "
         f"connection each), closed loop; {args.warmup} warm-up + {args.requests} timed requests per call"),
        (f"host: {platform.node() or '?'}, {cpus} cores ({usable} usable), {cpu_model()}, "
         f"python {platform.python_version()}, {platform.system()} {platform.release()}"),
        (f"load avg (1/5/15 min): {' '.join(f'{x:.2f}' for x in load_before)} before, "
         f"{' '.join(f'{x:.2f}' for x in load_after)} after; "
         f"{datetime.now(UTC).strftime('%Y-%m-%d %H:%M:%S')} UTC"),
        f"data dir: {filesystem_of(data_dir)}; {versions()}",
        (f"busy job: {args.events} events ({facts.get('busy_events_bytes', 0) / 1024:.0f} KiB events.jsonl), "
         f"{args.metrics} metrics lines; jobs in the ledger at the end: {facts.get('jobs_in_ledger')}"),
        "",
        (f"{'call':<26}{'requests':>9}{'errors':>7}{'req/s':>8}{'p50 ms':>8}{'p90 ms':>8}{'p99 ms':>8}"
         f"{'max ms':>8}{'srv cpu':>8}{'of it sys':>10}{'cli cpu':>8}{'srv ms/req':>11}"),
    ]
    for p in phases:
        lines.append(f"{p.name:<26}{p.n:>9}{p.errors:>7}{p.n / p.wall_s:>8.0f}{p.pct_ms(50):>8.1f}"
                     f"{p.pct_ms(90):>8.1f}{p.pct_ms(99):>8.1f}{p.pct_ms(100):>8.1f}"
                     f"{100 * p.server_cpu_s / p.wall_s:>7.0f}%{100 * p.server_sys_s / p.wall_s:>9.0f}%"
                     f"{100 * p.client_cpu_s / p.wall_s:>7.0f}%"
                     f"{1000 * p.server_cpu_s / p.n:>11.2f}")
    lines.append("srv cpu / cli cpu: CPU time of the server process (all threads) / of this client over the "
                 "phase, in % of one core (of it sys: the server's time in the kernel: fsync, file reads, "
                 "sockets); srv ms/req: server CPU time per request")
    for p in phases:
        if p.errors:
            lines.append(f"{p.name}: statuses {dict(sorted(p.statuses.items()))}")
            lines.extend(f"  {s}" for s in p.error_samples)
    if parts:
        lines += ["", f"in-process, serial (no HTTP, no concurrency), {args.parts} calls each:",
                  f"{'part':<56}{'median ms':>10}{'p90 ms':>8}"]
        lines.extend(f"{label:<56}{med:>10.3f}{p90:>8.3f}" for label, med, p90 in parts)
    errors = sum(p.errors for p in phases)
    lines += ["", f"errors: {errors}" + ("" if errors else " (all requests answered 2xx)")]
    return "\n".join(lines) + "\n"


def as_data(args, phases: list[Phase], facts: dict[str, Any], parts, load_before, load_after) -> dict:
    """The table's figures as JSON (bench/results/api_latency.json)."""
    return {
        "bench": "api_latency",
        "quick": False,
        "host": host(load_before, load_after, packages=("fastapi", "uvicorn", "sqlalchemy", "pydantic")),
        "load": {"concurrency": args.concurrency, "warmup": args.warmup, "requests": args.requests,
                 "events": args.events, "metrics": args.metrics},
        "facts": facts,
        "rows": [{"call": p.name, "requests": p.n, "errors": p.errors,
                  "req_per_s": p.n / p.wall_s if p.wall_s else None,
                  **{f"p{q}_ms": p.pct_ms(q) for q in (50, 90, 99)}, "max_ms": p.pct_ms(100),
                  "server_cpu_pct": 100 * p.server_cpu_s / p.wall_s if p.wall_s else None,
                  "server_sys_pct": 100 * p.server_sys_s / p.wall_s if p.wall_s else None,
                  "client_cpu_pct": 100 * p.client_cpu_s / p.wall_s if p.wall_s else None,
                  "server_ms_per_request": 1000 * p.server_cpu_s / p.n if p.n else None} for p in phases],
        "parts": [{"part": label, "median_ms": med, "p90_ms": p90} for label, med, p90 in parts],
    }


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/api_latency.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="timed requests per call")
    p.add_argument("--warmup", type=int, default=200, help="untimed requests per call, first")
    p.add_argument("--concurrency", type=int, default=50, help="concurrent clients (tasks, connections)")
    p.add_argument("--events", type=int, default=2000,
                   help="events.jsonl records of the busy job (0: skip that call); 2000 is a 100k-step job "
                        "checkpointing every 50 steps")
    p.add_argument("--metrics", type=int, default=20000, help="metrics.jsonl lines of the busy job")
    p.add_argument("--parts", type=int, default=200, help="calls per part in the in-process breakdown (0: skip)")
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds before a request counts as failed")
    p.add_argument("--workdir", help="parent of the temp data dir (None: the system temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the data dir (and the server log)")
    p.add_argument("--out", default=RESULTS, help="where the table is written")
    p.add_argument("--serve", nargs=2, metavar=("DATA_DIR", "PORT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return args
    for name in ("requests", "concurrency"):
        if not 1 <= getattr(args, name) <= 1_000_000:
            p.error(f"--{name} must be within 1..1000000")
    for name in ("warmup", "events", "metrics", "parts"):
        if not 0 <= getattr(args, name) <= 1_000_000:
            p.error(f"--{name} must be within 0..1000000")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return 0
    workdir = tempfile.mkdtemp(prefix="etrain-bench-api-", dir=args.workdir)
    data_dir = os.path.join(workdir, "data")
    token = uuid.uuid4().hex
    load_before = list(os.getloadavg())
    server = None
    failed = True
    try:
        log(f"data dir {data_dir}; starting the server")
        server = start_server(data_dir, token, os.path.join(workdir, "server.log"))
        log(f"server pid {server.proc.pid} on {server.url}")
        phases, facts = asyncio.run(load(server, token, args, os.path.join(data_dir, "runs")))
        server.stop()
        if server.proc.returncode not in (0, -signal.SIGTERM):
            log(f"server exited with {server.proc.returncode}:\n{server.log_tail()}")
        parts = []
        if args.parts:
            log(f"in-process breakdown, {args.parts} calls per part")
            parts = breakdown(args.parts, args.events or 2000, args.metrics)
        load_after = list(os.getloadavg())
        text = report(args, phases, facts, parts, load_before, load_after, workdir)
        print(text, end="", flush=True)
        write_results(text, os.path.abspath(args.out))
        log(f"written to {os.path.relpath(os.path.abspath(args.out), os.getcwd())}")
        path = write_json(as_data(args, phases, facts, parts, load_before, load_after), os.path.abspath(args.out))
        log(f"JSON written to {os.path.relpath(path, os.getcwd())}")
        failed = any(p.errors for p in phases)
        return 1 if failed else 0
    except RuntimeError as e:  # the server would not start, or the setup requests failed
        log(str(e))
        return 2
    except Exception:  # noqa: BLE001  (anything else: say what, then stop the server below)
        traceback.print_exc()
        return 2
    finally:
        if server is not None:
            server.stop()
        if args.keep or (failed and server is not None):
            log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
