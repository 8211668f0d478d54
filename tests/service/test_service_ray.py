"""The control plane against a real Ray cluster and a real uvicorn server."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess

import httpx
import pytest
from ray.job_submission import JobSubmissionClient

from tests.service.conftest import TOKEN, small_job, start_api, stop_api, wait_for

pytestmark = pytest.mark.ray


def ray_jobs_of(cluster, job_id: str) -> list:
    client = JobSubmissionClient(cluster.dashboard)
    return [j for j in client.list_jobs() if (j.metadata or {}).get("etrain_job_id") == job_id]


def test_http_job_succeeds_shows_in_ray_and_serves_logs(api, ray_cluster):
    with api.client() as c:
        r = c.post("/v1/jobs", json=small_job("http-ok"))
        assert r.status_code == 201, r.text
        job = wait_for(c, "http-ok", {"SUCCEEDED", "FAILED"})
        assert job["state"] == "SUCCEEDED", job
        assert job["progress"]["step"] == 40 and job["result"]["weights_sha256"]
        assert job["latest_checkpoint"]["step"] == 40
        listed = subprocess.run(["ray", "job", "list", "--address", ray_cluster.dashboard], env=ray_cluster.env,
                                capture_output=True, text=True, timeout=120)
        assert job["submission_id"] in listed.stdout, listed.stdout[-2000:]
        logs = c.get("/v1/jobs/http-ok/logs").text
        assert '"status": "succeeded"' in logs
        followed = c.get("/v1/jobs/http-ok/logs", params={"follow": True}).text  # ends with the job
        assert '"status": "succeeded"' in followed
        assert c.get("/v1/jobs/http-ok/metrics", params={"since_step": 30}).json()["count"] == 10
        assert [r["step"] for r in c.get("/v1/jobs/http-ok/checkpoints").json()["data"]][0] == 40
        cluster = c.get("/v1/cluster").json()
        assert cluster["cpus"]["total"] == 8 and cluster["nodes"] == 1
        assert c.post("/v1/jobs/http-ok/cancel").status_code == 409


def test_api_killed_and_restarted_keeps_the_job(ray_cluster, tmp_path):
    api = start_api(ray_cluster, tmp_path)
    try:
        with api.client() as c:
            assert c.post("/v1/jobs", json=small_job("survives-api", steps=200)).status_code == 201
            wait_for(c, "survives-api", {"RUNNING", "SUCCEEDED"})
        api.kill()  # SIGKILL: no shutdown of any kind
    finally:
        stop_api(api)
    api = start_api(ray_cluster, tmp_path)
    try:
        with api.client() as c:
            job = wait_for(c, "survives-api", {"SUCCEEDED", "FAILED"})
            assert job["state"] == "SUCCEEDED", job
            assert c.get("/v1/jobs").json()["count"] == 1
    finally:
        stop_api(api)
    rows = sqlite3.connect(tmp_path / "ledger.db").execute("select count(*) from jobs where id='survives-api'").fetchone()
    assert rows == (1,)
    assert len(ray_jobs_of(ray_cluster, "survives-api")) == 1


def test_fifty_concurrent_posts_one_key_one_job(api, ray_cluster):
    async def post_all():
        async with httpx.AsyncClient(base_url=api.url, headers={"Authorization": f"Bearer {TOKEN}",
                                                                 "Idempotency-Key": "same-key"}, timeout=120) as c:
            body = small_job("idem", steps=400)
            del body["job_id"]
            return await asyncio.gather(*[c.post("/v1/jobs", json=body) for _ in range(50)])

    responses = asyncio.run(post_all())
    assert all(r.status_code in (200, 201) for r in responses), [r.text for r in responses if r.status_code >= 300]
    assert sum(r.status_code == 201 for r in responses) == 1
    ids = {r.json()["id"] for r in responses}
    assert len(ids) == 1
    with api.client() as c:
        assert c.get("/v1/jobs").json()["count"] == 1
        job_id = ids.pop()
        assert len(ray_jobs_of(ray_cluster, job_id)) == 1
        c.post(f"/v1/jobs/{job_id}/cancel").raise_for_status()
        assert wait_for(c, job_id, {"CANCELLED", "SUCCEEDED", "FAILED"})["state"] == "CANCELLED"


def test_lost_driver_is_resubmitted_and_resumes(api, ray_cluster):
    with api.client() as c:
        c.post("/v1/jobs", json=small_job("lost-driver", steps=600, size=4096)).raise_for_status()
        # Past step 50 the checkpoints of steps 10 and 20 are pruned (keep 3): the new
        # driver must start although Ray Train's record of the old one names them.
        job = wait_for(c, "lost-driver", {"FAILED", "SUCCEEDED"},
                       until=lambda j: j["state"] == "RUNNING" and j["progress"]["step"] >= 55)
        info = JobSubmissionClient(ray_cluster.dashboard).get_job_info(job["submission_id"])
        os.kill(int(info.driver_info.pid), signal.SIGKILL)
        seen: list[str] = []
        job = wait_for(c, "lost-driver", {"SUCCEEDED", "FAILED"}, timeout=300, seen=seen)
        assert job["state"] == "SUCCEEDED", job
        assert "RECOVERING" in seen, seen
        assert job["resubmits"] == 1 and job["submission_id"].endswith("-2")
        events = c.get("/v1/jobs/lost-driver/events").json()["data"]
        assert [e for e in events if e["event"] == "driver_lost"]
        resumed = [e for e in events if e["event"] == "resumed"]
        assert resumed and resumed[-1]["from_step"] >= 20, resumed
        assert len(ray_jobs_of(ray_cluster, "lost-driver")) == 2
