"""The Ray head stopped and started again under a running job: the API keeps serving
reads (job, logs) and /readyz is 503 saying Ray is down; once the head is back the job is
resubmitted, resumes from its checkpoint and succeeds, with no resubmission spent on what
Ray refused; `etrain logs` shows both drivers' output; DELETE is 409 while the job runs
and removes it and its run record once it has ended. Real Ray, real uvicorn."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from service.embedded import EmbeddedRay
from tests.conftest import ROOT, Cluster, free_port
from tests.service.conftest import TOKEN, start_api, stop_api, wait_for

pytestmark = pytest.mark.ray

SPEC = {"job_id": "outage", "workers": 1,
        "model": {"name": "custom", "factory": "tests.helpers.paced:slow_linear"},
        "dataset": {"name": "synthetic", "size": 512, "image_size": 8},
        "training": {"max_steps": 60, "global_batch_size": 16, "seed": 5, "optimizer": "sgd", "lr": 0.05},
        "checkpoint": {"every_steps": 10}}


def head(ports: tuple[int, int], log: str) -> EmbeddedRay:
    node = EmbeddedRay(gcs_port=ports[0], dashboard_port=ports[1], num_cpus=2, log_path=log,
                       extra_env={"RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)})
    node.start()
    return node


def test_a_ray_head_restart_resubmits_and_resumes_and_every_drivers_output_is_kept(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    ports = (free_port(), free_port())
    heads, api = [], None
    try:
        heads.append(head(ports, str(tmp_path / "head-1.log")))
        cluster = Cluster(address=heads[0].gcs_address, dashboard=heads[0].dashboard_url,
                          env={**os.environ, **heads[0].env, "RAY_ADDRESS": heads[0].gcs_address})
        # One resubmission allowed: a budget spent on refused submissions would fail the job.
        api = start_api(cluster, data, env={"ETRAIN_MAX_RESUBMITS": "1", "ETRAIN_RECONCILE_INTERVAL_S": "0.5"})
        client = api.client()
        assert client.post("/v1/jobs", json=SPEC).status_code == 201
        wait_for(client, "outage", set(), timeout=300,
                 until=lambda job: job["state"] == "RUNNING" and (job["progress"].get("step") or 0) >= 15)
        r = client.delete("/v1/jobs/outage")
        assert r.status_code == 409 and "cancel it" in r.json()["detail"]

        heads.pop().stop(grace_s=0)  # the head, and the job's driver and worker with it
        time.sleep(3)  # a few reconciler ticks against a dead Ray
        ready = httpx.get(f"{api.url}/readyz", timeout=30)
        assert ready.status_code == 503 and ready.json()["ray"].startswith("unavailable"), ready.text
        assert ready.json()["ledger"] == "ok"
        job = client.get("/v1/jobs/outage").json()  # reads go on
        assert job["state"] in ("RUNNING", "RECOVERING") and job["progress"]["step"] >= 15
        assert "[train] job outage" in client.get("/v1/jobs/outage/logs").text

        heads.append(head(ports, str(tmp_path / "head-2.log")))
        job = wait_for(client, "outage", {"SUCCEEDED", "FAILED", "CANCELLED"}, timeout=400)
        assert job["state"] == "SUCCEEDED" and job["resubmits"] == 1, job
        assert job["progress"]["step"] == 60 and job["steps_recomputed"] <= 10, job
        assert httpx.get(f"{api.url}/readyz", timeout=30).status_code == 200

        logs = subprocess.run([sys.executable, "-m", "service.cli", "logs", "outage", "--url", api.url],
                              cwd=ROOT, env={**os.environ, "ETRAIN_TOKEN": TOKEN}, capture_output=True, text=True,
                              timeout=60)
        assert logs.returncode == 0, logs.stderr
        assert "===== driver 1 of 2" in logs.stdout and "===== driver 2 of 2" in logs.stdout
        first, second = logs.stdout.split("===== driver 2 of 2")
        assert "[train] job outage" in first and "[train] job outage" in second
        assert '"final_step": 60' in second  # the second driver's summary line, last

        assert client.delete("/v1/jobs/outage").status_code == 204
        assert client.get("/v1/jobs/outage").status_code == 404
        assert not (data / "runs" / "outage").exists()
    finally:
        if api is not None:
            stop_api(api)
        for node in heads:
            node.stop()
