"""`etrain serve` on a machine that never ran Ray: an empty HOME, no Ray token anywhere.
It makes the token (owner-only), starts its head with it, and a job runs to the end; the
service's secrets reach neither the head nor any process it starts."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.service.conftest import children, start_serve, stop_serve

pytestmark = pytest.mark.ray

TINY = {"job_id": "first-job", "model": "simple_cnn", "dataset": {"name": "synthetic", "size": 256}, "workers": 1,
        "training": {"max_steps": 5, "global_batch_size": 32}}


def environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:  # ended meanwhile
        return b""


def test_serve_with_an_empty_home_makes_the_token_and_runs_a_job(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "ETRAIN_")) and k not in ("XDG_CACHE_HOME", "DATABASE_URL")}
    env["HOME"] = str(home)
    # Secrets of the service, to look for in every process its Ray head starts.
    ledger_secret = f"sqlite:///{tmp_path}/ledger-secret-7f3a.db"
    env.update({"ETRAIN_DATABASE_URL": ledger_secret, "DATABASE_URL": "postgresql://etrain:pw-9c1e@nowhere/x"})
    serve = start_serve(["--num-cpus", "2"], env, tmp_path / "serve.log")
    try:
        token = home / ".ray" / "auth_token"
        assert token.exists() and stat.S_IMODE(token.stat().st_mode) == 0o600
        assert stat.S_IMODE(token.parent.stat().st_mode) & 0o077 == 0

        spec = tmp_path / "tiny.json"
        spec.write_text(json.dumps(TINY))
        # The CLI finds the API token where serve wrote it: under the same (empty) HOME.
        done = subprocess.run([sys.executable, "-m", "service.cli", "submit", str(spec), "--watch", "--url", serve.url],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + serve.output()[-3000:]
        assert "SUCCEEDED" in done.stdout

        api_token = (home / ".cache" / "elastic-train" / "token").read_text().strip()
        assert api_token not in serve.output()  # its output is a log file here, not a terminal
        assert str(home / ".cache" / "elastic-train" / "token") in serve.output()

        head = children(serve.proc.pid)
        assert head, "no Ray processes under `etrain serve`"
        leaked = [pid for pid in head if any(s in environ(pid) for s in (b"ledger-secret-7f3a", b"pw-9c1e"))]
        assert leaked == [], f"the service's secrets are in the environment of Ray processes {leaked}"
    finally:
        stop_serve(serve)
    assert serve.proc.returncode == 0, serve.output()[-3000:]
