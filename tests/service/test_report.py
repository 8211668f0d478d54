"""`etrain report`: the HTML page and its PNGs, from the committed bench results and from a
real (quick) bench run."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from service.cli import app as cli
from service.report import FIGURES
from tests.conftest import ROOT

RESULTS = ROOT / "bench" / "results"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# A vs_torchrun.json as the bench writes it, cut to what the recovery figure reads: that
# bench needs Ray and minutes, too slow to run here.
RECOVERY = {
    "bench": "vs_torchrun", "quick": False,
    "host": {"hostname": "test", "cores": 2, "cpu": "test cpu", "python": "3.11", "versions": {"ray": "x"},
             "load_avg_before": [0.5], "load_avg_after": [1.5], "utc": "2026-01-02T03:04:05Z"},
    "job": {"crash_step": 170, "checkpoint_every": 50},
    "systems": {s: {"recovery": [{"mode": "exact", "recovery_s": t, "lost_steps": 19}]}
                for s, t in (("ray", 12.3), ("torchrun", 7.0))},
}


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, after checking it is a PNG of plausible size."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR", f"{path.name}: no IHDR chunk first"
    assert len(data) > 5_000, f"{path.name} is only {len(data)} bytes"
    width, height = struct.unpack(">II", data[16:24])
    assert 300 <= width <= 4000 and 200 <= height <= 4000, f"{path.name} is {width}x{height}"
    return width, height


def check_page(out: Path, expected: list[str]) -> str:
    page = (out / "report.html").read_text()
    referenced = re.findall(r'<img src="([^"]+)"', page)
    assert sorted(referenced) == sorted(expected)
    for name in expected:
        png_size(out / name)
    return page


def run_report(results: Path, out: Path):
    result = CliRunner().invoke(cli, ["report", "--results", str(results), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(out / "report.html")
    return result


def test_report_from_the_committed_results(tmp_path):
    """Out of the box: every figure drawn from bench/results/*.json."""
    results = tmp_path / "results"
    results.mkdir()
    for path in RESULTS.glob("*.json"):
        shutil.copy(path, results)
    if not (results / "vs_torchrun.json").exists():
        (results / "vs_torchrun.json").write_text(json.dumps(RECOVERY))
    run_report(results, tmp_path / "out")
    page = check_page(tmp_path / "out", [f.file for f in FIGURES])
    assert "not measured" not in page
    assert "measured on" in page


def test_report_from_a_quick_bench_run(tmp_path):
    """The real bench, smallest quick run (ddp on 1 and 2 workers: two torchrun jobs, no Ray):
    the figures its rows support are drawn, the rest are listed as not measured."""
    results = tmp_path / "results"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "bench/parallel_gpt.py", "--quick", "--workers", "1", "2",
                           "--strategies", "ddp", "--out", str(results / "parallel_gpt.quick.txt")],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((results / "parallel_gpt.quick.json").read_text())
    assert data["quick"] and data["host"]["utc"] and data["host"]["cores"]
    assert {(r["config"], r["workers"]) for r in data["rows"]} == {("ddp", 1), ("ddp", 2)}
    (results / "vs_torchrun.json").write_text(json.dumps(RECOVERY))
    run_report(results, tmp_path / "out")
    drawn = ["speedup.png", "comm_share.png", "recovery.png"]
    page = check_page(tmp_path / "out", drawn)
    for f in FIGURES:
        if f.file not in drawn:
            assert not (tmp_path / "out" / f.file).exists()
            assert f"{f.title}</h2>\n<p><strong>not measured in this run</strong>" in page
    print(f"bench and report took {time.monotonic() - started:.0f}s")


def test_no_results_is_one_line_and_exit_2(tmp_path):
    for results in (tmp_path / "missing", tmp_path):  # no directory; a directory without JSON
        result = CliRunner().invoke(cli, ["report", "--results", str(results), "--out", str(tmp_path / "out")])
        assert result.exit_code == 2, result.output
        assert result.output.startswith("error:") and result.output.count("\n") == 1, result.output
        assert not (tmp_path / "out" / "report.html").exists()
