"""Two API replicas on one PostgreSQL ledger, under fire: 20 jobs submitted across both,
the Ray drivers of 5 killed mid-run, one replica killed, the database stopped for 10 s.
Every job ends SUCCEEDED, is held once in the ledger, and no job ever has two live Ray
drivers at once (watched in Ray's own job list for the whole run). Real PostgreSQL,
real Ray, real uvicorn."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from service.gateway import auth_headers
from tests.helpers.postgres import postgres_server
from tests.service.conftest import start_api, stop_api, wait_for

pytestmark = pytest.mark.ray

JOBS, KILLED = 20, 5
LIVE = ("PENDING", "RUNNING")


def spec(i: int) -> dict:
    """Jobs 0..KILLED-1 train long enough (80 steps of 0.1 s) for their driver to be killed
    mid-run; the others are short, so that 20 Ray Train jobs fit the test's time."""
    steps = 80 if i < KILLED else 30
    return {"job_id": f"rep-{i:02d}", "workers": 1,
            "model": {"name": "custom", "factory": "tests.helpers.paced:slow_linear"},
            "dataset": {"name": "synthetic", "size": 512, "image_size": 8},
            "training": {"max_steps": steps, "global_batch_size": 16, "seed": i, "optimizer": "sgd", "lr": 0.05},
            "checkpoint": {"every_steps": 10}}


class DriverWatch(threading.Thread):
    """Polls Ray's job list; remembers every moment an etrain job had more than one
    live driver, and which submissions Ray ever ran for each job."""

    def __init__(self, dashboard: str):
        super().__init__(daemon=True)
        self.dashboard, self.stop_event = dashboard, threading.Event()
        self.overlaps: list[tuple[str, list[str]]] = []
        self.submissions: dict[str, set[str]] = {}
        self.polls = 0

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stop_event.is_set():
                try:
                    rows = client.get(f"{self.dashboard}/api/jobs/", headers=auth_headers()).json()
                except (httpx.HTTPError, ValueError):
                    time.sleep(0.2)
                    continue
                live: dict[str, list[str]] = {}
                for row in rows:
                    job_id = (row.get("metadata") or {}).get("etrain_job_id")
                    if job_id is None:
                        continue
                    self.submissions.setdefault(job_id, set()).add(row["submission_id"])
                    if row["status"] in LIVE:
                        live.setdefault(job_id, []).append(row["submission_id"])
                self.overlaps += [(job_id, ids) for job_id, ids in live.items() if len(ids) > 1]
                self.polls += 1
                time.sleep(0.5)


def driver_pid(run_dir: Path) -> int | None:
    """The pid of the run's newest driver (its `job_started` event)."""
    try:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return None
    started = [json.loads(line) for line in lines if '"job_started"' in line]
    return started[-1]["pid"] if started else None


@pytest.mark.timeout(1500)
def test_two_replicas_on_postgresql_survive_lost_drivers_a_lost_replica_and_a_database_outage(ray_cluster, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    watch = DriverWatch(ray_cluster.dashboard)
    apis = []
    with postgres_server() as pg:
        # Four jobs on Ray at a time: each Ray Train job is ~7 processes on this 2-core machine.
        env = {"DATABASE_URL": pg.create_database("replicas"), "ETRAIN_MAX_RESUBMITS": "3",
               "ETRAIN_RECONCILE_INTERVAL_S": "1", "ETRAIN_MAX_ACTIVE_JOBS": "4"}
        try:
            apis = [start_api(ray_cluster, data, env=env), start_api(ray_cluster, data, env=env)]
            watch.start()
            clients = [api.client() for api in apis]
            for i in range(JOBS):
                r = clients[i % 2].post("/v1/jobs", json=spec(i))
                assert r.status_code == 201, r.text

            # The drivers of 5 jobs die mid-run (SIGKILL, as a lost node would), each as
            # soon as it trains: they start when the queue lets them, not in order.
            doomed, deadline = {spec(i)["job_id"] for i in range(KILLED)}, time.time() + 400
            while doomed and time.time() < deadline:
                for job_id in sorted(doomed):
                    job = clients[1].get(f"/v1/jobs/{job_id}").json()
                    assert job["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"), f"{job_id} ended unkilled"
                    if job["state"] == "RUNNING" and 1 <= (job["progress"].get("step") or 0) < 50:
                        os.kill(driver_pid(data / "runs" / job_id), signal.SIGKILL)
                        doomed.discard(job_id)
                time.sleep(0.2)
            assert not doomed, f"never saw {doomed} training"

            apis[0].kill()  # one replica dies; the other carries on alone
            pg.stop()  # the database goes away for 10 s
            time.sleep(3)
            r = httpx.get(f"{apis[1].url}/readyz", timeout=30)
            assert r.status_code == 503 and r.json()["ledger"].startswith("unavailable"), r.text
            time.sleep(7)
            pg.start()

            ended = {spec(i)["job_id"]: wait_for(clients[1], spec(i)["job_id"], {"SUCCEEDED", "FAILED", "CANCELLED"},
                                                 timeout=600)
                     for i in range(JOBS)}
            assert {job_id: job["state"] for job_id, job in ended.items()} == {
                spec(i)["job_id"]: "SUCCEEDED" for i in range(JOBS)}, {k: v.get("error") for k, v in ended.items()}
            for i in range(KILLED):
                assert ended[spec(i)["job_id"]]["resubmits"] >= 1, ended[spec(i)["job_id"]]
            listed = clients[1].get("/v1/jobs", params={"limit": 100}).json()
            assert listed["count"] == JOBS and sorted(j["id"] for j in listed["data"]) == sorted(ended)
            assert httpx.get(f"{apis[1].url}/readyz", timeout=30).status_code == 200
        finally:
            watch.stop_event.set()
            watch.join(timeout=15)
            for api in apis:
                stop_api(api)
    assert watch.polls > 20
    assert watch.overlaps == [], watch.overlaps[:5]
    # Ray ran a second driver for each killed job, and none for the others.
    assert all(len(watch.submissions.get(spec(i)["job_id"], ())) >= 2 for i in range(KILLED)), watch.submissions
