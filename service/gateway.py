"""Everything the service asks of Ray, over Ray's HTTP APIs only: the dashboard's Jobs
REST API (/api/jobs/..., /api/packages/...) for submit/status/logs/stop, its state API
(/api/v0/...) and cluster status for the cluster and for finding a worker, and a tiny
Ray job pinned to a worker's node (`python -m workers.kill_worker`) to kill it.

The service process is never a Ray driver (no ray.init, no Ray import): it starts while
Ray is down, outlives the head, and every call has a timeout, so a silent socket costs a
GatewayError after a few seconds instead of a blocked thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import shlex
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import httpx

from service.settings import Settings
from workers import kill_worker, ray_token

DEFAULT_TIMEOUT_S = 5.0  # one ordinary call to the dashboard
LONG_TIMEOUT_S = 30.0  # reading a job's whole log, uploading a code archive
KILL_TIMEOUT_S = 60.0  # a kill job: scheduled on the worker's node, run, ended
TAIL_INTERVAL_S = 1.0  # how often a followed log is read again
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
# Ray 2.60's Jobs SDK (dashboard_sdk.SubmissionClient): `authorization: Bearer <token>`.
AUTH_HEADER, BEARER = "authorization", "Bearer "
NODE_LABEL = "ray.io/node-id"  # every node's label: pins a job's entrypoint to one node


class GatewayError(RuntimeError):
    """Ray could not be reached or refused the request."""


class JobExists(GatewayError):
    """Ray already has a job with this submission id."""


class Gateway(Protocol):
    dashboard_url: str

    def submit(self, *, submission_id: str, spec_path: str, job_id: str, code_path: str | None = None,
               requirements: Sequence[str] = ()) -> None: ...
    def status(self, submission_id: str) -> str | None: ...
    def job_statuses(self) -> dict[str, str]: ...
    def logs(self, submission_id: str) -> str: ...
    def tail_logs(self, submission_id: str) -> AsyncIterator[str]: ...
    def stop(self, submission_id: str) -> None: ...
    def kill_process(self, *, pid: int, node_id: str | None, submission_id: str | None = None,
                     job_id: str | None = None) -> None: ...
    def cluster(self) -> dict[str, Any]: ...
    def ping(self) -> None: ...


def one_line(text: str, limit: int = 300) -> str:
    """The line of a Ray error body that says what went wrong: a traceback's last line."""
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:limit]


def auth_headers() -> dict[str, str]:
    """What Ray's JobSubmissionClient sends: `authorization: Bearer <token>`, the token
    read the way Ray's AuthenticationTokenLoader reads it (RAY_AUTH_TOKEN, else the file
    RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token). Nothing when RAY_AUTH_MODE is
    `disabled` or no token exists."""
    if os.environ.get(ray_token.MODE_ENV, "token").lower() == "disabled":
        return {}
    token = os.environ.get(ray_token.TOKEN_ENV, "").strip()
    if not token:
        try:
            token = ray_token.token_path().read_text().strip()
        except OSError:
            token = ""
    return {AUTH_HEADER: BEARER + token} if token else {}


def package_uri(path: str | os.PathLike) -> str:
    """The content-addressed GCS URI Ray's Jobs SDK gives a local archive
    (ray._private.runtime_env.packaging.get_uri_for_package): the SHA-1 of its bytes."""
    p = Path(path)
    digest = hashlib.sha1(p.read_bytes()).hexdigest()
    name = p.name.lower()
    ext = ".tar.gz" if name.endswith((".tar.gz", ".tgz")) else ".tar.xz" if name.endswith(".tar.xz") else ".zip"
    return f"gcs://_ray_pkg_{digest}{ext}"


def _is_uri(value: str) -> bool:
    return "://" in value


class RayHttp:
    """Ray's dashboard over HTTP: every request with a timeout and Ray's token; transport
    errors, timeouts, refusals and error statuses become GatewayError in one line."""

    def __init__(self, url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, long_timeout_s: float = LONG_TIMEOUT_S,
                 transport: httpx.BaseTransport | None = None):
        self.url = url.rstrip("/")
        self.timeout_s, self.long_timeout_s = timeout_s, long_timeout_s
        self._transport = transport
        self._headers = auth_headers()
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, transport=transport,
                                  follow_redirects=False)

    def close(self) -> None:
        self._http.close()

    # -------------------------------------------------------------- plumbing

    def _error(self, method: str, path: str, e: Exception, timeout: float) -> GatewayError:
        if isinstance(e, httpx.TimeoutException):
            return GatewayError(f"Ray at {self.url} did not answer {method} {path} within {timeout:g}s")
        return GatewayError(f"Ray at {self.url} unreachable: {one_line(str(e)) or type(e).__name__}")

    def _check(self, r: httpx.Response, method: str, path: str, allow: Sequence[int]) -> httpx.Response:
        if r.status_code == 200 or r.status_code in allow:
            return r
        if r.status_code in (401, 403):
            said = "requires a token and none was found" if r.status_code == 401 else "rejected the token"
            raise GatewayError(f"Ray at {self.url} {said} ({r.status_code}); the token comes from "
                               f"{ray_token.TOKEN_ENV}, else {ray_token.token_path()}")
        text = r.text
        if "already exists" in text:
            raise JobExists(one_line(text))
        try:  # the state API answers {"result": false, "msg": ...}
            body = r.json()
            text = (body.get("msg") if isinstance(body, dict) else None) or text
        except ValueError:
            pass  # a traceback or plain text
        raise GatewayError(f"Ray refused {method} {path} ({r.status_code}): {one_line(text) or r.reason_phrase}")

    def request(self, method: str, path: str, *, allow: Sequence[int] = (), timeout: float | None = None,
                **kwargs) -> httpx.Response:
        timeout = timeout or self.timeout_s
        for retry in (True, False):
            try:
                r = self._http.request(method, path, headers=self._headers, timeout=timeout, **kwargs)
            except (httpx.HTTPError, httpx.InvalidURL) as e:
                raise self._error(method, path, e, timeout) from e
            if r.status_code in (401, 403) and retry:
                fresh = auth_headers()  # the token file may have been made or replaced since
                if fresh != self._headers:
                    self._headers = fresh
                    continue
            return self._check(r, method, path, allow)
        raise AssertionError("unreachable")

    def async_client(self) -> httpx.AsyncClient:
        transport = self._transport if isinstance(self._transport, httpx.AsyncBaseTransport) else None
        return httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s, transport=transport,
                                 follow_redirects=False)

    async def arequest(self, http: httpx.AsyncClient, method: str, path: str, *, allow: Sequence[int] = (),
                       timeout: float | None = None, **kwargs) -> httpx.Response:
        timeout = timeout or self.timeout_s
        try:
            r = await http.request(method, path, headers=self._headers, timeout=timeout, **kwargs)
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            raise self._error(method, path, e, timeout) from e
        return self._check(r, method, path, allow)

    def _json(self, r: httpx.Response, what: str) -> Any:
        try:
            return r.json()
        except ValueError as e:
            raise GatewayError(f"Ray at {self.url} answered {what} with something not JSON: "
                               f"{one_line(r.text)[:100]!r}") from e

    # -------------------------------------------------------------- Jobs API

    def version(self) -> dict[str, Any]:
        return self._json(self.request("GET", "/api/version"), "/api/version")

    def upload_working_dir(self, runtime_env: dict[str, Any]) -> dict[str, Any]:
        """A local archive as working_dir, uploaded to the cluster's GCS and replaced by its
        gcs:// URI, as Ray's JobSubmissionClient does (dashboard_sdk: _upload_package_if_needed):
        GET /api/packages/<protocol>/<name> (200 there, 404 not; it also pins it a while),
        then PUT the bytes where missing."""
        working_dir = runtime_env.get("working_dir")
        if not working_dir or _is_uri(str(working_dir)):
            return runtime_env
        path = Path(working_dir)
        if not path.is_file():
            raise GatewayError(f"the code archive {path} is not a file Ray can take as working_dir")
        try:
            uri = package_uri(path)
        except OSError as e:
            raise GatewayError(f"cannot read the code archive {path}: {e.strerror or e}") from e
        protocol, name = uri.split("://", 1)
        where = f"/api/packages/{protocol}/{name}"
        if self.request("GET", where, allow=(404,)).status_code == 404:
            self.request("PUT", where, content=path.read_bytes(), timeout=self.long_timeout_s)
        return {**runtime_env, "working_dir": uri}

    def submit_job(self, *, entrypoint: str, submission_id: str, metadata: dict[str, str] | None = None,
                   runtime_env: dict[str, Any] | None = None, entrypoint_num_cpus: float | None = None,
                   entrypoint_resources: dict[str, float] | None = None,
                   entrypoint_label_selector: dict[str, str] | None = None) -> str:
        """POST /api/jobs/ (the body JobSubmissionClient.submit_job sends). JobExists when
        Ray already has `submission_id`."""
        env = dict(runtime_env or {})
        env = self.upload_working_dir(env)
        if isinstance(env.get("pip"), (list, tuple)):  # the form RuntimeEnv(pip=[...]).to_dict() sends
            env["pip"] = {"packages": list(env["pip"]), "pip_check": False}
        body: dict[str, Any] = {"entrypoint": entrypoint, "submission_id": submission_id, "metadata": metadata or {}}
        for key, value in (("runtime_env", env or None), ("entrypoint_num_cpus", entrypoint_num_cpus),
                           ("entrypoint_resources", entrypoint_resources),
                           ("entrypoint_label_selector", entrypoint_label_selector)):
            if value is not None:
                body[key] = value
        r = self.request("POST", "/api/jobs/", json=body)
        return self._json(r, "a submission").get("submission_id", submission_id)

    def job_info(self, submission_id: str) -> dict[str, Any] | None:
        """GET /api/jobs/<id>: the job's details (status, driver's Ray job id, exit code); None on 404."""
        r = self.request("GET", f"/api/jobs/{quote(submission_id, safe='')}", allow=(404,))
        if r.status_code == 404:
            if "does not exist" not in r.text:  # not Ray's answer (a wrong URL, a proxy): not "Ray forgot it"
                raise GatewayError(f"{self.url} has no Ray Jobs API (404 for /api/jobs/): {one_line(r.text)}")
            return None
        return self._json(r, f"job {submission_id}")

    def list_jobs(self) -> list[dict[str, Any]]:
        return self._json(self.request("GET", "/api/jobs/"), "/api/jobs/")

    def job_logs(self, submission_id: str) -> str | None:
        r = self.request("GET", f"/api/jobs/{quote(submission_id, safe='')}/logs", allow=(404,),
                         timeout=self.long_timeout_s)
        return None if r.status_code == 404 else self._json(r, f"the logs of {submission_id}").get("logs", "")

    def stop_job(self, submission_id: str) -> bool | None:
        r = self.request("POST", f"/api/jobs/{quote(submission_id, safe='')}/stop", allow=(404,))
        return None if r.status_code == 404 else bool(self._json(r, f"stopping {submission_id}").get("stopped"))

    # -------------------------------------------------------------- state API

    def state_list(self, kind: str, filters: Sequence[tuple[str, str]] = (), *, detail: bool = False,
                   limit: int = 1000) -> list[dict[str, Any]]:
        """GET /api/v0/<kind> (actors, nodes, workers, ...) with `key=value` filters."""
        params: list[tuple[str, str]] = [("limit", str(limit)), ("detail", "1" if detail else "0"),
                                         # the server's own deadline, inside ours
                                         ("timeout", str(max(1, int(self.timeout_s) - 1)))]
        for key, value in filters:
            params += [("filter_keys", key), ("filter_predicates", "="), ("filter_values", str(value))]
        body = self._json(self.request("GET", f"/api/v0/{kind}", params=params), f"/api/v0/{kind}")
        try:
            return list(body["data"]["result"]["result"])
        except (KeyError, TypeError) as e:
            raise GatewayError(f"Ray's state API answered /api/v0/{kind} without a result: "
                               f"{one_line(str(body.get('msg', body)))}") from e

    def cluster_status(self) -> dict[str, Any]:
        """GET /api/cluster_status: the autoscaler's report (resources used and total), {} when absent."""
        body = self._json(self.request("GET", "/api/cluster_status"), "/api/cluster_status")
        return (body.get("data") or {}).get("clusterStatus") or {}


def runtime_env(code_path: str | None, requirements: Sequence[str] = ()) -> dict[str, Any] | None:
    """The Ray runtime_env of a job: its code archive as working_dir (the gateway uploads a
    local .zip and sends its gcs:// URI instead), its requirements as pip. None when it has neither."""
    env: dict[str, Any] = {}
    if code_path:
        env["working_dir"] = str(code_path)
    if requirements:
        env["pip"] = list(requirements)
    return env or None


class RayGateway:
    def __init__(self, settings: Settings, *, transport: httpx.BaseTransport | None = None):
        self.settings = settings
        self.dashboard_url = settings.dashboard_url.rstrip("/")
        self.python = settings.python or sys.executable
        self.timeout_s = settings.ray_timeout_s
        self.long_timeout_s = max(self.timeout_s, settings.ray_long_timeout_s)
        self.kill_timeout_s = settings.ray_kill_timeout_s
        self.tail_interval_s = TAIL_INTERVAL_S
        self._transport = transport
        self._client = None
        self._lock = threading.Lock()
        self._ray_version: str | None = None

    @property
    def client(self) -> RayHttp:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = RayHttp(self.dashboard_url, timeout_s=self.timeout_s,
                                           long_timeout_s=self.long_timeout_s, transport=self._transport)
        return self._client

    def connect(self) -> None:
        """Nothing to do: the service talks to Ray over HTTP per call and is never a Ray
        driver, so it starts while Ray is down. Kept for callers of the old interface."""

    def submit(self, *, submission_id: str, spec_path: str, job_id: str, code_path: str | None = None,
               requirements: Sequence[str] = ()) -> None:
        """`code_path`: a stored code archive, the working directory of the driver and every
        worker (uploaded to the cluster first); `requirements`: pip installs for them."""
        env = runtime_env(code_path, requirements)
        # With pip, Ray puts the job in a virtualenv of its own: `python` is that one's,
        # which this interpreter's absolute path would pass by.
        python = "python" if requirements else self.python
        # The very command a user would pass to `ray job submit`, exec'd: Ray runs the
        # entrypoint under /bin/sh, which (dash, unlike bash) forks it rather than becoming
        # it, and `ray job stop` signals the shell and the children it has at that moment
        # (Ray's JobSupervisor, psutil children()); a driver forked just after outlived the
        # stop and trained on beside the job's next submission.
        entrypoint = f"exec {shlex.quote(python)} -m workers.run {shlex.quote(spec_path)}"
        try:
            self.client.submit_job(entrypoint=entrypoint, submission_id=submission_id,
                                   metadata={"etrain_job_id": job_id}, runtime_env=env)
        except JobExists:  # resubmitting the same id is how we stay idempotent
            return
        except GatewayError as e:
            raise GatewayError(f"Ray refused job {job_id}: {e}") from e

    def status(self, submission_id: str) -> str | None:
        info = self.client.job_info(submission_id)
        return None if info is None else str(info.get("status"))

    def job_statuses(self) -> dict[str, str]:
        """Every job Ray holds, submission id to status, in one call: a reconciler tick asks
        once, not once per job (the dashboard serves every caller from one process)."""
        return {row["submission_id"]: str(row.get("status")) for row in self.client.list_jobs()
                if row.get("submission_id")}

    def logs(self, submission_id: str) -> str:
        text = self.client.job_logs(submission_id)
        if text is None:
            raise GatewayError(f"Ray has no job {submission_id}")
        return text

    async def tail_logs(self, submission_id: str) -> AsyncIterator[str]:
        """New log output as it comes, polling the logs endpoint, until the job ends (or
        Ray forgets it). Status is read before the logs, so the last read after the job
        ended holds everything."""
        client, sid = self.client, quote(submission_id, safe="")
        sent = 0
        async with client.async_client() as http:
            while True:
                r = await client.arequest(http, "GET", f"/api/jobs/{sid}", allow=(404,))
                if r.status_code == 404:  # Ray does not know it (or forgot it): nothing more will come
                    return
                ended = client._json(r, f"job {submission_id}").get("status") in TERMINAL
                r = await client.arequest(http, "GET", f"/api/jobs/{sid}/logs", allow=(404,),
                                          timeout=client.long_timeout_s)
                if r.status_code == 404:
                    return
                text = client._json(r, f"the logs of {submission_id}").get("logs", "")
                if len(text) > sent:
                    yield text[sent:]
                    sent = len(text)
                if ended:
                    return
                await asyncio.sleep(self.tail_interval_s)

    def stop(self, submission_id: str) -> None:
        if self.client.stop_job(submission_id) is None:
            raise GatewayError(f"Ray has no job {submission_id}")

    # -------------------------------------------------------------- killing a worker

    def _live_actor(self, pid: int, node_id: str | None) -> dict[str, Any] | None:
        """The live actor whose process is `pid` (on `node_id`), from Ray's state API."""
        filters = [("pid", str(pid)), ("state", "ALIVE")] + ([("node_id", node_id)] if node_id else [])
        actors = self.client.state_list("actors", filters, detail=True)
        actors = [a for a in actors if a.get("pid") == pid and a.get("state") == "ALIVE"
                  and (node_id is None or a.get("node_id") == node_id)]
        if len(actors) > 1:
            raise GatewayError(f"pid {pid} is a live actor on {len(actors)} nodes; name the node")
        return actors[0] if actors else None

    def _owner(self, actor: dict[str, Any], submission_id: str | None, job_id: str | None) -> dict[str, Any] | None:
        """The running etrain job (a Ray job submission) whose driver made `actor`; None
        when it is anything else (another submission, a Ray system actor, an ended job)."""
        ray_job = actor.get("job_id")
        if submission_id:
            info = self.client.job_info(submission_id)
            candidates = [info] if info else []
        else:
            candidates = self.client.list_jobs()
        for info in candidates:
            meta = info.get("metadata") or {}
            if (info.get("job_id") == ray_job and info.get("status") == "RUNNING" and "etrain_job_id" in meta
                    and (job_id is None or meta["etrain_job_id"] == job_id)):
                return info
        return None

    def kill_process(self, *, pid: int, node_id: str | None, submission_id: str | None = None,
                     job_id: str | None = None) -> None:
        """SIGKILL a training worker, from a tiny Ray job pinned to the worker's node.

        Verified through Ray first: `pid` must be a live actor (on `node_id`) made by a
        running etrain job (the submission `submission_id`, the etrain job `job_id`, when
        given); `python -m workers.kill_worker` checks again on the node, at the signal,
        that the pid still is a busy Ray worker of that actor's class. ProcessLookupError
        when nothing live was killed; GatewayError when Ray could not be asked or the kill
        job did not end within its timeout."""
        actor = self._live_actor(pid, node_id)
        if actor is None or self._owner(actor, submission_id, job_id) is None:
            raise ProcessLookupError(pid)
        node = actor.get("node_id") or node_id
        argv = [self.python, "-m", "workers.kill_worker", "--pid", str(pid)]
        if actor.get("class_name") and not actor.get("repr_name"):  # a custom __repr__ retitles the process
            argv += ["--title", f"ray::{actor['class_name']}"]
        kill_id = f"etrain-kill-{pid}-{secrets.token_hex(4)}"
        try:
            self.client.submit_job(entrypoint=shlex.join(argv), submission_id=kill_id,
                                   metadata={"etrain_kill_pid": str(pid),
                                             "etrain_kill_actor": actor.get("actor_id") or ""},
                                   entrypoint_label_selector={NODE_LABEL: node} if node else None)
        except GatewayError as e:
            raise GatewayError(f"could not start the kill of pid {pid} on its node through Ray: {e}") from e
        info = self._wait_ended(kill_id)
        code, status = info.get("driver_exit_code"), info.get("status")
        # The kill job stays in Ray's job list (its logs say what it did): deleting it as it
        # ends races with Ray's own last write of its record, which then comes back half-made.
        if status == "SUCCEEDED":
            return
        if code == kill_worker.NOT_LIVE:
            raise ProcessLookupError(pid)
        raise GatewayError(f"the kill of pid {pid} (Ray job {kill_id}) ended {status}"
                           f"{f' with exit code {code}' if code is not None else ''}: "
                           f"{one_line(info.get('message') or '')}")

    def _wait_ended(self, kill_id: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.kill_timeout_s
        delay = 0.1
        while True:
            info = self.client.job_info(kill_id)
            if info is not None and info.get("status") in TERMINAL:
                return info
            if time.monotonic() > deadline:
                try:
                    self.client.stop_job(kill_id)
                except GatewayError:
                    pass
                raise GatewayError(f"the kill job {kill_id} did not end within {self.kill_timeout_s:g}s "
                                   f"(last status {info.get('status') if info else 'unknown'})")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    # -------------------------------------------------------------- the cluster

    def cluster(self) -> dict[str, Any]:
        """Live nodes and their CPUs/GPUs (the state API); free ones from the autoscaler's
        report on the head (refreshed every few seconds), the totals where it has none;
        `node_resources`: each live node's totals."""
        nodes = self.client.state_list("nodes", [("state", "ALIVE")], detail=True)
        total = {"CPU": 0.0, "GPU": 0.0}
        for node in nodes:
            for key in total:
                total[key] += float((node.get("resources_total") or {}).get(key, 0))
        free = dict(total)
        try:
            usage = (self.client.cluster_status().get("loadMetricsReport") or {}).get("usage") or {}
        except GatewayError:
            usage = {}
        for key, whole in total.items():
            used = usage.get(key)  # [used, total]
            if isinstance(used, (list, tuple)) and len(used) == 2:
                free[key] = max(0.0, min(whole, float(used[1]) - float(used[0])))
        if self._ray_version is None:
            self._ray_version = str(self.client.version().get("ray_version", "unknown"))
        return {
            "nodes": len(nodes),
            # Each live node's totals (CPU, GPU, custom; not the `node:<ip>` markers): what
            # admission fits one worker's bundle against.
            "node_resources": [{k: float(v) for k, v in (node.get("resources_total") or {}).items()
                                if not k.startswith("node:")} for node in nodes],
            "cpus": {"total": total["CPU"], "free": free["CPU"]},
            "gpus": {"total": total["GPU"], "free": free["GPU"]},
            "ray_version": self._ray_version,
            "dashboard_url": self.dashboard_url,
        }

    def ping(self) -> None:
        self.client.version()
