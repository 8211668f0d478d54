"""A real `etrain serve` (uvicorn) against the session's real Ray cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, free_port

TOKEN = "test-token-0123456789"


@dataclass
class Api:
    url: str
    data_dir: Path
    proc: subprocess.Popen
    env: dict

    def client(self) -> httpx.Client:
        # Idle connections dropped well before uvicorn closes them (after 5 s): a request sent
        # on one as the server closes it fails with "Server disconnected", no answer.
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60,
                            limits=httpx.Limits(keepalive_expiry=1.0))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


def ready(url: str) -> bool:
    """Whether the API at `url` answers /readyz with 200 (ledger and Ray up)."""
    try:
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def start_api(cluster, data_dir: Path, port: int | None = None, env: dict[str, str] | None = None) -> Api:
    """`env`: more settings, e.g. DATABASE_URL for replicas sharing one PostgreSQL ledger."""
    port = port or free_port()
    env = {**cluster.env, "ETRAIN_TOKEN": TOKEN, "ETRAIN_DASHBOARD_URL": cluster.dashboard,
           "ETRAIN_RECONCILE_INTERVAL_S": "0.3", "ETRAIN_PYTHON": sys.executable, **(env or {})}
    log = open(data_dir / f"api-{port}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--data-dir", str(data_dir), "--port",
                             str(port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    api = Api(f"http://127.0.0.1:{port}", data_dir, proc, env)
    deadline = time.time() + 120
    while time.time() < deadline:
        assert proc.poll() is None, (data_dir / f"api-{port}.log").read_text()[-3000:]
        if ready(api.url):
            return api
        time.sleep(0.5)
    stop_api(api)
    pytest.fail("the API did not become ready")


def terminate(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if it is still there after `timeout`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_api(api: Api) -> None:
    terminate(api.proc, 30)


@pytest.fixture
def app(settings, gateway):
    """The app on the module's own `settings` and fake `gateway` fixtures, reconciler off."""
    from api.app import create_app

    return create_app(settings, gateway, reconcile=False)


@pytest.fixture
def client(app):
    from fastapi.testclient import TestClient

    with TestClient(app, headers={"Authorization": f"Bearer {app.state.settings.token}"}) as c:
        yield c


@pytest.fixture
def api(ray_cluster, tmp_path):
    a = start_api(ray_cluster, tmp_path)
    try:
        yield a
    finally:
        stop_api(a)


def small_job(job_id: str, steps: int = 40, size: int = 2048) -> dict:
    return {
        "job_id": job_id, "model": "simple_cnn", "workers": 2,
        "dataset": {"name": "synthetic", "size": size, "noise": 2.0},
        "training": {"max_steps": steps, "global_batch_size": 64, "seed": 3},
        "checkpoint": {"every_steps": 10},
        "failure": {"max_failures": 3, "collective_timeout_s": 8},
    }


def wait_for(client: httpx.Client, job_id: str, states: set[str], timeout: float = 240, seen: list | None = None,
             until=None) -> dict:
    """Poll a job until its state is in `states` (or `until(job)`), recording every state seen."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if seen is not None and (not seen or seen[-1] != job["state"]):
            seen.append(job["state"])
        if job["state"] in states or (until and until(job)):
            return job
        time.sleep(0.15)
    pytest.fail(f"job {job_id} not in {states} after {timeout}s; states seen {seen}, last {job}")


# ---------------------------------------------------------------- `etrain serve` with its own Ray head


@dataclass
class Serve:
    """`etrain serve` in a subprocess, starting (and on SIGTERM stopping) its own Ray head."""

    url: str
    proc: subprocess.Popen
    log: Path
    env: dict
    head_pgid: int | None = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def children(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def start_serve(args: list[str], env: dict, log: Path, timeout: float = 240) -> Serve:
    """Start it and wait until /readyz says the ledger and Ray are up. Stop it with
    stop_serve() in a finally, even when this fails."""
    port = free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--ray-port",
                                 str(free_port()), "--dashboard-port", str(free_port()), *args],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    serve = Serve(f"http://127.0.0.1:{port}", proc, log, env)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            if serve.head_pgid is None:
                serve.head_pgid = next((p for p in children(proc.pid) if _is_ray_start(p)), None)
            if proc.poll() is not None:
                pytest.fail(f"`etrain serve` exited with code {proc.returncode}:\n{serve.output()[-3000:]}")
            if ready(serve.url):
                return serve
            time.sleep(0.5)
        pytest.fail(f"`etrain serve` was not ready after {timeout:.0f}s:\n{serve.output()[-3000:]}")
    except BaseException:
        stop_serve(serve)
        raise


def _is_ray_start(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return any(a.endswith(b"ray") for a in argv[:2]) and b"start" in argv and b"--head" in argv


def stop_serve(serve: Serve) -> None:
    """SIGTERM: serve stops its Ray head, then itself. Whatever is left of the head's
    process group after that (serve killed hard) is ended here."""
    terminate(serve.proc, 60)
    if serve.head_pgid is not None:
        try:
            os.killpg(serve.head_pgid, 0)  # still there: serve could not stop it
            os.killpg(serve.head_pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
