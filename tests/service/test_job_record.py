"""What outlives a job's processes: every driver's output kept in the run record, and
DELETE of an ended job with its run record."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import settings as settings_
from hypothesis import strategies as st

from service import ledger, rundir
from service.lifecycle import JobState
from service.settings import Settings
from tests.conftest import ROOT
from tests.fakes import FakeGateway
from workers import events

TOKEN = "job-record-test-token"


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(data_dir=tmp_path / "data", token=TOKEN, storage=None)


@pytest.fixture
def gateway() -> FakeGateway:
    return FakeGateway()


def create(client, job_id: str) -> dict:
    body = {"job_id": job_id, "workers": 1, "dataset": {"name": "synthetic", "size": 64},
            "training": {"max_steps": 4, "global_batch_size": 8}}
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def end(app, job_id: str, state: JobState = JobState.SUCCEEDED) -> None:
    for s in (JobState.RUNNING, state):
        ledger.update_job(app.state.ledger, job_id=job_id, state=s)


def test_logs_are_every_drivers_output_from_the_run_record(client, app, settings):
    create(client, "two-drivers")
    logs = os.path.join(settings.runs_dir, "two-drivers", events.DRIVER_LOGS)
    os.makedirs(logs)
    with open(os.path.join(logs, "driver-20261203T100000-11.log"), "w") as f:
        f.write("first driver: step 5\n")  # then it was killed, mid-line or not
    with open(os.path.join(logs, "driver-20261203T100130-12.log"), "w") as f:
        f.write("second driver: resumed at step 5\nfinished\n")
    text = client.get("/v1/jobs/two-drivers/logs").text
    assert text.index("first driver: step 5") < text.index("second driver: resumed at step 5")
    assert "===== driver 1 of 2 (driver-20261203T100000-11.log) =====" in text
    assert "===== driver 2 of 2 (driver-20261203T100130-12.log) =====" in text


def test_logs_without_copies_in_the_run_record_come_from_ray(client):
    create(client, "old-run")
    assert client.get("/v1/jobs/old-run/logs").text == "logs of etrain-old-run-1\n"
    assert client.get("/v1/jobs/old-run/logs?tail=1").text == "logs of etrain-old-run-1\n"


DRIVER_FILES = st.lists(st.lists(st.sampled_from(["step 5", "é", "\r50%\r100%", "", "a" * 40]), max_size=30)
                        .map("\n".join).flatmap(lambda text: st.sampled_from([text, text + "\n"])),
                        min_size=1, max_size=4)


@settings_(max_examples=150, deadline=None)
@given(files=DRIVER_FILES, n=st.integers(1, 70), block=st.sampled_from([3, 16, 65536]))
def test_a_tail_of_the_logs_is_the_last_lines_of_the_whole(tmp_path_factory, files, n, block):
    rd = str(tmp_path_factory.mktemp("rd"))
    os.makedirs(os.path.join(rd, events.DRIVER_LOGS))
    for i, text in enumerate(files):
        with open(os.path.join(rd, events.DRIVER_LOGS, f"driver-20261203T1000{i:02d}-{i}.log"), "w") as f:
            f.write(text)
    whole = rundir.driver_output(rd)
    original, rundir._LOG_BLOCK = rundir._LOG_BLOCK, block  # small blocks: many reads back from the end
    try:
        assert rundir.driver_output(rd, tail=n) == "".join(rundir.split_lines(whole)[-n:])
    finally:
        rundir._LOG_BLOCK = original


def test_the_logs_tail_query_and_cli_option(client, settings):
    create(client, "long")
    logs = os.path.join(settings.runs_dir, "long", events.DRIVER_LOGS)
    os.makedirs(logs)
    with open(os.path.join(logs, "driver-20261203T100000-11.log"), "w") as f:
        f.writelines(f"step {i}\n" for i in range(1, 100_001))
    assert client.get("/v1/jobs/long/logs?tail=3").text == "step 99998\nstep 99999\nstep 100000\n"
    assert client.get("/v1/jobs/long/logs?tail=0").status_code == 422


def test_the_entrypoint_copies_its_whole_output_into_the_run_record(tmp_path):
    # A spec the driver refuses before Ray starts: its error line is output like any other.
    spec = tmp_path / "spec.yaml"
    spec.write_text("job_id: teed\ntask: no_such_module_here:make\ndataset: {name: synthetic, size: 64}\n"
                    f"storage: {tmp_path / 'runs'}\n")
    done = subprocess.run([sys.executable, "-m", "workers.run", str(spec)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    files = events.driver_logs(str(tmp_path / "runs" / "teed"))
    assert len(files) == 1
    kept = open(files[0]).read()
    assert kept.strip() and kept.strip().splitlines()[-1] in done.stdout + done.stderr


def test_delete_removes_an_ended_job_and_its_run_record(client, app, settings):
    create(client, "gone")
    run = os.path.join(settings.runs_dir, "gone")
    assert os.path.isdir(run)
    end(app, "gone")
    r = client.delete("/v1/jobs/gone")
    assert r.status_code == 204, r.text
    assert client.get("/v1/jobs/gone").status_code == 404
    assert not os.path.exists(run)
    assert client.delete("/v1/jobs/gone").status_code == 404
    create(client, "gone")  # the id is free again


def test_delete_of_a_job_that_may_still_run_is_409_and_keeps_it(client, app, settings):
    create(client, "busy")
    r = client.delete("/v1/jobs/busy")
    assert r.status_code == 409 and "cancel it" in r.json()["detail"]
    assert client.get("/v1/jobs/busy").status_code == 200
    assert os.path.isfile(os.path.join(settings.runs_dir, "busy", "spec.json"))
