"""`etrain`: serve the API, and a client of it for everything else.

Every expected failure (server down, wrong URL, bad spec file, a refused request, Ray
not starting) ends in one line, `error: ...`, and a non-zero exit: never a traceback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Iterator, Optional

import httpx
import typer
import yaml
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from service.settings import Settings, ensure_token
from workers.events import Kind

# No locals in tracebacks of unexpected errors: they would print the API token.
app = typer.Typer(help="elastic-train: distributed PyTorch training that survives failures.", no_args_is_help=True,
                  pretty_exceptions_show_locals=False)
console = Console()
err_console = Console(stderr=True)
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
ROOT = Path(__file__).resolve().parents[1]

UrlOpt = Annotated[str, typer.Option("--url", envvar="ETRAIN_URL", help="API address.")]
DataDirOpt = Annotated[Optional[Path], typer.Option("--data-dir", help="Data directory (ledger, token, runs).")]


class Output(str, Enum):
    text = "text"
    json = "json"


OutputOpt = Annotated[Output, typer.Option("--output", "-o", help="text for people, json for scripts.")]


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            console.print(f"etrain {version('elastic-train')}", highlight=False)
        except PackageNotFoundError:
            console.print("etrain (not installed; run `pip install -e .`)", highlight=False)
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """elastic-train: distributed PyTorch training that survives failures."""


# ---------------------------------------------------------------- client helpers

def _fail(message: str, code: int = 1):
    # soft_wrap: one line whatever the terminal's width.
    err_console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


def _token(data_dir: Path | None) -> str:
    token = os.environ.get("ETRAIN_TOKEN")
    if token:
        return token
    try:
        settings = Settings(**({"data_dir": data_dir} if data_dir else {}))
    except ValueError as e:
        _fail(f"bad ETRAIN_* setting: {_one_line(e)}")
    if settings.token:
        return settings.token
    path = settings.data_dir / "token"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        _fail(f"no API token: set ETRAIN_TOKEN, or --data-dir to the directory of `etrain serve` ({path} is missing)")
    except OSError as e:
        _fail(f"cannot read the API token in {path}: {e.strerror or e}")


@contextlib.contextmanager
def _client(url: str, data_dir: Path | None = None, token: str | None = None) -> Iterator[httpx.Client]:
    """An API client; any failure to talk to the API inside the block is one error line."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        parsed, reason = None, str(e)
    else:
        reason = "it needs http:// or https:// and a host"
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host or "%" in parsed.host:
        _fail(f"invalid API URL {url!r}: {reason} (set --url or ETRAIN_URL, e.g. http://127.0.0.1:8000)")
    headers = {"Authorization": f"Bearer {token or _token(data_dir)}"}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
            yield client
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as e:
        _fail(f"invalid API URL {url!r} (set --url or ETRAIN_URL, e.g. http://127.0.0.1:8000): {e}")
    except httpx.ConnectError:
        _fail(f"cannot reach the API at {url}; is `etrain serve` running?")
    except httpx.TimeoutException:
        _fail(f"the API at {url} did not answer in time")
    except httpx.HTTPError as e:
        _fail(f"talking to the API at {url} failed: {type(e).__name__}: {e}")


def _call(response: httpx.Response) -> dict:
    if response.status_code >= 400:
        try:
            body = response.json()
            detail = body.get("message") or body.get("detail")
        except (ValueError, AttributeError):
            detail = response.text[:300]
        if not detail:  # not the etrain API: say who answered
            detail = f"{response.reason_phrase} from {response.request.url}"
        unauthorized = response.status_code == 401
        hint = " (the API token is ETRAIN_TOKEN, or <data dir>/token of `etrain serve`)" if unauthorized else ""
        _fail(f"{response.status_code}: {_one_line(detail)}{hint}")
    try:
        return response.json()
    except ValueError:
        _fail(f"{response.request.url} answered with something that is not the etrain API (no JSON)")


def _request(client: httpx.Client, method: str, path: str, **kw) -> dict:
    return _call(client.request(method, path, **kw))


def _one_line(value) -> str:
    from pydantic import ValidationError

    if isinstance(value, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in value.errors())
    return " ".join(str(value).split())


# ---------------------------------------------------------------- serve

def _say(message: str) -> None:
    # One line each however narrow the terminal: serve's output often goes to a log file.
    console.print(message, soft_wrap=True, highlight=False)


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
    dataset_root: Annotated[Optional[list[Path]], typer.Option(
        "--dataset-root", help="A directory jobs may read dataset files from (repeatable; adds to "
        "ETRAIN_DATASET_ROOTS and <data dir>/datasets).")] = None,
):
    """Run the API; with no RAY_ADDRESS, start a local Ray head too. Ctrl-C stops both."""
    from pydantic import ValidationError

    from service.embedded import RayStartError
    from service.gateway import GatewayError

    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops us like Ctrl-C, cleanup included
    head = []
    try:
        _serve(data_dir, host, port, ray_port, dashboard_port, num_cpus, dataset_root or [], head)
    except KeyboardInterrupt:
        pass
    except (RayStartError, GatewayError) as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"{e.strerror or e}{f': {e.filename}' if getattr(e, 'filename', None) else ''}")
    except ValidationError as e:  # a bad ETRAIN_* setting
        _fail(f"bad setting: {_one_line(e)}")
    finally:
        if head:
            if head[0].owned:
                _say("stopping the local Ray head ...")
            head[0].stop()  # the head it started or adopted, all of it, and its record


def _serve(data_dir, host, port, ray_port, dashboard_port, num_cpus, dataset_roots, head: list) -> None:
    import uvicorn
    from sqlalchemy.exc import SQLAlchemyError

    from api.app import create_app
    from service.embedded import HEAD_RECORD, EmbeddedRay, port_free
    from workers import ray_token

    overrides = {k: v for k, v in {"data_dir": data_dir, "host": host, "port": port}.items() if v is not None}
    settings = Settings(**overrides)
    # Flags add to ETRAIN_DATASET_ROOTS; a relative one means from here.
    settings = settings.model_copy(update={"dataset_roots": [*settings.dataset_roots,
                                                             *(p.expanduser().resolve() for p in dataset_roots)]})
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if not port_free(settings.host, settings.port):
        _fail(f"port {settings.port} on {settings.host} is in use (--port); stop what holds it or choose another port")
    token, created = ensure_token(settings)
    # Before ray is imported (it reads RAY_AUTH_MODE once) and before the head starts: a
    # machine that never ran Ray has no token, and `ray start` refuses to start without one.
    ray_token.ensure()
    if not settings.ray_address:
        # The head is this data directory's: recorded in it, so a run after a crash adopts
        # the head the crashed one left (its jobs go on) rather than lose it or mistake
        # another Ray on the same ports for it; stopping the service stops it.
        node = EmbeddedRay(gcs_port=ray_port, dashboard_port=dashboard_port,
                           num_cpus=num_cpus or settings.ray_num_cpus, log_path=str(settings.data_dir / "ray-head.log"),
                           record_path=settings.data_dir / HEAD_RECORD, say=_say)
        head.append(node)
        node.start()  # says whether it starts a head or adopts one
        settings = settings.model_copy(update={"ray_address": node.gcs_address, "dashboard_url": node.dashboard_url})
    try:
        application = create_app(settings)
    except SQLAlchemyError as e:
        _fail(f"cannot open the ledger at {settings.db_url.split('@')[-1]}: {_one_line(e.orig or e)}")
    # The API talks to Ray over HTTP only (never a Ray driver): nothing to connect here.
    # SIGTERM stops us like Ctrl-C (uvicorn restores it after its graceful shutdown, then
    # re-raises the signal).
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    token_file = settings.data_dir / "token"
    if created:
        # The token itself only to a terminal: `etrain demo` and service managers send
        # this output to log files.
        shown = f": [bold]{token}[/bold]" if sys.stdout.isatty() else ""
        _say(f"API token written to {escape(str(token_file))} (owner-only){shown}")
    elif not settings.token:
        _say(f"API token in {escape(str(token_file))}")
    _say(f"jobs may read datasets under: {escape(', '.join(settings.allowed_data_roots))}")
    _say("users' own code (task, code archives, model 'custom'): "
         + ("allowed; anyone with the API token runs code as this user (ETRAIN_ALLOW_CODE=false turns it off)"
            if settings.allow_code else "off (ETRAIN_ALLOW_CODE=false)"))
    _say(f"API on http://{settings.host}:{settings.port}  docs /docs  Ray dashboard {settings.dashboard_url}")
    uvicorn.run(application, host=settings.host, port=settings.port, log_level="warning")


# ---------------------------------------------------------------- jobs

def _load_spec(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as e:
        _fail(f"cannot read the spec {path}: {e.strerror or e}", 2)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        _fail(f"{path} is not valid YAML or JSON: {getattr(e, 'problem', None) or _one_line(e)}{where}", 2)
    if not isinstance(data, dict):
        _fail(f"{path}: a spec is a mapping of fields, got {type(data).__name__}", 2)
    dataset = data.get("dataset")
    for key in ("images", "labels", "root"):
        value = dataset.get(key) if isinstance(dataset, dict) else None
        if isinstance(value, str) and value:
            # The service wants absolute paths. Resolved as `python -m workers.run` resolves
            # them (from the working directory), so one spec file names the same files both ways.
            dataset[key] = os.path.abspath(os.path.expanduser(value))
    return data


@app.command()
def submit(
    spec: Annotated[Path, typer.Argument(help="Job spec, YAML or JSON.")],
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Show live progress until the job ends.")] = False,
    idempotency_key: Annotated[Optional[str], typer.Option(help="Resubmitting with it never starts a second job.")] = None,
    code: Annotated[Optional[Path], typer.Option(
        "--code", help="Your code: this directory is zipped, uploaded and becomes the workers' working directory "
        "(for the spec's `task`).")] = None,
    url: UrlOpt = "http://127.0.0.1:8000", data_dir: DataDirOpt = None,
):
    """Submit a job."""
    body = _load_spec(spec)
    archive = _pack(code) if code is not None else None
    with _client(url, data_dir) as client:
        if archive is not None:
            body["code"] = _upload(client, code, archive)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key is not None else {}
        job = _request(client, "POST", "/v1/jobs", json=body, headers=headers)
        console.print(f"job [bold]{job['id']}[/bold] {job['state']}  ({job.get('dashboard_url') or 'not yet on Ray'})")
        if watch:
            job = watch_job(client, job["id"])
            raise typer.Exit(0 if job["state"] == "SUCCEEDED" else 1)


def _pack(directory: Path) -> bytes:
    """DIR zipped (the same tree, the same archive, so the same id)."""
    from service.code import make_archive

    if not directory.is_dir():
        _fail(f"--code {directory}: {'not a directory' if directory.exists() else 'no such directory'}", 2)
    try:
        return make_archive(directory)
    except OSError as e:
        _fail(f"cannot zip --code {directory}: {e.strerror or e}{f': {e.filename}' if e.filename else ''}", 2)


def _upload(client: httpx.Client, directory: Path, archive: bytes) -> str:
    """Upload an archive; its id. A refusal is one line with the service's reason."""
    response = client.post("/v1/code", content=archive, headers={"Content-Type": "application/zip"}, timeout=300)
    if response.status_code >= 400 and response.status_code != 401:
        try:
            detail = response.json().get("message") or response.json().get("detail")
        except (ValueError, AttributeError):
            detail = None
        _fail(f"the service refused the code in {directory} ({len(archive)} bytes zipped): "
              f"{response.status_code}: {_one_line(detail or response.reason_phrase)}")
    return _call(response)["id"]


def _state(job: dict) -> str:
    phase = (job.get("progress") or {}).get("phase")
    return f"[bold]{job['state']}[/bold]" + (f" ({phase})" if phase and phase != job["state"].lower() else "")


def _progress_table(job_id: str, job: dict | None, notes: list[str], alert: str | None = None) -> Table:
    table = Table(show_header=False, box=None)
    table.add_row("job", f"{job_id}  {_state(job)}" if job else job_id)
    if job:
        p, m = job.get("progress") or {}, job.get("latest_metrics") or {}
        total = p.get("total_steps")
        bar = ""
        if total:
            done = int(30 * min(1.0, (p.get("step") or 0) / total))
            bar = "[" + "#" * done + "." * (30 - done) + "]"
        table.add_row("step", f"{p.get('step') or 0} of {total or '?'} {escape(bar)}  epoch {p.get('epoch')}")
        if m:
            table.add_row("loss", f"{m.get('loss', float('nan')):.4f}   {m.get('samples_per_s', 0):.0f} samples/s")
        table.add_row("restarts", f"{job.get('restarts', 0)}   steps recomputed {job.get('steps_recomputed', 0)}")
    if alert:
        table.add_row("", alert)
    for note in notes[-5:]:
        table.add_row("", note)
    return table


class _Unreachable(Exception):
    """The API did not answer this time (down, restarting, overloaded)."""


def _poll(client: httpx.Client, path: str) -> dict:
    """A GET for watching: an API that is away raises _Unreachable, not an error line."""
    try:
        response = client.get(path, timeout=10)
    except httpx.UnsupportedProtocol:
        raise
    except httpx.TransportError as e:  # refused, reset, timed out
        raise _Unreachable(type(e).__name__) from e
    if response.status_code >= 500:  # restarting behind a proxy, or Ray-side trouble
        raise _Unreachable(str(response.status_code))
    return _call(response)


def watch_job(client: httpx.Client, job_id: str, on_tick=None, interval_s: float = 1.0) -> dict:
    """Live progress until the job ends; each recovery is shown as it happens. While the
    API is away (restarted, say) it keeps retrying, and carries on once it is back."""
    notes: list[str] = []
    seen, seen_live, announced = 0, 0, False
    job, down_since = None, None
    history: list[dict] = []
    offset = 0  # the events file only grows: each poll asks for what was written since the last
    with Live(console=console, refresh_per_second=4) as live:
        while True:
            try:
                job = _poll(client, f"/v1/jobs/{job_id}")
                newer = _poll(client, f"/v1/jobs/{job_id}/events?offset={offset}")
                history, offset = history + newer["data"], newer["next_offset"]
            except _Unreachable:
                down_since = down_since or time.monotonic()
                live.update(_progress_table(job_id, job, notes, "[yellow]API unreachable, retrying...[/yellow]"))
                time.sleep(interval_s)
                continue
            if down_since is not None:
                notes.append(f"API was unreachable for {time.monotonic() - down_since:.0f}s; reconnected")
                down_since = None
            resumed = [e for e in history if e["event"] == Kind.RESUMED]
            for r in resumed[seen:]:
                notes.append(f"[yellow]recovered[/yellow]: rank {r.get('failed_rank')} failed ({escape(str(r.get('cause')))}); "
                             f"resumed from step {r['from_step']}, {r['lost_steps']} step(s) recomputed, "
                             f"{r['recovery_s']:.1f}s to the next step")
            seen = len(resumed)
            live_done = [e for e in history if e["event"] == Kind.LIVE_RECOVERED]
            for r in live_done[seen_live:]:
                rejoined = f"rejoined in {r['rejoin_s']:.1f}s" if r.get("rejoin_s") is not None else "not rejoined"
                notes.append(f"[yellow]recovered live[/yellow]: rank {', '.join(map(str, r['failed_ranks'])) or '?'} "
                             f"replaced while the others trained ({r['survivor_steps']} steps, stall "
                             f"{r['stall_s']:.1f}s, {rejoined}); no worker restarted")
            seen_live = len(live_done)
            # The phase is read from the run directory on each request: no reconciler lag.
            recovering = (job.get("progress") or {}).get("phase") == "recovering"
            if recovering and not announced and job["state"] not in TERMINAL:
                notes.append("[red]a worker failed[/red]: recovering from the newest checkpoint ...")
            announced = recovering
            live.update(_progress_table(job_id, job, notes))
            if on_tick:
                on_tick(job)
            if job["state"] in TERMINAL:
                return job
            time.sleep(interval_s)


@app.command("list")
def list_jobs(
    state: Annotated[Optional[str], typer.Option(help="Only jobs in this state.")] = None,
    limit: int = 20, output: OutputOpt = Output.text, url: UrlOpt = "http://127.0.0.1:8000",
    data_dir: DataDirOpt = None,
):
    """Jobs, newest first."""
    with _client(url, data_dir) as client:
        params = {"limit": limit, **({"state": state.upper()} if state else {})}
        page = _request(client, "GET", "/v1/jobs", params=params)
    if output == Output.json:
        sys.stdout.write(json.dumps(page, indent=2) + "\n")
        return
    table = Table("id", "state", "phase", "step", "restarts", "loss", "created")
    for j in page["data"]:
        m = j.get("latest_metrics") or {}
        table.add_row(j["id"], j["state"], j["progress"].get("phase", ""),
                      f"{j['progress']['step']}/{j['progress'].get('total_steps') or '?'}",
                      str(j["restarts"]), f"{m['loss']:.4f}" if "loss" in m else "",
                      time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j["created_at"])))
    console.print(table)
    console.print(f"{page['count']} job(s)")


@app.command()
def status(job_id: str, output: OutputOpt = Output.text, url: UrlOpt = "http://127.0.0.1:8000",
           data_dir: DataDirOpt = None):
    """One job: a short summary, or everything with --output json."""
    with _client(url, data_dir) as client:
        job = _request(client, "GET", f"/v1/jobs/{job_id}")
    if output == Output.json:
        sys.stdout.write(json.dumps(job, indent=2) + "\n")
        return
    p, m = job.get("progress") or {}, job.get("latest_metrics") or {}
    table = Table(show_header=False, box=None)
    table.add_row("job", f"{job['id']}  {_state(job)}")
    table.add_row("step", f"{p.get('step') or 0} of {p.get('total_steps') or '?'}"
                  + (f"  (epoch {p['epoch']})" if p.get("epoch") is not None else ""))
    if "loss" in m:
        table.add_row("loss", f"{m['loss']:.4f}")
    recoveries = [f"{r:.1f}s" for r in job.get("recovery_s") or [] if r is not None]
    table.add_row("restarts", f"{job.get('restarts', 0)}   steps recomputed {job.get('steps_recomputed', 0)}"
                  + (f"   recoveries {', '.join(recoveries)}" if recoveries else ""))
    live = job.get("live_recoveries") or []
    if live:
        table.add_row("live recoveries", ", ".join(
            f"rank {','.join(map(str, r.get('failed_ranks') or [])) or '?'}: stall {r['stall_s']:.1f}s"
            + (f", rejoined {r['rejoin_s']:.1f}s" if r.get("rejoin_s") is not None else ", not rejoined")
            for r in live) + "   (survivors not restarted)")
    if job.get("resubmits"):
        table.add_row("resubmits", f"{job['resubmits']} (the Ray driver was lost)")
    result = job.get("result") or {}
    if result.get("val_accuracy") is not None:
        table.add_row("accuracy", f"{result['val_accuracy']:.4f}")
    if job.get("error"):
        table.add_row("error", escape(job["error"].get("message") or ""))
    if job.get("dashboard_url"):
        table.add_row("ray", job["dashboard_url"])
    console.print(table)


@app.command()
def logs(job_id: str, follow: Annotated[bool, typer.Option("--follow", "-f")] = False,
         tail: Annotated[int | None, typer.Option("--tail", "-n", min=1, help="Only the last N lines.")] = None,
         url: UrlOpt = "http://127.0.0.1:8000", data_dir: DataDirOpt = None):
    """The job's output (every driver's, oldest first); -n N its last N lines; -f follows it live."""
    with _client(url, data_dir) as client:
        if not follow:
            response = client.get(f"/v1/jobs/{job_id}/logs", params={"tail": tail} if tail else None)
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
def delete(job_id: str, url: UrlOpt = "http://127.0.0.1:8000", data_dir: DataDirOpt = None):
    """Remove an ended job and its run record (checkpoints, metrics, logs)."""
    with _client(url, data_dir) as client:
        response = client.delete(f"/v1/jobs/{job_id}")
        if response.status_code != 204:
            _call(response)
    console.print(f"job {job_id}: deleted")


@app.command()
def cancel(job_id: str, url: UrlOpt = "http://127.0.0.1:8000", data_dir: DataDirOpt = None):
    """Stop a job."""
    with _client(url, data_dir) as client:
        job = _request(client, "POST", f"/v1/jobs/{job_id}/cancel")
    console.print(f"job {job['id']}: {job['state']} (cancel requested)")


@app.command()
def fault(job_id: str, rank: Annotated[Optional[int], typer.Option(help="Rank to kill; random if omitted.")] = None,
          url: UrlOpt = "http://127.0.0.1:8000", data_dir: DataDirOpt = None):
    """Kill one worker of a training job now, to see recovery work."""
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
    from service.demo import DemoError, run_demo

    try:
        code = run_demo(data_dir=data_dir, port=port, ray_port=ray_port, dashboard_port=dashboard_port,
                        kill_at_step=kill_at_step, console=console)
    except DemoError as e:
        _fail(str(e))
    raise typer.Exit(code)


@app.command()
def report(
    results: Annotated[Path, typer.Option("--results", help="Where the benches wrote their JSON.")] = (
        ROOT / "bench" / "results"),
    out: Annotated[Optional[Path], typer.Option("--out", help="Where report.html and its PNGs go "
                                                "(default: <results>/report).")] = None,
):
    """An HTML page with plots of what distribution bought and cost, from the bench results."""
    from service.report import ReportError, build  # matplotlib only when asked for

    try:
        path = build(results, out or results / "report")
    except ReportError as e:
        _fail(str(e), 2)
    except OSError as e:
        _fail(f"cannot write the report: {e.strerror or e}{f': {e.filename}' if e.filename else ''}", 2)
    console.print(str(path), soft_wrap=True, highlight=False)


@app.command()
def tensorboard(
    job: Annotated[Optional[str], typer.Argument(help="A job id: only that job's run (default: every job).")] = None,
    port: Annotated[int, typer.Option(help="Port TensorBoard listens on, on 127.0.0.1.")] = 6006,
    logdir: Annotated[Optional[str], typer.Option(
        "--logdir", help="Directory or URI (s3://...) of the run directories (default: the service's).")] = None,
    data_dir: DataDirOpt = None,
):
    """TensorBoard on the jobs' loss, lr, samples/s, validation scores and recoveries."""
    import subprocess

    from service.embedded import port_free
    from workers import storage
    from workers.tensorboard import board_dir

    if logdir is None:
        try:
            logdir = str(Settings(**({"data_dir": data_dir} if data_dir else {})).runs_dir)
        except ValueError as e:
            _fail(f"bad ETRAIN_* setting: {_one_line(e)}")
    if storage.is_local(logdir) and not os.path.isdir(storage.local_path(logdir)):
        _fail(f"no run directories at {logdir} (set --logdir to a job's storage)")
    target = logdir
    if job:
        try:
            jobs = storage.listdir(logdir)
        except Exception as e:  # the store is unreachable, or refuses the credentials
            _fail(f"cannot list {logdir}: {_one_line(e)}")
        if job not in jobs:
            _fail(f"no job {job!r} in {logdir} (see `etrain list`, or set --logdir to the job's storage)")
        # Its driver writes here from the first step on; TensorBoard picks the files up when they appear.
        target = board_dir(storage.join(logdir, job))
    if not port_free("127.0.0.1", port):
        _fail(f"port {port} on 127.0.0.1 is in use; choose another with --port")
    _say(f"TensorBoard on {target}: http://127.0.0.1:{port}/ (Ctrl-C stops it)")
    # Its own process, this interpreter: the tensorboard installed with elastic-train.
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(target),
                             "--host", "127.0.0.1", "--port", str(port)])
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        code = proc.wait()
    raise typer.Exit(0 if code in (0, -signal.SIGTERM) else code)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
