"""`etrain`: serve the API, and a client of it for everything else."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import httpx
import typer
import yaml
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from service.settings import Settings, ensure_token

app = typer.Typer(help="elastic-train: distributed PyTorch training that survives failures.", no_args_is_help=True)
console = Console()
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
FAILURE_EVENTS = ("worker_failed", "fault_injected", "driver_lost")
ROOT = Path(__file__).resolve().parents[1]

UrlOpt = Annotated[str, typer.Option("--url", envvar="ETRAIN_URL", help="API address.")]
DataDirOpt = Annotated[Optional[Path], typer.Option("--data-dir", help="Data directory (ledger, token, runs).")]


# ---------------------------------------------------------------- client helpers

def _client(url: str, data_dir: Path | None = None) -> httpx.Client:
    settings = Settings(**({"data_dir": data_dir} if data_dir else {}))
    token = os.environ.get("ETRAIN_TOKEN") or settings.token
    if not token:
        path = settings.data_dir / "token"
        if not path.exists():
            _fail(f"no API token: set ETRAIN_TOKEN or start `etrain serve` (it writes {path})")
        token = path.read_text().strip()
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def _fail(message: str, code: int = 1):
    console.print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(code)


def _call(response: httpx.Response) -> dict:
    if response.status_code >= 400:
        try:
            body = response.json()
            detail = body.get("message") or body.get("detail")
        except ValueError:
            detail = response.text
        _fail(f"{response.status_code}: {detail}")
    return response.json()


def _request(client: httpx.Client, method: str, path: str, **kw) -> dict:
    try:
        return _call(client.request(method, path, **kw))
    except httpx.ConnectError:
        _fail(f"cannot reach the API at {client.base_url}; is `etrain serve` running?")


# ---------------------------------------------------------------- serve

def _interrupt(*_) -> None:
    raise KeyboardInterrupt


@app.command()
def serve(
    data_dir: DataDirOpt = None,
    host: Annotated[Optional[str], typer.Option(help="Bind address.")] = None,
    port: Annotated[Optional[int], typer.Option(help="API port.")] = None,
    ray_port: Annotated[int, typer.Option(help="GCS port of the embedded Ray head.")] = 6379,
    dashboard_port: Annotated[int, typer.Option(help="Dashboard port of the embedded Ray head.")] = 8265,
    num_cpus: Annotated[Optional[int], typer.Option(help="Logical CPUs of the embedded Ray head.")] = None,
):
    """Run the API; with no RAY_ADDRESS, start a local Ray head too. Ctrl-C stops both."""
    import uvicorn

    from api.app import create_app
    from service.embedded import EmbeddedRay

    overrides = {k: v for k, v in {"data_dir": data_dir, "host": host, "port": port}.items() if v is not None}
    settings = Settings(**overrides)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    token, created = ensure_token(settings)
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    head = None
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops us like Ctrl-C, cleanup included
    try:
        if not settings.ray_address:
            head = EmbeddedRay(gcs_port=ray_port, dashboard_port=dashboard_port,
                               num_cpus=num_cpus or settings.ray_num_cpus, log_path=str(settings.data_dir / "ray-head.log"))
            console.print(f"starting a local Ray head (dashboard {head.dashboard_url}) ...")
            head.start()
            settings = settings.model_copy(update={"ray_address": head.gcs_address, "dashboard_url": head.dashboard_url})
        application = create_app(settings)
        application.state.gateway.connect()
        # ray.init installed a native SIGTERM handler that exits at once: put ours back
        # (uvicorn restores it after its graceful shutdown, then re-raises the signal).
        signal.signal(signal.SIGTERM, _interrupt)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if created:
            console.print(f"API token (shown once; also in {settings.data_dir / 'token'}): [bold]{token}[/bold]")
        console.print(f"API on http://{settings.host}:{settings.port}  docs /docs  Ray dashboard {settings.dashboard_url}")
        uvicorn.run(application, host=settings.host, port=settings.port, log_level="warning")
    except KeyboardInterrupt:
        pass
    finally:
        if head is not None:
            console.print("stopping the local Ray head ...")
            head.stop()


# ---------------------------------------------------------------- jobs

def _load_spec(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        _fail(f"cannot read {path}: {e}", 2)
    if not isinstance(data, dict):
        _fail(f"{path}: a spec is a mapping of fields", 2)
    for key in ("images", "labels", "root"):  # the service wants absolute dataset paths
        value = (data.get("dataset") or {}).get(key) if isinstance(data.get("dataset"), dict) else None
        if value and not os.path.isabs(value):
            data["dataset"][key] = str((path.parent / value).resolve())
    return data


@app.command()
def submit(
    spec: Annotated[Path, typer.Argument(help="Job spec, YAML or JSON.")],
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Show live progress until the job ends.")] = False,
    idempotency_key: Annotated[Optional[str], typer.Option(help="Resubmitting with it never starts a second job.")] = None,
    url: UrlOpt = "http://127.0.0.1:8000", data_dir: DataDirOpt = None,
):
    """Submit a job."""
    with _client(url, data_dir) as client:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        job = _request(client, "POST", "/v1/jobs", json=_load_spec(spec), headers=headers)
        console.print(f"job [bold]{job['id']}[/bold] {job['state']}  ({job.get('dashboard_url') or 'not yet on Ray'})")
        if watch:
            job = watch_job(client, job["id"])
            raise typer.Exit(0 if job["state"] == "SUCCEEDED" else 1)


def _progress_table(job: dict, notes: list[str]) -> Table:
    p, m = job.get("progress") or {}, job.get("latest_metrics") or {}
    table = Table(show_header=False, box=None)
    table.add_row("job", f"{job['id']}  [bold]{job['state']}[/bold]")
    total = p.get("total_steps")
    bar = ""
    if total:
        done = int(30 * min(1.0, (p.get("step") or 0) / total))
        bar = "[" + "#" * done + "." * (30 - done) + "]"
    table.add_row("step", f"{p.get('step') or 0} of {total or '?'} {bar}  epoch {p.get('epoch')}")
    if m:
        table.add_row("loss", f"{m.get('loss', float('nan')):.4f}   {m.get('samples_per_s', 0):.0f} samples/s")
    table.add_row("restarts", f"{job.get('restarts', 0)}   steps recomputed {job.get('steps_recomputed', 0)}")
    for note in notes[-5:]:
        table.add_row("", note)
    return table


def watch_job(client: httpx.Client, job_id: str, on_tick=None) -> dict:
    """Live progress until the job ends; each recovery is shown as it happens."""
    notes: list[str] = []
    seen, announced = 0, False
    with Live(console=console, refresh_per_second=4) as live:
        while True:
            job = _request(client, "GET", f"/v1/jobs/{job_id}")
            history = _request(client, "GET", f"/v1/jobs/{job_id}/events")["data"]
            resumed = [e for e in history if e["event"] == "resumed"]
            for r in resumed[seen:]:
                notes.append(f"[yellow]recovered[/yellow]: rank {r.get('failed_rank')} failed ({escape(str(r.get('cause')))}); "
                             f"resumed from step {r['from_step']}, {r['lost_steps']} step(s) recomputed, "
                             f"{r['recovery_s']:.1f}s to the next step")
                announced = False
            seen = len(resumed)
            # From the events, not the job state, which the reconciler updates a tick later.
            last_failure = max((e["time"] for e in history if e["event"] in FAILURE_EVENTS), default=0)
            unexplained = last_failure > max((e["time"] for e in resumed), default=0)
            if unexplained and not announced and job["state"] not in TERMINAL:
                notes.append("[red]a worker failed[/red]: recovering from the newest checkpoint ...")
                announced = True
            live.update(_progress_table(job, notes))
            if on_tick:
                on_tick(job)
            if job["state"] in TERMINAL:
                return job
            time.sleep(1)


@app.command("list")
def list_jobs(
    state: Annotated[Optional[str], typer.Option(help="Only jobs in this state.")] = None,
    limit: int = 20, url: UrlOpt = "http://127.0.0.1:8000", data_dir: DataDirOpt = None,
):
    """Jobs, newest first."""
    with _client(url, data_dir) as client:
        params = {"limit": limit, **({"state": state.upper()} if state else {})}
        page = _request(client, "GET", "/v1/jobs", params=params)
    table = Table("id", "state", "step", "restarts", "loss", "created")
    for j in page["data"]:
        m = j.get("latest_metrics") or {}
        table.add_row(j["id"], j["state"], f"{j['progress']['step']}/{j['progress'].get('total_steps') or '?'}",
                      str(j["restarts"]), f"{m['loss']:.4f}" if "loss" in m else "",
                      time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j["created_at"])))
    console.print(table)
    console.print(f"{page['count']} job(s)")


@app.command()
def status(job_id: str, url: UrlOpt = "http://127.0.0.1:8000", data_dir: DataDirOpt = None):
    """One job in full, as JSON."""
    with _client(url, data_dir) as client:
        console.print_json(json.dumps(_request(client, "GET", f"/v1/jobs/{job_id}")))


@app.command()
def logs(job_id: str, follow: Annotated[bool, typer.Option("--follow", "-f")] = False,
         url: UrlOpt = "http://127.0.0.1:8000", data_dir: DataDirOpt = None):
    """The job's output; -f follows it live."""
    with _client(url, data_dir) as client:
        if not follow:
            response = client.get(f"/v1/jobs/{job_id}/logs")
            if response.status_code >= 400:
                _call(response)
            sys.stdout.write(response.text)
            return
        with client.stream("GET", f"/v1/jobs/{job_id}/logs", params={"follow": True}, timeout=None) as response:
            if response.status_code >= 400:
                response.read()
                _call(response)
            for chunk in response.iter_text():
                sys.stdout.write(chunk)
                sys.stdout.flush()


@app.command()
def cancel(job_id: str, url: UrlOpt = "http://127.0.0.1:8000", data_dir: DataDirOpt = None):
    """Stop a job."""
    with _client(url, data_dir) as client:
        job = _request(client, "POST", f"/v1/jobs/{job_id}/cancel")
    console.print(f"job {job['id']}: {job['state']} (cancel requested)")


@app.command()
def fault(job_id: str, rank: Annotated[Optional[int], typer.Option(help="Rank to kill; random if omitted.")] = None,
          url: UrlOpt = "http://127.0.0.1:8000", data_dir: DataDirOpt = None):
    """Kill one worker of a running job now, to see recovery work."""
    with _client(url, data_dir) as client:
        result = _request(client, "POST", f"/v1/jobs/{job_id}/faults", json={"rank": rank})
    console.print(f"killed rank {result['rank']} (pid {result['pid']}) of job {job_id}")


@app.command()
def demo(
    data_dir: DataDirOpt = None,
    port: Annotated[int, typer.Option(help="API port.")] = 8000,
    ray_port: int = 6379, dashboard_port: int = 8265,
    kill_at_step: Annotated[int, typer.Option(help="Kill a worker once the job passes this step.")] = 120,
):
    """Start the local stack, train a 2-worker job, kill a worker mid-run, watch it recover."""
    from service.demo import run_demo

    raise typer.Exit(run_demo(data_dir=data_dir, port=port, ray_port=ray_port, dashboard_port=dashboard_port,
                              kill_at_step=kill_at_step, console=console))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
