"""MLflow for a run, when MLFLOW_TRACKING_URI is set (the optional extra
`elastic-train[mlflow]`): the driver logs the points TensorBoard gets
(workers/scalars.py) to an MLflow run named after the job.

- One MLflow run per job. Its id is kept in the run record (mlflow.json, with the feed's
  progress), so a driver the service resubmits, on any host, logs on into the same run,
  each step once. A driver killed between a batch and the progress saved after it makes
  its successor log those steps again: the same values at the same steps.
- Params: the spec, flattened (`training.lr`, `strategy`, `workers`, ...). Metrics: loss,
  lr, samples_per_s, val/*, recovery_s and live/stall_s, live/rejoin_s at their steps,
  in batches at most every LOG_EVERY_S and at the end. Each recovery's line goes to the
  run's `etrain.recoveries` tag (MLflow has no text at a step).
- The run ends FINISHED or FAILED with the record's verdict; a driver killed leaves it
  RUNNING, and its successor goes on with it.
- The experiment is MLFLOW_EXPERIMENT_NAME, else "elastic-train". Credentials for a
  tracking server come from MLflow's own environment (MLFLOW_TRACKING_TOKEN, ...).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from typing import Any

from workers import storage
from workers.events import Kind
from workers.scalars import Feed, Point

URI_ENV = "MLFLOW_TRACKING_URI"
STATE = "mlflow.json"
DEFAULT_EXPERIMENT = "elastic-train"
LOG_EVERY_S = 2.0
CLOSE_TIMEOUT_S = 30.0  # at the end, the last batch waits this long for the server
RECOVERIES_TAG = "etrain.recoveries"
# MLflow's limits (a batch holds at most 1000 metrics and 100 params; a param value 6000
# characters, a tag value 8000 on some stores, 5000 on others).
MAX_METRICS, MAX_PARAMS, MAX_PARAM_CHARS, MAX_TAG_CHARS = 1000, 100, 6000, 5000
_BAD_KEY = re.compile(r"[^\w\-. /:]")  # what MLflow's key check refuses (on Linux)
NOT_INSTALLED = ("MLFLOW_TRACKING_URI is set, but mlflow is not installed: pip install 'elastic-train[mlflow]' "
                 "(this run is not logged to MLflow)")


def wanted() -> bool:
    return bool(os.environ.get(URI_ENV))


def flat_params(spec: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{dotted key: value as text} for every set field of the spec."""
    out: dict[str, str] = {}
    for key, value in spec.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{name}."))
        elif value is not None and value != [] and value != {}:
            text = value if isinstance(value, str) else json.dumps(value)
            out[_key(name)] = text[:MAX_PARAM_CHARS]
    return out


def _key(name: str) -> str:
    """MLflow refuses keys with other characters (a task's own metric names may have them)."""
    return _BAD_KEY.sub("_", name)


class MlflowLogger:
    """The run directory's new points to MLflow, from a thread of its own: a tracking
    server that is slow or gone (MLflow's client retries for minutes) must not hold up the
    driver's console or its training. `poll()` raises what the thread met, once."""

    STOPPED = "MLflow logging stopped"  # the driver's line when poll() fails

    def __init__(self, run_dir: str, spec: dict[str, Any]):
        self.uri = os.environ[URI_ENV]
        self.run_dir, self.spec = run_dir, spec
        self.state_path = storage.join(run_dir, STATE)
        self.feed = Feed(run_dir)
        self.client = self.run_id = None
        self.recoveries = ""
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._work, name="etrain-mlflow", daemon=True)
        self.thread.start()

    def poll(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.stop.set()
        self.thread.join(CLOSE_TIMEOUT_S)
        self.poll()
        if self.thread.is_alive():
            raise TimeoutError(f"{self.uri} did not answer within {CLOSE_TIMEOUT_S:.0f}s; the last points are "
                               "not logged")

    def _work(self) -> None:
        try:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=self.uri)
            self.run_id = self._resume() or self._start()
            self.recoveries = self.client.get_run(self.run_id).data.tags.get(RECOVERIES_TAG, "")
            while not self.stop.wait(LOG_EVERY_S):
                self._log(self.feed.read())
            self._log(self.feed.read())
            if self.feed.ended:
                status = "FINISHED" if self.feed.ended == Kind.FINISHED else "FAILED"
                self.client.set_terminated(self.run_id, status=status)
        except BaseException as e:  # said by the driver at its next poll
            self.error = e

    def _resume(self) -> str | None:
        """The job's MLflow run an earlier driver logged to, on the same tracking server."""
        try:
            saved = json.loads(storage.read_bytes(self.state_path))
        except (FileNotFoundError, ValueError):
            return None
        if saved.get("tracking_uri_sha256") != _digest(self.uri):
            return None  # another server: a run of its own there, from the first step
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(saved["run_id"])
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise  # the server is there but refuses: said, rather than a second run
            return None  # removed there since: a run afresh
        if run.info.lifecycle_stage == "deleted":
            return None
        self.feed.restore(saved["progress"])
        self.client.update_run(run.info.run_id, status="RUNNING")
        return run.info.run_id

    def _start(self) -> str:
        from mlflow.entities import Param

        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        job_id = self.spec.get("job_id") or storage.name(self.run_dir)
        run = self.client.create_run(experiment_id, run_name=job_id,
                                     tags={"etrain.job_id": job_id, "etrain.run_dir": self.run_dir})
        params = [Param(k, v) for k, v in sorted(flat_params(self.spec).items())]
        for i in range(0, len(params), MAX_PARAMS):
            self.client.log_batch(run.info.run_id, params=params[i:i + MAX_PARAMS])
        self._save(run.info.run_id)
        return run.info.run_id

    def _log(self, points: list[Point]) -> None:
        """Log a batch, then save the progress that counts it."""
        if not points:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_key(p.tag), float(p.value), now, p.step) for p in points if p.text is None]
        for i in range(0, len(metrics), MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + MAX_METRICS])
        texts = [p.text for p in points if p.text is not None]
        if texts:
            # The newest lines, when they outgrow what a tag holds.
            self.recoveries = "\n".join([*filter(None, [self.recoveries]), *texts])[-MAX_TAG_CHARS:]
            self.client.set_tag(self.run_id, RECOVERIES_TAG, self.recoveries)
        self._save(self.run_id)

    def _save(self, run_id: str) -> None:
        storage.write_bytes(self.state_path, json.dumps(
            {"tracking_uri_sha256": _digest(self.uri), "run_id": run_id, "progress": self.feed.state()}).encode())


def _digest(uri: str) -> str:
    """The tracking URI as the run record keeps it: a URI may carry credentials."""
    return hashlib.sha256(uri.encode()).hexdigest()
