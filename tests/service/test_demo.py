"""`etrain demo` end to end: embedded Ray head + API, a job, a worker killed, a recovery,
and the API token in no file but its own."""

import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT, free_port

pytestmark = pytest.mark.ray


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_demo_runs_end_to_end(tmp_path):
    ports = {"--port": free_port(), "--ray-port": free_port(), "--dashboard-port": free_port()}
    args = [a for k, v in ports.items() for a in (k, str(v))]
    done = subprocess.run([sys.executable, "-m", "service.cli", "demo", "--data-dir", str(tmp_path), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "SUCCEEDED" in out and "validation accuracy" in out
    assert "recovered: rank 1 failed" in out
    restarts = next(line for line in out.splitlines() if "restarts" in line and "│" in line)
    assert restarts.split("│")[2].strip() == "1", restarts
    # The stack it started is gone: API, GCS and dashboard ports closed.
    assert not any(listening(p) for p in ports.values()), ports
    # The API token is in its file and nowhere else in the data directory: not in
    # serve.log (serve's output), the Ray logs, the run directories or the ledger.
    token = (tmp_path / "token").read_text().strip()
    assert len(token) >= 32
    holders = [str(path) for path in tmp_path.rglob("*")
               if path.is_file() and path.name != "token" and token.encode() in path.read_bytes()]
    assert holders == [], f"the API token was written to {holders}"
    assert "serve.log" in {p.name for p in tmp_path.iterdir()}  # the log it would have leaked into
