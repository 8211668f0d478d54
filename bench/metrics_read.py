"""GET /v1/jobs/{id}/metrics?since_step=N on a long job's run record: the seek (what the
service does, workers/metrics_read.py) side by side with the whole-file scan it replaced.

    python bench/metrics_read.py [--lines 300000] [--requests 50]

One job, made through the service's own app (create_app, a SQLite ledger in a temp dir,
FakeGateway: Ray is not involved), whose run directory then gets --lines metrics lines in
three attempts (each resumed from a checkpoint before where the previous one stopped, so
steps repeat across attempts, as after real failures). Each request goes through the ASGI
app in this process (auth, the ledger read, the metrics read, the JSON answer), so its
time is the server's plus the in-process client's small share. The baseline is the same
route with the service's read swapped for the scan it replaced (every line parsed, then
filtered), in the same run. Also printed: the bytes each read took from the file.

Timings are reported, never asserted. The table goes to bench/results/metrics_read.txt,
the same figures as JSON next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime

from common import host, write_json, write_results  # bench/ is sys.path[0] when run as a script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

RESULTS = os.path.join(ROOT, "bench", "results", "metrics_read.txt")
TOKEN = "bench-token"


def seed_metrics(path: str, lines: int) -> list[tuple[int, int]]:
    """Three attempts: the second resumes a fifteenth of an attempt behind the first's end
    (20,000 steps of 300,000 lines), the third a thirtieth behind the second's. Returns each
    attempt's (first step, last step)."""
    a = lines // 3
    first2 = a - a // 15 + 1
    first3 = first2 + a - 1 - a // 30 + 1
    spans = [(1, a), (first2, first2 + a - 1), (first3, first3 + lines - 2 * a - 1)]
    now = time.time()
    with open(path, "w") as f:
        for attempt, (first, last) in enumerate(spans, 1):
            f.writelines(json.dumps({"time": now, "step": s, "epoch": s // 128, "loss": 0.5, "lr": 0.001,
                                     "samples_per_s": 6800.0, "step_s": 0.0094, "attempt": attempt},
                                    separators=(",", ":")) + "\n" for s in range(first, last + 1))
    return spans


def scan(rd: str, since_step: int = 0, limit: int = 10_000) -> list[dict]:
    """The read the service did before: every line parsed, then filtered."""
    from workers import events

    return [m for m in events.metrics(rd) if m.get("step", 0) > since_step][:limit]


def timed(client, url: str, n: int) -> tuple[list[float], int]:
    times, count = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.get(url)
        times.append((time.perf_counter() - t0) * 1000)
        r.raise_for_status()
        count = r.json()["count"]
    return times, count


def bytes_read(path: str, since_step: int, limit: int) -> int:
    from workers import metrics_read

    with open(path, "rb") as raw:
        f = metrics_read.MetricsFile(raw)
        metrics_read.after_step(f, since_step, limit)
        return f.bytes_read


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=300_000)
    p.add_argument("--requests", type=int, default=50, help="timed requests per case (the scan gets a fifth)")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args()

    from fastapi.testclient import TestClient

    from api.app import create_app
    from service import rundir
    from service.settings import Settings
    from tests.fakes import FakeGateway
    from workers import events

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="etrain-bench-metrics-") as data_dir:
        settings = Settings(data_dir=data_dir, token=TOKEN)
        app = create_app(settings, FakeGateway(), reconcile=False)
        with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
            job = client.post("/v1/jobs", json={"model": "simple_cnn", "dataset": "synthetic"}).json()["id"]
            path = os.path.join(rundir.run_dir(settings.runs_dir, job), events.METRICS)
            spans = seed_metrics(path, args.lines)
            size = os.path.getsize(path)
            last = spans[-1][1]
            cases = [("newest 10 steps", last - 10, 10_000), ("a step in attempt 2", spans[1][1] - 5_000, 10_000),
                     ("from the start, one page", 0, 10_000)]
            rows = []
            for label, since, limit in cases:
                url = f"/v1/jobs/{job}/metrics?since_step={since}&limit={limit}"
                timed(client, url, 3)  # warm: imports, the ledger's connection
                seek_ms, count = timed(client, url, args.requests)
                original, rundir.metrics_since = rundir.metrics_since, scan
                try:
                    scan_ms, scan_count = timed(client, url, max(3, args.requests // 5))
                finally:
                    rundir.metrics_since = original
                if scan_count != count:
                    print(f"[bench] {label}: the seek returned {count} lines, the scan {scan_count}", file=sys.stderr)
                    return 1
                rows.append({"case": label, "since_step": since, "lines_returned": count,
                             "seek_ms_p50": statistics.median(seek_ms), "seek_ms_max": max(seek_ms),
                             "scan_ms_p50": statistics.median(scan_ms), "scan_ms_max": max(scan_ms),
                             "seek_bytes_read": bytes_read(path, since, limit), "file_bytes": size})
    load_after = os.getloadavg()

    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    head = (f"GET /v1/jobs/{{id}}/metrics?since_step=N, {args.lines:,} metrics lines in 3 attempts "
            f"({size / 1e6:.1f} MB), {when}\n"
            f"in-process ASGI requests (server time plus the in-process client's); load "
            f"{load_before[0]:.2f} before, {load_after[0]:.2f} after\n\n")
    table = (f"{'case':<26}{'since_step':>11}{'lines':>7}{'seek p50 ms':>13}{'seek max':>10}"
             f"{'scan p50 ms':>13}{'scan max':>10}{'scan/seek':>11}{'seek read':>12}\n")
    for r in rows:
        table += (f"{r['case']:<26}{r['since_step']:>11}{r['lines_returned']:>7}{r['seek_ms_p50']:>13.2f}"
                  f"{r['seek_ms_max']:>10.2f}{r['scan_ms_p50']:>13.1f}{r['scan_ms_max']:>10.1f}"
                  f"{r['scan_ms_p50'] / r['seek_ms_p50']:>10.0f}x{r['seek_bytes_read'] / 1e3:>9.0f} kB\n")
    text = head + table
    print("\n" + text, end="")
    write_results(text, args.out)
    write_json({"bench": "metrics_read", "when": when, "host": host(load_before, load_after, ("fastapi",)),
                "lines": args.lines, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
