"""`ray job submit ... -- python -m workers.run SPEC` against a head with token auth on."""

import os
import shutil
import subprocess

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import ROOT, last_json_line, recovery_spec, write_spec
from workers import events

pytestmark = pytest.mark.ray


def test_ray_job_submit_runs_the_same_entrypoint(ray_cluster, tmp_path):
    spec = {**recovery_spec("via-job-submit"), "storage": str(tmp_path / "runs")}
    spec["training"]["max_steps"] = 10
    path = write_spec(tmp_path, spec)
    ray = shutil.which("ray", path=ray_cluster.env["PATH"])
    env = {k: v for k, v in ray_cluster.env.items() if k != "RAY_ADDRESS"}
    submit = [ray, "job", "submit", "--address", ray_cluster.dashboard, "--working-dir", ".",
              "--", "python", "-m", "workers.run", str(path)]

    # Token auth is on: a client without the token is turned away.
    no_token = {**env, "RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing-token"), "HOME": str(tmp_path)}
    refused = subprocess.run([ray, "job", "list", "--address", ray_cluster.dashboard], env=no_token,
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    assert "token" in (refused.stdout + refused.stderr).lower()

    done = subprocess.run(submit, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    summary = last_json_line(done.stdout)
    assert summary and summary["status"] == "succeeded" and summary["final_step"] == 10
    assert os.path.exists(os.path.join(summary["run_dir"], "checkpoints", "LATEST"))
    # The driver wrote TensorBoard's event files as it went: one loss point per logged step.
    board = EventAccumulator(os.path.join(summary["run_dir"], "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()
    assert [p.step for p in board.Scalars("loss")] == sorted({m["step"] for m in events.metrics(summary["run_dir"])})
