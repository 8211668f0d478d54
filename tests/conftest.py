"""Shared fixtures: a real local Ray cluster (head started with `ray start`, token
auth on, bound to 127.0.0.1) and a helper that runs `python -m workers.run`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers.s3 import s3_bucket, s3_server  # noqa: F401  (fixtures: one S3 server per session)
from workers import ray_token  # noqa: E402

# Before Ray is imported (it reads RAY_AUTH_MODE once): the test process is a client of
# a token-auth cluster, and on a machine that never ran Ray the token is made here.
ray_token.ensure()

ROOT = Path(__file__).resolve().parents[1]
MNIST = ROOT.parent / "shared" / "data" / "mnist" / "raw"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    address: str
    dashboard: str
    env: dict[str, str]


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One head node for the whole session, the same way `etrain serve` starts one:
    `ray start --head --block` in its own process group, stopped by stopping the group
    (never `ray stop`, which would end every Ray on the machine). 8 logical CPUs on 2
    cores, since every worker runs one thread."""
    from service.embedded import EmbeddedRay

    log = tmp_path_factory.mktemp("ray") / "head.log"
    env = {"RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    for tries_left in (2, 1, 0):
        # A free port may be taken again before the head binds it (Ray's own workers
        # pick ports too): try fresh ones rather than fail the whole session.
        head = EmbeddedRay(gcs_port=free_port(), dashboard_port=free_port(), num_cpus=8, log_path=str(log),
                           extra_env=env)
        try:
            head.start()
            break
        except Exception:
            head.stop()
            if not tries_left:
                raise
    try:
        client_env = {**os.environ, **head.env, "RAY_ADDRESS": head.gcs_address}
        yield Cluster(address=head.gcs_address, dashboard=head.dashboard_url, env=client_env)
    finally:
        head.stop()


@dataclass
class Outcome:
    rc: int
    summary: dict | None
    output: str
    run_dir: Path

    def events(self, kind: str | None = None) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r for r in rows if kind is None or r["event"] == kind]


def last_json_line(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{") and '"job_id"' in line:
            return json.loads(line)
    return None


def write_spec(tmp_path: Path, spec: dict, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec))
    return path


def start_job(cluster: Cluster, spec: dict, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    spec = {"storage": str(tmp_path / "runs"), **spec}
    path = write_spec(tmp_path, spec, f"{spec['job_id']}.yaml")
    proc = subprocess.Popen([sys.executable, "-m", "workers.run", str(path)], cwd=ROOT, env=cluster.env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, Path(spec["storage"]) / spec["job_id"]


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 300) -> Outcome:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"job did not finish in {timeout}s:\n{out[-5000:]}")
    finally:
        if proc.poll() is None:  # interrupted: leave no driver behind
            proc.kill()
            proc.wait()
    return Outcome(proc.returncode, last_json_line(out), out, run_dir)


def wait_while_running(what: str, predicate, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    """Poll `predicate` until it holds; fail, with the driver's log, if the job ends or the
    time runs out first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the job ended (rc {proc.returncode}) while waiting for {what}:\n{log.read_text()[-4000:]}")
        if predicate():
            return
        time.sleep(0.5)
    pytest.fail(f"no {what} within {timeout}s:\n{log.read_text()[-4000:]}")


def run_job(cluster: Cluster, spec: dict, tmp_path: Path, timeout: float = 300) -> Outcome:
    return finish(*start_job(cluster, spec, tmp_path), timeout=timeout)


def recovery_spec(job_id: str, faults: list[dict] | None = None) -> dict:
    """The spec every recovery test shares, so they all compare to one undisturbed twin."""
    return {
        "job_id": job_id,
        "model": "simple_cnn",
        "dataset": {"name": "synthetic", "size": 2048, "noise": 2.0},
        "workers": 2,
        "training": {"max_steps": 40, "global_batch_size": 64, "seed": 7},
        "checkpoint": {"every_steps": 10, "keep": 2},
        "failure": {"max_failures": 4, "collective_timeout_s": 8},
        "faults": faults or [],
    }


@pytest.fixture(scope="session")
def twin(ray_cluster, tmp_path_factory) -> Outcome:
    """The undisturbed run all recovery tests must match bit for bit."""
    outcome = run_job(ray_cluster, recovery_spec("twin"), tmp_path_factory.mktemp("twin"))
    assert outcome.rc == 0, outcome.output[-3000:]
    assert outcome.summary["restarts"] == 0
    return outcome
