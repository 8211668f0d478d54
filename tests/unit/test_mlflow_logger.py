"""workers/mlflow_logger.py against a real MLflow tracking store (SQLite, MLflow's own
client): one point per step across restarts and drivers, the spec as params, recoveries
and the verdict; a server that is not there costs the driver one line, not its run."""

from __future__ import annotations

import importlib.util
import io
import json
import time

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import free_port
from workers import events, mlflow_logger
from workers.console import Reporter
from workers.mlflow_logger import RECOVERIES_TAG, STATE, MlflowLogger
from workers.run import mlflow_view
from workers.spec import JobSpec

SPEC = {"job_id": "job-ml", "model": "simple_cnn", "dataset": {"name": "synthetic", "size": 64}, "workers": 2,
        "training": {"max_steps": 8, "global_batch_size": 16, "seed": 3, "lr": 0.05}}


@pytest.fixture
def tracking(tmp_path, monkeypatch) -> MlflowClient:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setattr(mlflow_logger, "LOG_EVERY_S", 0.05)
    return MlflowClient(tracking_uri=uri)


def row(run_dir: str, step: int, **extra) -> None:
    events.log_metrics(run_dir, step=step, epoch=0, loss=1.0 / step, lr=0.01, samples_per_s=100.0 + step,
                       attempt=1, **extra)


def the_run(client: MlflowClient):
    (run,) = client.search_runs([client.get_experiment_by_name("elastic-train").experiment_id])
    return run


def steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_one_point_per_step_across_restarts_and_drivers_with_the_spec_and_the_verdict(tracking, tmp_path):
    run_dir = str(tmp_path / "job-ml")
    (tmp_path / "job-ml").mkdir()
    for step in range(1, 7):
        row(run_dir, step)
    first = MlflowLogger(run_dir, SPEC)
    events.emit(run_dir, "resumed", failed_rank=1, cause="worker process died", from_step=4, lost_steps=2,
                recovery_s=3.25)
    for step in range(5, 9):  # steps 5 and 6 again, then on
        row(run_dir, step)
    first.close()  # a driver that ends without a verdict (killed, resubmitted): the run stays RUNNING
    run = the_run(tracking)
    assert run.info.run_name == "job-ml" and run.info.status == "RUNNING"

    second = MlflowLogger(run_dir, SPEC)  # the service starts the driver again
    row(run_dir, 9, val_loss=0.25, val_metrics={"accuracy": 0.9, "top-5 (%)": 100.0}, val_accuracy=0.9)
    events.emit(run_dir, "finished", final_step=9, loss=0.1, val_loss=0.25, val_accuracy=0.9)
    second.close()

    run = the_run(tracking)  # still one run
    assert run.info.status == "FINISHED"
    assert steps(tracking, run.info.run_id, "loss") == list(range(1, 10))
    assert [(m.step, m.value) for m in tracking.get_metric_history(run.info.run_id, "loss")
            if m.step == 5] == [(5, 0.2)]  # the first record of step 5 won
    assert steps(tracking, run.info.run_id, "val/loss") == [9]
    assert steps(tracking, run.info.run_id, "val/top-5 ___") == [9]  # MLflow refuses "(", "%" and ")" in keys
    assert [(m.step, m.value) for m in tracking.get_metric_history(run.info.run_id, "recovery_s")] == [(4, 3.25)]
    assert "rank 1 failed (worker process died): resumed from step 4" in run.data.tags[RECOVERIES_TAG]
    params = run.data.params
    assert params["training.lr"] == "0.05" and params["workers"] == "2" and params["dataset.name"] == "synthetic"
    saved = json.loads((tmp_path / "job-ml" / STATE).read_text())
    assert saved["run_id"] == run.info.run_id and saved["progress"]["last_step"] == 9
    assert "sqlite" not in json.dumps(saved)  # the URI is kept as a digest: it may carry credentials


def test_a_tracking_server_that_is_not_there_is_said_once_and_the_console_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setattr(mlflow_logger, "LOG_EVERY_S", 0.05)
    run_dir = str(tmp_path)
    row(run_dir, 1)
    out = io.StringIO()
    began = time.monotonic()
    reporter = Reporter(run_dir, out=out, started=0.0, views=[MlflowLogger(run_dir, SPEC)])
    assert time.monotonic() - began < 1  # the logger's own thread talks to the server
    deadline = time.monotonic() + 30
    while "MLflow logging stopped" not in out.getvalue() and time.monotonic() < deadline:
        reporter.poll()
        time.sleep(0.1)
    reporter.stop()
    assert out.getvalue().count("MLflow logging stopped: ") == 1, out.getvalue()


def test_without_mlflow_installed_the_driver_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    spec = JobSpec.model_validate({**SPEC, "storage": str(tmp_path)})
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert mlflow_view(spec, str(tmp_path)) == []
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    assert mlflow_view(spec, str(tmp_path)) == []
    assert "pip install 'elastic-train[mlflow]'" in capsys.readouterr().out


def test_a_run_deleted_in_mlflow_is_started_afresh_from_the_first_step(tracking, tmp_path):
    run_dir = str(tmp_path)
    for step in (1, 2, 3):
        row(run_dir, step)
    MlflowLogger(run_dir, SPEC).close()
    tracking.delete_run(the_run(tracking).info.run_id)
    row(run_dir, 4)
    MlflowLogger(run_dir, SPEC).close()
    run = the_run(tracking)  # search_runs leaves deleted runs out
    assert steps(tracking, run.info.run_id, "loss") == [1, 2, 3, 4]
