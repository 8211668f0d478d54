"""`etrain tensorboard`: a clear line for a job that is not there, and a real TensorBoard
serving a run directory's event files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
from typer.testing import CliRunner

from service.cli import app as cli
from tests.conftest import ROOT, free_port
from workers import events, segments
from workers.tensorboard import BoardWriter


def test_a_missing_job_is_one_error_line(tmp_path):
    result = CliRunner().invoke(cli, ["tensorboard", "job-nope", "--logdir", str(tmp_path)])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [f"error: no job 'job-nope' in {tmp_path} (see `etrain list`, or set --logdir to the job's "
                     "storage)"]
    result = CliRunner().invoke(cli, ["tensorboard", "--logdir", str(tmp_path / "absent")])
    assert result.exit_code == 1 and "error: no run directories at" in result.output
    assert "Traceback" not in result.output


def serve_and_read_tags(logdir: str, job: str) -> dict:
    """`etrain tensorboard JOB --logdir LOGDIR` for real: the scalar tags it serves."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "tensorboard", job, "--logdir", logdir,
                             "--port", str(port)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    try:
        deadline, tags = time.time() + 60, None
        while time.time() < deadline and proc.poll() is None:
            try:
                runs = httpx.get(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=2)
                if runs.status_code == 200 and runs.json():
                    tags = runs.json()
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        assert tags is not None, proc.stdout.read() if proc.poll() is not None else "no answer"
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # its own session: the CLI and the TensorBoard it started
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert f"http://127.0.0.1:{port}/" in proc.stdout.read()
    return tags


def test_it_serves_a_jobs_scalars(tmp_path):
    run_dir = tmp_path / "job-tb"
    os.makedirs(run_dir)
    for step in (1, 2, 3):
        events.log_metrics(str(run_dir), step=step, loss=1.0 / step, lr=0.1, samples_per_s=10.0)
    BoardWriter(str(run_dir)).close()
    tags = serve_and_read_tags(str(tmp_path), "job-tb")
    assert {"loss", "lr", "samples_per_s"} <= set(next(iter(tags.values())))


def test_it_serves_a_jobs_scalars_from_object_storage(s3_bucket, tmp_path):
    """Storage on S3 (the server's endpoint and keys in the environment, as a user's are)."""
    run_dir = f"{s3_bucket}/job-tb"
    for step in (1, 2, 3):
        events.log_metrics(run_dir, step=step, loss=1.0 / step, lr=0.1, samples_per_s=10.0)
    segments.flush()
    BoardWriter(run_dir, spool=str(tmp_path)).close()
    tags = serve_and_read_tags(s3_bucket, "job-tb")
    assert {"loss", "lr", "samples_per_s"} <= set(next(iter(tags.values())))
    result = CliRunner().invoke(cli, ["tensorboard", "job-nope", "--logdir", s3_bucket])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"error: no job 'job-nope' in {s3_bucket}" in result.output
