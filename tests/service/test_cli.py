"""The etrain client commands against a real uvicorn server (fake Ray gateway)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import uvicorn
from typer.testing import CliRunner

from api.app import create_app
from service import ledger
from service.cli import app as cli
from service.lifecycle import JobState
from service.settings import Settings
from tests.conftest import free_port
from tests.fakes import FakeGateway
from workers import events

TOKEN = "cli-token"


@pytest.fixture
def server(tmp_path, monkeypatch):
    gateway = FakeGateway()
    application = create_app(Settings(data_dir=tmp_path, token=TOKEN), gateway, reconcile=False)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(application, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    monkeypatch.setenv("ETRAIN_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("ETRAIN_TOKEN", TOKEN)
    try:
        yield application, gateway, tmp_path
    finally:
        srv.should_exit = True
        thread.join(10)


def test_submit_list_status_logs_fault_cancel(server, tmp_path):
    application, gateway, data_dir = server
    spec = tmp_path / "job.yaml"
    spec.write_text("job_id: cli-job\nmodel: simple_cnn\nworkers: 2\n")
    run = CliRunner().invoke
    result = run(cli, ["submit", str(spec)])
    assert result.exit_code == 0, result.output
    assert "cli-job" in result.output and "SUBMITTED" in result.output
    assert [s["job_id"] for s in gateway.submitted.values()] == ["cli-job"]

    listed = run(cli, ["list"])
    assert listed.exit_code == 0 and "cli-job" in listed.output and "1 job(s)" in listed.output
    status = run(cli, ["status", "cli-job"])
    assert status.exit_code == 0 and '"state": "SUBMITTED"' in status.output
    logs = run(cli, ["logs", "cli-job"])
    assert logs.exit_code == 0 and "logs of etrain-cli-job-1" in logs.output

    # A running job: the worker of rank 1 is where the run directory says it is.
    sessions = application.state.ledger
    ledger.update_job(sessions, job_id="cli-job", state=JobState.RUNNING)
    events.emit(str(data_dir / "runs" / "cli-job"), "worker_started", attempt=1, rank=1, pid=4242, node_id="n1")
    fault = run(cli, ["fault", "cli-job", "--rank", "1"])
    assert fault.exit_code == 0, fault.output
    assert gateway.killed == [(4242, "n1")]

    cancelled = run(cli, ["cancel", "cli-job"])
    assert cancelled.exit_code == 0 and "cancel requested" in cancelled.output
    assert gateway.stopped == ["etrain-cli-job-1"]


def test_errors_are_one_clear_line(server, tmp_path):
    run = CliRunner().invoke
    missing = run(cli, ["status", "nope"])
    assert missing.exit_code == 1 and "404" in missing.output and "no job 'nope'" in missing.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: transformer-xxl\n")
    rejected = run(cli, ["submit", str(bad)])
    assert rejected.exit_code == 1 and "422" in rejected.output and "model.name" in rejected.output
    assert "Traceback" not in rejected.output


def test_watch_shows_a_recovery_whose_cause_has_brackets(server, tmp_path, monkeypatch):
    # Seen in a run: gloo's error text starts with "[/__w/...]", which rich took for markup.
    import io

    from rich.console import Console

    import service.cli as cli_module

    application, gateway, data_dir = server
    spec = tmp_path / "job.yaml"
    spec.write_text("job_id: w1\nmodel: simple_cnn\n")
    assert CliRunner().invoke(cli, ["submit", str(spec)]).exit_code == 0
    cause = "[/__w/pytorch/gloo/pair.cc:561] Connection closed by peer"
    events.emit(str(data_dir / "runs" / "w1"), "resumed", failed_rank=0, cause=cause, from_step=10,
                lost_steps=3, recovery_s=4.2)
    ledger.update_job(application.state.ledger, job_id="w1", state=JobState.FAILED)
    out = io.StringIO()
    monkeypatch.setattr(cli_module, "console", Console(file=out, width=250))
    with cli_module._client(os.environ["ETRAIN_URL"]) as client:
        job = cli_module.watch_job(client, "w1")
    assert job["state"] == "FAILED"
    assert cause in out.getvalue()
