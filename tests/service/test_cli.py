"""The etrain client commands against a real uvicorn server (fake Ray gateway)."""

from __future__ import annotations

import json
import os
import threading
import time
from importlib.metadata import version

import pytest
import typer
from typer.testing import CliRunner

from api.app import create_app
from service import ledger
from service.cli import app as cli
from service.lifecycle import JobState
from service.settings import Settings
from tests.conftest import free_port
from tests.fakes import FakeGateway
from tests.helpers.threaded_server import Server
from workers import events

TOKEN = "cli-token"


@pytest.fixture
def server(tmp_path, monkeypatch):
    gateway = FakeGateway()
    application = create_app(Settings(data_dir=tmp_path, token=TOKEN), gateway, reconcile=False)
    running = Server(application, free_port())
    monkeypatch.setenv("ETRAIN_URL", f"http://127.0.0.1:{running.port}")
    monkeypatch.setenv("ETRAIN_TOKEN", TOKEN)
    try:
        yield application, gateway, tmp_path
    finally:
        running.stop()


def training(rd: str, pids: dict[int, int]) -> None:
    """The run record of a job whose workers are up and have completed a step."""
    events.emit(rd, "job_started", pid=1)
    events.emit(rd, "attempt_started", attempt=1, world_size=len(pids), from_step=0)
    for rank, pid in pids.items():
        events.emit(rd, "worker_started", attempt=1, rank=rank, pid=pid, node_id="n1")
    events.emit(rd, "training_started", attempt=1, world_size=len(pids), total_steps=40, from_step=0)
    events.log_metrics(rd, step=12, epoch=0, loss=0.75, attempt=1)


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
    assert status.exit_code == 0 and "SUBMITTED (starting)" in status.output, status.output
    as_json = run(cli, ["status", "cli-job", "--output", "json"])
    assert as_json.exit_code == 0 and json.loads(as_json.output)["state"] == "SUBMITTED"
    assert json.loads(run(cli, ["list", "-o", "json"]).output)["count"] == 1
    logs = run(cli, ["logs", "cli-job"])
    assert logs.exit_code == 0 and "logs of etrain-cli-job-1" in logs.output
    last = run(cli, ["logs", "cli-job", "-n", "1"])
    assert last.exit_code == 0 and last.output == "logs of etrain-cli-job-1\n", last.output

    early = run(cli, ["fault", "cli-job", "--rank", "1"])  # no worker up yet
    assert early.exit_code == 1 and "is starting: its workers are not up yet" in early.output

    # A training job: the worker of rank 1 is where the run directory says it is.
    sessions = application.state.ledger
    ledger.update_job(sessions, job_id="cli-job", state=JobState.RUNNING)
    training(str(data_dir / "runs" / "cli-job"), {0: 4241, 1: 4242})
    fault = run(cli, ["fault", "cli-job", "--rank", "1"])
    assert fault.exit_code == 0, fault.output
    assert gateway.killed == [(4242, "n1")]

    cancelled = run(cli, ["cancel", "cli-job"])
    assert cancelled.exit_code == 0 and "cancel requested" in cancelled.output
    assert gateway.stopped == ["etrain-cli-job-1"]

    running = run(cli, ["delete", "cli-job"])
    assert running.exit_code == 1 and "409: job cli-job is RUNNING: cancel it and wait" in running.output
    ledger.update_job(sessions, job_id="cli-job", state=JobState.CANCELLED)
    deleted = run(cli, ["delete", "cli-job"])
    assert deleted.exit_code == 0 and "job cli-job: deleted" in deleted.output, deleted.output
    assert not (data_dir / "runs" / "cli-job").exists() and run(cli, ["status", "cli-job"]).exit_code == 1


def test_status_is_a_short_summary(server):
    _, _, data_dir = server
    spec = data_dir / "job.yaml"
    spec.write_text("job_id: short\nmodel: simple_cnn\n")
    run = CliRunner().invoke
    assert run(cli, ["submit", str(spec)]).exit_code == 0
    rd = str(data_dir / "runs" / "short")
    training(rd, {0: 11})
    events.emit(rd, "worker_failed", rank=0, classification="infrastructure", process_died=True)
    events.emit(rd, "resumed", failed_rank=0, cause="crash", from_step=10, lost_steps=2, recovery_s=3.25)
    events.emit(rd, "failed", error="ValueError: bad shape")
    out = run(cli, ["status", "short"]).output
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert "job short SUBMITTED (failed)" in lines, out
    assert "step 12 of 40 (epoch 0)" in lines and "loss 0.7500" in lines, out
    assert "restarts 0 steps recomputed 2 recoveries 3.2s" in lines, out
    assert "error ValueError: bad shape" in lines, out
    assert len(lines) <= 8 and "{" not in out


def test_status_and_the_api_show_a_live_recovery(server):
    _, _, data_dir = server
    spec = data_dir / "job.yaml"
    spec.write_text("job_id: livejob\nmodel: simple_cnn\nworkers: 3\nfailure: {mode: live}\n")
    run = CliRunner().invoke
    assert run(cli, ["submit", str(spec)]).exit_code == 0, run(cli, ["submit", str(spec)]).output
    rd = str(data_dir / "runs" / "livejob")
    training(rd, {0: 11, 1: 12, 2: 13})
    events.emit(rd, events.LiveRecovered(
        attempt=1, failed_ranks=[1], groups=[1], failed_after_step=1, rejoined_at_step=9, stall_s=2.25,
        rejoin_s=7.5, survivor_steps=7, samples_skipped=224, survivors_restarted=False))
    out = run(cli, ["status", "livejob"]).output
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert "restarts 0 steps recomputed 0" in lines, out
    assert "live recoveries rank 1: stall 2.2s, rejoined 7.5s (survivors not restarted)" in lines, out
    shown = json.loads(run(cli, ["status", "livejob", "--output", "json"]).output)
    (live,) = shown["live_recoveries"]
    assert live["survivors_restarted"] is False and live["stall_s"] == 2.25 and live["survivor_steps"] == 7


def error_line(result) -> str:
    """The one line a failed command prints: `error: ...`, no traceback."""
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def test_errors_are_one_clear_line(server, tmp_path, monkeypatch):
    run = CliRunner().invoke
    assert "404: no job 'nope'" in error_line(run(cli, ["status", "nope"]))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: transformer-xxl\n")
    rejected = error_line(run(cli, ["submit", str(bad)]))
    assert "422" in rejected and "model.name" in rejected

    bad.write_text("model: [simple_cnn\nworkers: 2\n")
    assert "not valid YAML" in error_line(run(cli, ["submit", str(bad)]))
    assert "line 2" in error_line(run(cli, ["submit", str(bad)]))
    assert "cannot read the spec" in error_line(run(cli, ["submit", str(tmp_path / "missing.yaml")]))
    bad.write_text("- model\n")
    assert "a spec is a mapping" in error_line(run(cli, ["submit", str(bad)]))

    for url in ("localhost:8000", "http://", "ftp://127.0.0.1", "http://[oops"):
        assert "invalid API URL" in error_line(run(cli, ["list", "--url", url])), url
    down = f"http://127.0.0.1:{free_port()}"
    assert "cannot reach the API" in error_line(run(cli, ["status", "x", "--url", down]))
    assert "cannot reach the API" in error_line(run(cli, ["logs", "x", "-f", "--url", down]))
    monkeypatch.setenv("ETRAIN_TOKEN", "wrong")
    assert "401" in error_line(run(cli, ["list"]))
    monkeypatch.delenv("ETRAIN_TOKEN")
    assert "no API token" in error_line(run(cli, ["list", "--data-dir", str(tmp_path / "elsewhere")]))


def test_version():
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"etrain {version('elastic-train')}"


def test_submit_watch_keeps_watching_across_an_api_restart(tmp_path, monkeypatch):
    """The API goes away mid-watch (stopped, then started again on the same port, same
    ledger): the watch says so, keeps retrying quietly, and follows the job to its end."""
    import io

    from rich.console import Console

    import service.cli as cli_module

    settings = Settings(data_dir=tmp_path, token=TOKEN)
    first = Server(create_app(settings, FakeGateway(), reconcile=False), free_port())
    servers = [first]
    monkeypatch.setenv("ETRAIN_URL", f"http://127.0.0.1:{first.port}")
    monkeypatch.setenv("ETRAIN_TOKEN", TOKEN)
    screen = io.StringIO()  # a terminal, so every refresh of the live table is kept
    monkeypatch.setattr(cli_module, "console", Console(file=screen, force_terminal=True, width=200))
    spec = tmp_path / "job.yaml"
    spec.write_text("job_id: survivor\nmodel: simple_cnn\n")

    def restart_api_mid_watch() -> None:
        sessions = first.app.state.ledger
        while ledger.get_job(sessions, job_id="survivor") is None:
            time.sleep(0.05)
        time.sleep(1.5)  # a poll or two against the first server
        first.stop()
        time.sleep(3)  # refused polls
        second = Server(create_app(settings, FakeGateway(), reconcile=False), first.port)
        servers.append(second)
        rd = str(tmp_path / "runs" / "survivor")
        training(rd, {0: 7})
        events.emit(rd, "finished", attempt=1, final_step=40, loss=0.5)
        ledger.update_job(second.app.state.ledger, job_id="survivor", state=JobState.SUCCEEDED)

    chaos = threading.Thread(target=restart_api_mid_watch, daemon=True)
    chaos.start()
    try:
        result = CliRunner().invoke(cli, ["submit", str(spec), "--watch"])
    finally:
        chaos.join(30)
        for s in servers:
            s.stop()
    seen = screen.getvalue()
    assert result.exit_code == 0, (result.output, seen[-2000:])
    assert "API unreachable, retrying..." in seen
    assert "API was unreachable for" in seen and "reconnected" in seen
    assert "SUCCEEDED" in seen and "Traceback" not in seen + result.output


def test_watch_ends_with_an_error_line_when_the_job_is_unknown(server):
    import service.cli as cli_module

    with cli_module._client(os.environ["ETRAIN_URL"]) as client, pytest.raises(typer.Exit):
        cli_module.watch_job(client, "no-such-job")


def test_watch_shows_a_recovery_whose_cause_has_brackets(server, tmp_path, monkeypatch):
    # Seen in a run: gloo's error text starts with "[/__w/...]", which rich took for markup.
    import io

    from rich.console import Console

    import service.cli as cli_module

    application, _, data_dir = server
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
