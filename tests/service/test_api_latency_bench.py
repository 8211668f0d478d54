"""bench/api_latency.py itself, at the smallest load: both ledgers (a real uvicorn, a
real PostgreSQL it starts), every call answered, the bare baseline beside each view,
and the table and JSON written. The figures are the bench's to print, not this test's."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

CALLS = {"POST /v1/jobs", "GET /bench/bare", "GET /bench/bare-mw", "GET /v1/jobs/{id}", "GET /v1/jobs/{id} busy",
         "GET /v1/jobs"}


def test_the_api_bench_runs_on_both_ledgers_against_the_bare_route(tmp_path):
    out = tmp_path / "api_latency.txt"
    proc = subprocess.run([sys.executable, "bench/api_latency.py", "--ledger", "both", "--requests", "30",
                           "--warmup", "5", "--concurrency", "4", "--rounds", "2", "--events", "20",
                           "--metrics", "50", "--parts", "3", "--pg-fsync", "off", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["ledger"], r["call"]): r for r in data["rows"]}
    assert set(rows) == {(ledger, call) for ledger in ("sqlite", "postgresql") for call in CALLS}
    assert all(r["requests"] == 30 and r["errors"] == 0 for r in rows.values()), rows
    assert all(rows[(ledger, "GET /bench/bare")]["p99_vs_bare"] == 1.0 for ledger in ("sqlite", "postgresql"))
    assert data["ledgers"]["postgresql"]["db"].startswith("PostgreSQL ")
    assert {"get_p99_vs_bare", "post_per_s", "post_met"} <= set(data["goal"]["postgresql"])
    table = out.read_text()
    assert "against the bare route" in table and "goal (issue 13, 4 clients)" in table and "errors: 0" in table
