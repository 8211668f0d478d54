"""`etrain demo`: the whole product in one command, on one machine, offline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from workers.events import Kind

ROOT = Path(__file__).resolve().parents[1]
MNIST = ROOT.parent / "shared" / "data" / "mnist" / "raw"


def demo_spec() -> tuple[dict, str | None]:
    spec = {
        "model": "simple_cnn", "workers": 2,
        # 8 epochs (1,000 steps): a kill through the API takes a few seconds (a small Ray job
        # on the worker's node), and on an idle machine 3 epochs ended before it landed.
        "training": {"epochs": 8, "global_batch_size": 64, "optimizer": "adam", "lr": 0.001, "seed": 0},
        "checkpoint": {"every_steps": 50, "keep": 3},
        "failure": {"max_failures": 3, "collective_timeout_s": 15},
    }
    images, labels = MNIST / "t10k-images-idx3-ubyte.gz", MNIST / "t10k-labels-idx1-ubyte.gz"
    if images.exists() and labels.exists():
        spec["dataset"] = {"name": "idx", "images": str(images), "labels": str(labels), "val_fraction": 0.2}
        return spec, None
    spec["dataset"] = {"name": "synthetic", "size": 10000, "noise": 2.0}
    return spec, f"notice: {MNIST} not found; training on the synthetic dataset instead"


class DemoError(RuntimeError):
    """The demo could not run; the message is one line."""


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise DemoError(f"the local service did not start: {_serve_cause(log)} (full output in {log})")
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise DemoError(f"the API at {url} was not ready after {timeout:.0f}s (output in {log})")


def _serve_cause(log: Path) -> str:
    """`etrain serve` says why it stopped in its last `error:` line; else the log's cause."""
    from service.embedded import log_cause

    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    said = next((line for line in reversed(lines) if line.startswith("error: ")), None)
    return said[len("error: "):] if said else (log_cause(str(log)) or "it exited without saying why")


def run_demo(*, data_dir: Path | None, port: int, ray_port: int, dashboard_port: int, kill_at_step: int,
             console: Console) -> int:
    from service.cli import _client, _request, watch_job

    data_dir = Path(data_dir or tempfile.mkdtemp(prefix="etrain-demo-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    for name in ("RAY_ADDRESS", "ETRAIN_RAY_ADDRESS", "ETRAIN_TOKEN"):  # the demo's own stack, its own token
        env.pop(name, None)
    console.print(f"[bold]1.[/bold] starting Ray and the API (data in {data_dir}) ...")
    log = data_dir / "serve.log"
    with open(log, "ab") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--data-dir", str(data_dir), "--port", str(port),
             "--ray-port", str(ray_port), "--dashboard-port", str(dashboard_port), "--num-cpus", "4",
             "--dataset-root", str(MNIST)],
            env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        _wait_ready(url, server, log)
        spec, notice = demo_spec()
        if notice:
            console.print(notice)
        # The token of the stack just started, even where ETRAIN_TOKEN names another one.
        with _client(url, token=(data_dir / "token").read_text().strip()) as client:
            job = _request(client, "POST", "/v1/jobs", json=spec, headers={"Idempotency-Key": f"demo-{time.time()}"})
            console.print(f"[bold]2.[/bold] submitted job {job['id']}; Ray job {job['submission_id']}")
            console.print(f"[bold]3.[/bold] training; a worker is killed through the API after step {kill_at_step}")
            killed = {}

            def chaos(j: dict) -> None:
                training = j["progress"].get("phase") == "training"  # its workers are up: one can be killed
                if not killed and training and (j["progress"].get("step") or 0) >= kill_at_step:
                    killed.update(_request(client, "POST", f"/v1/jobs/{j['id']}/faults", json={"rank": 1}))

            job = watch_job(client, job["id"], on_tick=chaos)
            if killed:
                console.print(f"killed rank {killed['rank']} (pid {killed['pid']}) through Ray")
            events = [e for e in _request(client, "GET", f"/v1/jobs/{job['id']}/events")["data"] if e["event"] == Kind.RESUMED]
        result = job.get("result") or {}
        table = Table(title=f"job {job['id']}: {job['state']}", show_header=False)
        table.add_row("validation accuracy", f"{result.get('val_accuracy', float('nan')):.4f}")
        table.add_row("restarts", str(job["restarts"]))
        table.add_row("steps recomputed", str(job["steps_recomputed"]))
        table.add_row("recovery seconds", ", ".join(f"{e['recovery_s']:.1f}" for e in events) or "-")
        table.add_row("weights sha256", result.get("weights_sha256", "-"))
        table.add_row("Ray dashboard", job.get("dashboard_url") or "-")
        console.print(table)
        return 0 if job["state"] == "SUCCEEDED" else 1
    finally:
        if server.poll() is None:
            console.print("[bold]4.[/bold] stopping the API and Ray ...")
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
