"""The Ray gateway over Ray's HTTP APIs only: timeouts, errors, token, package upload and
the kill job, against mock transports and silent sockets; one test against real Ray."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from service.gateway import GatewayError, RayGateway, package_uri
from service.settings import Settings
from workers import kill_worker

TRACEBACK_EXISTS = ("Traceback (most recent call last):\n  File \"job_manager.py\", line 550, in submit_job\n"
                    "ValueError: Job with submission_id s1 already exists. Please use a different submission_id.\n")


def settings(tmp_path, url="http://127.0.0.1:8265") -> Settings:
    return Settings(data_dir=tmp_path, dashboard_url=url, token="t", python="/venv/bin/python")


@pytest.fixture(autouse=True)
def token_env(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "ray-secret")


class FakeRay:
    """A dashboard in a dict: what httpx.MockTransport answers, and every request it saw."""

    def __init__(self):
        self.requests: list[httpx.Request] = []
        self.jobs: dict[str, dict] = {}
        self.logs: dict[str, list[str]] = {}
        self.packages: set[str] = set()
        self.actors: list[dict] = []
        self.nodes = [{"node_id": "n1", "state": "ALIVE",
                       "resources_total": {"CPU": 8.0, "GPU": 1.0, "node:10.0.0.1": 1.0, "trainer": 2.0}}]
        self.usage = {"CPU": [3.0, 8.0], "GPU": [1.0, 1.0]}
        self.kill_exit_code = 0

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, req: httpx.Request) -> httpx.Response:
        self.requests.append(req)
        path, method = req.url.path, req.method
        if path == "/api/version":
            return httpx.Response(200, json={"version": "x", "ray_version": "2.60.0"})
        if path.startswith("/api/packages/"):
            name = path.split("/api/packages/", 1)[1]
            if method == "GET":
                return httpx.Response(200 if name in self.packages else 404)
            self.packages.add(name)
            return httpx.Response(200)
        if path == "/api/jobs/" and method == "POST":
            body = json.loads(req.content)
            sid = body["submission_id"]
            if sid in self.jobs:
                return httpx.Response(500, text=TRACEBACK_EXISTS.replace("s1", sid))
            status, code = "PENDING", None
            if "kill_worker" in body["entrypoint"]:
                status, code = ("SUCCEEDED" if self.kill_exit_code == 0 else "FAILED"), self.kill_exit_code
            self.jobs[sid] = {**body, "status": status, "driver_exit_code": code, "job_id": "02000000"}
            return httpx.Response(200, json={"job_id": sid, "submission_id": sid})
        if path == "/api/jobs/" and method == "GET":
            return httpx.Response(200, json=list(self.jobs.values()))
        if path.startswith("/api/jobs/"):
            rest = path[len("/api/jobs/"):]
            sid, _, tail = rest.partition("/")
            job = self.jobs.get(sid)
            if job is None:
                return httpx.Response(404, text=f"Job {sid} does not exist")
            if tail == "logs":
                chunks = self.logs.setdefault(sid, [""])  # each read the next, then the last again
                if len(chunks) > 1:
                    text = chunks.pop(0)
                else:
                    text = chunks[0]
                    if job["status"] == "RUNNING":  # the last output: the job ends
                        job["status"] = "SUCCEEDED"
                return httpx.Response(200, json={"logs": text})
            if tail == "stop":
                job["status"] = "STOPPED"
                return httpx.Response(200, json={"stopped": True})
            return httpx.Response(200, json=job)
        if path == "/api/v0/actors":
            filters = dict(zip(req.url.params.get_list("filter_keys"), req.url.params.get_list("filter_values")))
            rows = [a for a in self.actors if all(str(a.get(k)) == v for k, v in filters.items())]
            return httpx.Response(200, json={"result": True, "msg": "", "data": {"result": {"result": rows}}})
        if path == "/api/v0/nodes":
            return httpx.Response(200, json={"result": True, "msg": "", "data": {"result": {"result": self.nodes}}})
        if path == "/api/cluster_status":
            return httpx.Response(200, json={"result": True, "data": {"clusterStatus": {
                "loadMetricsReport": {"usage": self.usage}}}})
        return httpx.Response(404, text="no such route")


@pytest.fixture
def ray_http():
    return FakeRay()


@pytest.fixture
def gw(tmp_path, ray_http) -> RayGateway:
    return RayGateway(settings(tmp_path), transport=ray_http.transport())


# ---------------------------------------------------------------- timeouts and unreachable Ray


@pytest.fixture
def silent_url():
    """A server that accepts connections and never answers a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held, stop = [], threading.Event()

    def accept():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


def test_every_call_to_a_silent_ray_fails_within_its_timeout(tmp_path, silent_url, monkeypatch):
    monkeypatch.setenv("ETRAIN_RAY_TIMEOUT_S", "0.5")
    monkeypatch.setenv("ETRAIN_RAY_LONG_TIMEOUT_S", "0.8")
    gateway = RayGateway(settings(tmp_path, silent_url))
    code = tmp_path / "code.zip"
    with zipfile.ZipFile(code, "w") as z:
        z.writestr("a.py", "")

    async def tail():
        async for _ in gateway.tail_logs("s1"):
            pass

    calls = {
        "ping": gateway.ping, "status": lambda: gateway.status("s1"), "logs": lambda: gateway.logs("s1"),
        "stop": lambda: gateway.stop("s1"), "cluster": gateway.cluster,
        "submit": lambda: gateway.submit(submission_id="s1", spec_path="/x.json", job_id="j"),
        "submit with code": lambda: gateway.submit(submission_id="s1", spec_path="/x.json", job_id="j",
                                                   code_path=str(code)),
        "kill_process": lambda: gateway.kill_process(pid=1234, node_id="n1"),
        "tail_logs": lambda: asyncio.run(tail()),
    }
    for name, call in calls.items():
        started = time.monotonic()
        with pytest.raises(GatewayError) as e:
            call()
        took = time.monotonic() - started
        assert took < 2.5, f"{name} took {took:.1f}s"
        assert "did not answer" in str(e.value) and "\n" not in str(e.value), (name, str(e.value))


def test_refused_connections_are_one_line_gateway_errors(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gateway = RayGateway(settings(tmp_path, f"http://127.0.0.1:{port}"))
    for call in (gateway.ping, lambda: gateway.status("s1"), gateway.cluster):
        with pytest.raises(GatewayError, match="unreachable") as e:
            call()
        assert "\n" not in str(e.value)


def test_connect_is_harmless_without_ray(tmp_path):
    gateway = RayGateway(settings(tmp_path, "http://127.0.0.1:9"))
    gateway.connect()  # no ray.init, no network
    assert "ray" not in sys.modules or not getattr(sys.modules["ray"], "is_initialized", lambda: False)()


# ---------------------------------------------------------------- the Jobs API


def test_status_of_an_unknown_job_is_none(gw, ray_http, tmp_path):
    assert gw.status("nope") is None
    ray_http.jobs["s1"] = {"status": "RUNNING"}
    assert gw.status("s1") == "RUNNING"
    # A 404 that is not Ray's "does not exist" (a wrong URL, a proxy) is no proof Ray forgot the job.
    elsewhere = RayGateway(settings(tmp_path), transport=httpx.MockTransport(
        lambda req: httpx.Response(404, text="404: Not Found")))
    with pytest.raises(GatewayError, match="no Ray Jobs API"):
        elsewhere.status("s1")


def test_every_status_in_one_call(gw, ray_http):
    ray_http.jobs["s1"] = {"submission_id": "s1", "status": "RUNNING"}
    ray_http.jobs["s2"] = {"submission_id": "s2", "status": "FAILED"}
    ray_http.jobs["driver"] = {"submission_id": None, "status": "RUNNING"}  # a plain `ray.init` driver
    seen = len(ray_http.requests)
    assert gw.job_statuses() == {"s1": "RUNNING", "s2": "FAILED"}
    assert len(ray_http.requests) == seen + 1


def test_submit_sends_the_entrypoint_and_is_idempotent(gw, ray_http):
    gw.submit(submission_id="s1", spec_path="/runs/j/spec.json", job_id="j")
    gw.submit(submission_id="s1", spec_path="/runs/j/spec.json", job_id="j")  # "already exists": no error
    sent = ray_http.jobs["s1"]
    assert sent["entrypoint"] == "exec /venv/bin/python -m workers.run /runs/j/spec.json"
    assert sent["metadata"] == {"etrain_job_id": "j"} and "runtime_env" not in sent
    assert len([r for r in ray_http.requests if r.method == "POST"]) == 2


def test_other_refusals_are_gateway_errors(tmp_path):
    def handle(req):
        return httpx.Response(500, text="Traceback (most recent call last):\n  ...\nRuntimeError: GCS is down\n")

    gateway = RayGateway(settings(tmp_path), transport=httpx.MockTransport(handle))
    with pytest.raises(GatewayError, match="Ray refused job j: .*RuntimeError: GCS is down$"):
        gateway.submit(submission_id="s1", spec_path="/x", job_id="j")
    with pytest.raises(GatewayError, match="GCS is down"):
        gateway.status("s1")


def test_the_ray_token_is_sent_as_ray_sends_it(gw, ray_http, tmp_path, monkeypatch):
    gw.ping()
    gw.status("s1")
    gw.cluster()
    assert ray_http.requests and all(r.headers["authorization"] == "Bearer ray-secret" for r in ray_http.requests)
    # From the token file when RAY_AUTH_TOKEN is not set (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token).
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    (tmp_path / "tok").write_text("from-file\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "tok"))
    fresh = FakeRay()
    RayGateway(settings(tmp_path), transport=fresh.transport()).ping()
    assert fresh.requests[-1].headers["authorization"] == "Bearer from-file"
    # None when token auth is off.
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    off = FakeRay()
    RayGateway(settings(tmp_path), transport=off.transport()).ping()
    assert "authorization" not in off.requests[-1].headers


def test_a_rejected_token_is_said_plainly(tmp_path):
    gateway = RayGateway(settings(tmp_path), transport=httpx.MockTransport(
        lambda req: httpx.Response(403, text="Forbidden: Invalid authentication token")))
    with pytest.raises(GatewayError, match="rejected the token \\(403\\).*RAY_AUTH_TOKEN"):
        gateway.ping()


def test_a_code_archive_is_uploaded_once_and_sent_as_its_gcs_uri(gw, ray_http, tmp_path):
    from ray._private.runtime_env.packaging import get_uri_for_package  # Ray's own naming, to compare

    code = tmp_path / "abc.zip"
    with zipfile.ZipFile(code, "w") as z:
        z.writestr("task.py", "x = 1\n")
    uri = package_uri(code)
    assert uri == get_uri_for_package(code) == f"gcs://_ray_pkg_{hashlib.sha1(code.read_bytes()).hexdigest()}.zip"
    gw.submit(submission_id="s1", spec_path="/x.json", job_id="j", code_path=str(code), requirements=["einops"])
    gw.submit(submission_id="s2", spec_path="/x.json", job_id="j", code_path=str(code))
    puts = [r for r in ray_http.requests if r.method == "PUT"]
    assert [r.url.path for r in puts] == [f"/api/packages/gcs/{uri.split('://')[1]}"]
    assert puts[0].content == code.read_bytes()
    assert ray_http.jobs["s1"]["runtime_env"] == {"working_dir": uri,
                                                 "pip": {"packages": ["einops"], "pip_check": False}}
    assert ray_http.jobs["s1"]["entrypoint"] == "exec python -m workers.run /x.json"
    assert ray_http.jobs["s2"]["runtime_env"] == {"working_dir": uri}


def test_logs_stop_and_tail(gw, ray_http):
    ray_http.jobs["s1"] = {"status": "RUNNING"}
    ray_http.logs["s1"] = ["a\n", "a\nb\n", "a\nb\nc\n"]
    gw.tail_interval_s = 0.01

    async def tail():
        return [chunk async for chunk in gw.tail_logs("s1")]

    assert asyncio.run(tail()) == ["a\n", "b\n", "c\n"]  # each line once; ends with the job
    assert gw.logs("s1") == "a\nb\nc\n"
    gw.stop("s1")
    assert ray_http.jobs["s1"]["status"] == "STOPPED"
    with pytest.raises(GatewayError):
        gw.logs("nope")
    with pytest.raises(GatewayError):
        gw.stop("nope")

    async def unknown():
        return [chunk async for chunk in gw.tail_logs("nope")]

    assert asyncio.run(unknown()) == []  # Ray does not know it: nothing to follow


def test_cluster_totals_and_free_resources(gw, ray_http):
    assert gw.cluster() == {"nodes": 1, "cpus": {"total": 8.0, "free": 5.0}, "gpus": {"total": 1.0, "free": 0.0},
                            "node_resources": [{"CPU": 8.0, "GPU": 1.0, "trainer": 2.0}],
                            "ray_version": "2.60.0", "dashboard_url": "http://127.0.0.1:8265"}
    ray_http.usage = {}  # no autoscaler report: the totals
    assert gw.cluster()["cpus"] == {"total": 8.0, "free": 8.0}


# ---------------------------------------------------------------- killing a worker


def live_actor(pid=4242, **over):
    return {"actor_id": "a1", "class_name": "RayTrainWorker", "state": "ALIVE", "job_id": "02000000",
            "node_id": "n1", "pid": pid, "repr_name": "", **over}


def training_job(ray_http, status="RUNNING", meta=None):
    ray_http.jobs["etrain-j-1"] = {"submission_id": "etrain-j-1", "status": status, "job_id": "02000000",
                                   "metadata": {"etrain_job_id": "j"} if meta is None else meta}


def kill_jobs(ray_http):
    return [json.loads(r.content) for r in ray_http.requests
            if r.method == "POST" and r.url.path == "/api/jobs/" and b"kill_worker" in r.content]


def test_kill_runs_a_kill_job_on_the_workers_node(gw, ray_http):
    ray_http.actors = [live_actor()]
    training_job(ray_http)
    gw.kill_process(pid=4242, node_id="n1")
    [body] = kill_jobs(ray_http)
    assert body["entrypoint"] == "/venv/bin/python -m workers.kill_worker --pid 4242 --title ray::RayTrainWorker"
    assert body["entrypoint_label_selector"] == {"ray.io/node-id": "n1"}
    [kill_id] = [sid for sid in ray_http.jobs if sid.startswith("etrain-kill-")]
    assert "etrain_job_id" not in ray_http.jobs[kill_id]["metadata"]  # never taken for a training job


@pytest.mark.parametrize("case", ["no actor", "other node", "dead job", "not ours", "other submission",
                                  "gone on the node"])
def test_kill_refuses_what_is_not_a_live_worker_of_a_running_job(gw, ray_http, case):
    ray_http.actors = [live_actor()]
    training_job(ray_http)
    node, hints = "n1", {}
    if case == "no actor":
        ray_http.actors = []
    elif case == "other node":
        node = "n2"
    elif case == "dead job":
        training_job(ray_http, status="SUCCEEDED")
    elif case == "not ours":
        training_job(ray_http, meta={"someone": "else"})
    elif case == "other submission":
        hints = {"submission_id": "etrain-j-2"}
    else:
        ray_http.kill_exit_code = kill_worker.NOT_LIVE
    with pytest.raises(ProcessLookupError):
        gw.kill_process(pid=4242, node_id=node, **hints)
    assert len(kill_jobs(ray_http)) == (1 if case == "gone on the node" else 0)


def test_a_kill_job_that_fails_otherwise_is_a_gateway_error(gw, ray_http):
    ray_http.actors = [live_actor()]
    training_job(ray_http)
    ray_http.kill_exit_code = 1
    with pytest.raises(GatewayError, match="exit code 1"):
        gw.kill_process(pid=4242, node_id="n1")


# ---------------------------------------------------------------- workers.kill_worker on this machine


@pytest.fixture
def fake_worker():
    """A process titled like a busy Ray worker (`ray::FakeWorker.run`)."""
    proc = subprocess.Popen(["bash", "-c", 'exec -a "ray::FakeWorker.run" sleep 60'])
    deadline = time.time() + 10
    while kill_worker.title_of(proc.pid) and not kill_worker.title_of(proc.pid).startswith(b"ray::"):
        assert time.time() < deadline
        time.sleep(0.01)
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_kill_worker_kills_only_a_busy_ray_worker(fake_worker, tmp_path):
    idle = subprocess.Popen(["bash", "-c", 'exec -a "ray::IDLE" sleep 60'])
    plain = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.2)
        assert kill_worker.main(["--pid", str(idle.pid)]) == kill_worker.NOT_LIVE
        assert kill_worker.main(["--pid", str(plain.pid)]) == kill_worker.NOT_LIVE
        assert idle.poll() is None and plain.poll() is None
        assert kill_worker.main(["--pid", str(fake_worker.pid), "--title", "ray::FakeWorkerX"]) == kill_worker.NOT_LIVE
        assert kill_worker.main(["--pid", str(fake_worker.pid), "--title", "ray::FakeWorker"]) == kill_worker.KILLED
        assert fake_worker.wait(timeout=10) == -9
        assert kill_worker.main(["--pid", str(fake_worker.pid)]) == kill_worker.NOT_LIVE  # gone
    finally:
        for p in (idle, plain):
            p.kill()
            p.wait()


def test_kill_worker_imports_neither_ray_nor_the_service():
    code = ("import sys, workers.kill_worker; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'service', 'api')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


# ---------------------------------------------------------------- against a real Ray


ACTOR_JOB = """
import os, time, ray
ray.init()

@ray.remote(num_cpus=0)
class Sleeper:
    def pid(self):
        return os.getpid()
    def run(self):
        time.sleep(600)

a, b = Sleeper.remote(), Sleeper.remote()
print("PIDS", ray.get(a.pid.remote()), ray.get(b.pid.remote()), flush=True)
a.run.remote()
ray.get(b.run.remote())
"""


def wait_until(what, fn, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"no {what} after {timeout}s")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.ray
def test_gateway_against_real_ray(ray_cluster, tmp_path, monkeypatch):
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", ray_cluster.env.get("RAY_AUTH_MODE", "token"))
    gateway = RayGateway(Settings(data_dir=tmp_path, dashboard_url=ray_cluster.dashboard, token="t",
                                  python=sys.executable))
    gateway.ping()
    facts = gateway.cluster()
    assert facts["nodes"] == 1 and facts["cpus"]["total"] == 8 and facts["ray_version"] == "2.60.0"
    assert facts["node_resources"][0]["CPU"] == 8
    assert gateway.status("etrain-no-such-job") is None

    # submit with a code archive (uploaded, sent as gcs://), idempotently; a missing spec fails fast.
    code = tmp_path / "code.zip"
    with zipfile.ZipFile(code, "w") as z:
        z.writestr("marker.txt", "x")
    sid = f"etrain-gw-{os.getpid()}-1"
    for _ in range(2):
        gateway.submit(submission_id=sid, spec_path=str(tmp_path / "missing.yaml"), job_id="gw", code_path=str(code))
    wait_until("end of the bad-spec job", lambda: gateway.status(sid) in ("SUCCEEDED", "FAILED"))
    assert gateway.status(sid) == "FAILED"
    assert gateway.client.job_info(sid)["runtime_env"]["working_dir"] == package_uri(code)
    assert "missing.yaml" in gateway.logs(sid)

    # A job whose driver made two actors, as Ray Train's does: the gateway kills only a live one.
    script = tmp_path / "actors.py"
    script.write_text(ACTOR_JOB)
    actors_sid = f"etrain-gw-{os.getpid()}-2"
    gateway.client.submit_job(entrypoint=f"{sys.executable} {script}", submission_id=actors_sid,
                              metadata={"etrain_job_id": "gw-actors"})
    line = wait_until("actor pids", lambda: next((ln for ln in gateway.logs(actors_sid).splitlines()
                                                   if ln.startswith("PIDS ")), None))
    busy, other = (int(p) for p in line.split()[1:])
    # The session's head: earlier tests joined worker nodes to it and stopped them, and
    # Ray's node list keeps those, DEAD, in any order.
    nodes = gateway.client.state_list("nodes")
    node = next(n["node_id"] for n in nodes if n["is_head_node"] and n["state"] == "ALIVE")
    with pytest.raises(ProcessLookupError):  # a live process, but not a Ray actor
        gateway.kill_process(pid=os.getpid(), node_id=node)
    with pytest.raises(ProcessLookupError):  # the right actor, named with another job's submission
        gateway.kill_process(pid=busy, node_id=node, submission_id=sid)
    # Ray's state API and its job table are read separately and can trail the PIDS line
    # by a moment on a loaded machine (once in CI: ProcessLookupError here). Wait until
    # both show what kill_process checks, then it must kill.
    try:
        wait_until("the actor, live, in the job's running submission",
                   lambda: (actor := gateway._live_actor(busy, node)) is not None
                   and gateway._owner(actor, actors_sid, "gw-actors") is not None, timeout=60)
    except pytest.fail.Exception:
        seen = gateway.client.state_list("actors", [("pid", str(busy))], detail=True)
        pytest.fail(f"node {node}, nodes {gateway.client.state_list('nodes')}, actors with pid {busy}: {seen}, "
                    f"job {gateway.client.job_info(actors_sid)}")
    gateway.kill_process(pid=busy, node_id=node, submission_id=actors_sid, job_id="gw-actors")
    wait_until("the killed worker gone", lambda: not alive(busy), timeout=30)
    assert alive(other)
    with pytest.raises(ProcessLookupError):  # now dead
        gateway.kill_process(pid=busy, node_id=node)

    # stop, and a followed log ends with the job.
    gateway.stop(actors_sid)
    wait_until("the stopped job", lambda: gateway.status(actors_sid) == "STOPPED", timeout=60)

    async def follow():
        return "".join([chunk async for chunk in gateway.tail_logs(actors_sid)])

    assert "PIDS" in asyncio.run(asyncio.wait_for(follow(), 60))
    kills = [j for j in gateway.client.list_jobs() if (j.get("submission_id") or "").startswith("etrain-kill-")]
    assert [(j["status"], j["metadata"]["etrain_kill_pid"]) for j in kills] == [("SUCCEEDED", str(busy))]
