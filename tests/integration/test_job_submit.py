"""`ray job submit ... -- python -m workers.run SPEC` against a head with token auth on."""

import json
import os
import shutil
import subprocess

import pytest
from mlflow.tracking import MlflowClient
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
    # MLflow the way a user asks for it through Ray: the tracking URI in the job's environment.
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    submit = [ray, "job", "submit", "--address", ray_cluster.dashboard, "--working-dir", ".",
              "--runtime-env-json", json.dumps({"env_vars": {"MLFLOW_TRACKING_URI": tracking}}),
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
    # And logged them to MLflow: a run named after the job, the spec as params, ended FINISHED.
    client = MlflowClient(tracking_uri=tracking)
    (run,) = client.search_runs([client.get_experiment_by_name("elastic-train").experiment_id])
    assert run.info.run_name == "via-job-submit" and run.info.status == "FINISHED"
    assert run.data.params["training.max_steps"] == "10" and run.data.params["workers"] == "2"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [
        p.step for p in board.Scalars("loss")]
