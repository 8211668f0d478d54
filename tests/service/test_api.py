"""The REST API on a FakeGateway: every bad input gets its status and a message naming the
problem (DESIGN.md invariant 6), auth on every /v1 route (invariant 7), idempotent
submission (invariant 5), listing, health and metrics. No Ray, no subprocess."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from api.app import create_app
from api.deps import get_gateway
from service import ledger
from service.gateway import GatewayError
from service.lifecycle import JobState
from service.settings import Settings
from tests.fakes import FakeGateway
from workers import events

TOKEN = "api-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_BODY = 4096


def small(job_id: str | None = None, **over) -> dict:
    body = {"model": "simple_cnn", "workers": 2, "dataset": {"name": "synthetic", "size": 64},
            "training": {"max_steps": 4, "global_batch_size": 8}}
    if job_id:
        body["job_id"] = job_id
    return {**body, **over}


def assert_no_traceback(response) -> None:
    assert "Traceback" not in response.text and 'File "' not in response.text, response.text


def assert_clean(response) -> None:
    """Never a 5xx, never a traceback in a body."""
    assert response.status_code < 500, response.text
    assert_no_traceback(response)


class DownGateway(FakeGateway):
    """Ray refuses submissions (and cannot say how big the cluster is)."""

    def submit(self, **kw) -> None:
        raise GatewayError("connection refused")

    def cluster(self):
        raise GatewayError("connection refused")


class UnreachableGateway(FakeGateway):
    def ping(self) -> None:
        raise GatewayError("Ray Jobs API unreachable")


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(data_dir=tmp_path / "data", token=TOKEN, storage=None, dataset_roots=[],
                    max_body_bytes=MAX_BODY)


@pytest.fixture
def gateway() -> FakeGateway:
    return FakeGateway()


def job_count(app) -> int:
    return ledger.job_rows(app.state.ledger)[1]


def run_dirs(settings) -> list[str]:
    return sorted(os.listdir(settings.runs_dir)) if os.path.isdir(settings.runs_dir) else []


def create(client, body=None, **headers) -> dict:
    r = client.post("/v1/jobs", json=body or small(), headers=headers)
    assert r.status_code == 201, r.text
    return r.json()


def move(app, job_id: str, *states: JobState) -> None:
    """Walk a job through legal transitions, as the reconciler would."""
    for state in states:
        ledger.update_job(app.state.ledger, job_id=job_id, state=state)


# ---------------------------------------------------------------- submission


def test_valid_job_is_created_submitted_and_stored(client, app, settings, gateway):
    job = create(client, small("ok-1"))
    assert job["id"] == "ok-1"
    assert job["state"] == "SUBMITTED"
    assert job["submission_id"] == "etrain-ok-1-1"
    assert job["dashboard_url"].endswith("/#/jobs/etrain-ok-1-1")
    assert job["spec"]["storage"] == settings.runs_dir  # chosen by the service
    assert list(gateway.submitted) == ["etrain-ok-1-1"]
    spec_path = gateway.submitted["etrain-ok-1-1"]["spec_path"]
    assert spec_path == os.path.join(settings.runs_dir, "ok-1", "spec.json")
    assert json.loads(open(spec_path).read())["job_id"] == "ok-1"
    assert client.get("/v1/jobs/ok-1").json()["state"] == "SUBMITTED"
    assert job_count(app) == 1


def test_ray_down_job_is_acknowledged_and_waits_queued(settings):
    gateway = DownGateway()
    app = create_app(settings, gateway, reconcile=False)
    with TestClient(app, headers=AUTH) as client:
        job = create(client, small("later"))
        assert job["state"] == "QUEUED"
        assert job_count(app) == 1
        assert gateway.submitted == {}


# ---------------------------------------------------------------- bad input: 422

BAD_SPECS = [
    # (body, field named in the message, words the message must also contain)
    ({"model": "gpt5"}, "model.name", ["simple_cnn", "resnet18", "mlp"]),
    ({"model": {"name": "gpt5"}}, "model.name", ["simple_cnn", "resnet18", "mlp"]),
    ({"dataset": "imagenet"}, "dataset.name", ["mnist", "cifar10", "synthetic", "idx"]),
    ({"strategy": "zero3"}, "strategy", ["ddp", "fsdp"]),
    ({"workers": -1}, "workers", ["greater than or equal to 1"]),
    ({"workers": 0}, "workers", ["greater than or equal to 1"]),
    ({"workers": 10**12}, "workers", ["less than or equal to 4096"]),
    ({"workers": "two"}, "workers", ["integer"]),
    ({"training": {"global_batch_size": 0}}, "training.global_batch_size", ["greater than or equal to 1"]),
    ({"training": {"lr": -1}}, "training.lr", ["greater than 0"]),
    ({"training": {"lr": 1e30}}, "training.lr", ["less than or equal to 100"]),
    ({"training": {"max_steps": -5}}, "training.max_steps", ["greater than or equal to 1"]),
    ({"training": {"optimizer": "lion"}}, "training.optimizer", ["sgd", "adam", "adamw"]),
    ({"dataset": {"name": "synthetic", "size": -1}}, "dataset.size", ["greater than or equal to 16"]),
    ({"checkpoint": {"every_steps": 0}}, "checkpoint.every_steps", ["greater than or equal to 1"]),
    ({"resources": {"cpu": 0}}, "resources.cpu", ["greater than 0"]),
    ({"resources": {"gpu": -1}}, "resources.gpu", ["greater than or equal to 0"]),
    ({"max_step": 3}, "max_step", ["not permitted"]),
    ({"job_id": "../../etc"}, "job_id", ["pattern"]),
    ({"precision": "fp8"}, "precision", ["fp32", "bf16", "fp16"]),
    ({"training": {"global_batch_size": 1}}, "global_batch_size", ["smaller than", "workers"]),
    ({"model": "gpt", "dataset": "synthetic_tokens", "strategy": "hybrid", "workers": 4, "parallel": {"tensor": 3}},
     "body", ["degrees must multiply", "parallel.tensor (3)", "workers (4)"]),
    ({"faults": [{"at_step": 1, "rank": 5, "kind": "crash"}]}, "faults", ["rank 5"]),
    ({"faults": [{"at_step": 1, "kind": "meteor"}]}, "faults.0.kind", ["crash", "exception", "hang"]),
]


@pytest.mark.parametrize(("over", "field", "words"), BAD_SPECS, ids=[json.dumps(b[0])[:50] for b in BAD_SPECS])
def test_invalid_spec_is_422_naming_the_field(client, app, settings, gateway, over, field, words):
    r = client.post("/v1/jobs", json=small(**over))
    assert_clean(r)
    assert r.status_code == 422, r.text
    body = r.json()
    assert field in body["message"], body
    for word in words:
        assert word in body["message"], body
    assert any(field.split(".")[0] in [str(p) for p in e["loc"]] or field in e["msg"] for e in body["detail"]), body
    assert job_count(app) == 0 and run_dirs(settings) == [] and gateway.submitted == {}


def test_storage_in_the_body_is_rejected(client, app, settings):
    r = client.post("/v1/jobs", json=small(storage="/tmp/elsewhere"))
    assert_clean(r)
    assert r.status_code == 422
    assert r.json()["message"].startswith("storage:") and "chosen by the service" in r.json()["message"]
    assert r.json()["detail"][0]["loc"] == ["body", "storage"]
    assert job_count(app) == 0 and run_dirs(settings) == []


def test_a_service_configured_with_storage_that_cannot_work_refuses_to_start_naming_why(tmp_path, monkeypatch):
    monkeypatch.setenv("ETRAIN_STORAGE", "nosuch://bucket/runs")
    with pytest.raises(ValidationError, match="storage 'nosuch://bucket/runs': no filesystem for nosuch://"):
        Settings(data_dir=tmp_path)
    monkeypatch.setenv("ETRAIN_STORAGE", "s3://bucket/runs/")
    assert Settings(data_dir=tmp_path).runs_dir == "s3://bucket/runs"


def _outside_paths(settings) -> list[tuple[str, dict]]:
    inside = settings.data_dir / "datasets"
    return [
        ("root", {"name": "image_folder", "root": "/etc"}),
        ("root", {"name": "image_folder", "root": "datasets/mine"}),  # relative
        ("root", {"name": "image_folder", "root": str(inside / ".." / "token")}),  # escapes by ..
        ("root", {"name": "image_folder", "root": str(inside) + "-evil"}),  # a sibling with the same prefix
        ("root", {"name": "mnist", "root": "/etc/\x00passwd"}),  # NUL byte
        ("images", {"name": "idx", "images": "/etc/passwd", "labels": str(inside / "l.idx")}),
        ("labels", {"name": "idx", "images": str(inside / "i.idx"), "labels": "../labels.idx"}),
    ]


@pytest.mark.parametrize("case", range(7))
def test_dataset_path_outside_the_allowed_roots_is_rejected(client, app, settings, gateway, case):
    field, dataset = _outside_paths(settings)[case]
    r = client.post("/v1/jobs", json=small(dataset=dataset))
    assert_clean(r)
    assert r.status_code == 422, r.text
    assert f"dataset.{field}" in r.json()["message"], r.json()
    assert r.json()["detail"][0]["loc"] == ["body", "dataset", field]
    assert job_count(app) == 0 and run_dirs(settings) == [] and gateway.submitted == {}


def test_dataset_path_inside_an_allowed_root_is_accepted(client, settings):
    inside = settings.data_dir / "datasets" / "mnist"
    job = create(client, small(dataset={"name": "mnist", "root": str(inside), "download": False}))
    assert job["spec"]["dataset"]["root"] == str(inside)


def test_extra_dataset_roots_are_allowed(tmp_path):
    extra = tmp_path / "shared-data"
    extra.mkdir()
    settings = Settings(data_dir=tmp_path / "d", token=TOKEN, storage=None, dataset_roots=[extra])
    with TestClient(create_app(settings, FakeGateway(), reconcile=False), headers=AUTH) as client:
        create(client, small(dataset={"name": "image_folder", "root": str(extra / "cats")}))
        r = client.post("/v1/jobs", json=small(dataset={"name": "image_folder", "root": str(tmp_path / "other")}))
        assert r.status_code == 422 and str(extra) in r.json()["message"]


def test_custom_model_is_accepted_unless_the_operator_turned_code_off(client, app, settings, tmp_path):
    body = small(model={"name": "custom", "factory": "os:system"})
    assert client.post("/v1/jobs", json=body).status_code == 201  # users' code is on by default

    off = Settings(data_dir=tmp_path / "off", token=TOKEN, storage=None, allow_code=False)
    with TestClient(create_app(off, FakeGateway(), reconcile=False), headers=AUTH) as other:
        r = other.post("/v1/jobs", json=body)
        assert_clean(r)
        assert r.status_code == 403
        assert "ETRAIN_ALLOW_CODE=false" in r.json()["detail"] and "model 'custom'" in r.json()["detail"]
        assert "simple_cnn" in r.json()["detail"]
        assert job_count(other.app) == 0 and run_dirs(off) == []


def test_more_workers_than_the_cluster_can_ever_hold_is_rejected(settings):
    gateway = FakeGateway(cpus=4)
    app = create_app(settings, gateway, reconcile=False)
    with TestClient(app, headers=AUTH) as client:
        r = client.post("/v1/jobs", json=small(workers=8))
        assert_clean(r)
        assert r.status_code == 422
        message = r.json()["message"]
        assert message.startswith("workers:") and "8 CPUs" in message and "4 CPUs" in message
        r = client.post("/v1/jobs", json=small(workers=2, resources={"gpu": 1}))
        assert r.status_code == 422 and "GPUs" in r.json()["message"]
        assert job_count(app) == 0 and run_dirs(settings) == [] and gateway.submitted == {}
        assert client.post("/v1/jobs", json=small(workers=4)).status_code == 201  # exactly fits


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"spec"', b"42", b"null", b"{not json", b"", b'{"workers": 2,}'])
def test_a_body_that_is_not_a_json_object_is_422(client, app, settings, raw):
    r = client.post("/v1/jobs", content=raw, headers={"Content-Type": "application/json"})
    assert_clean(r)
    assert r.status_code == 422, r.text
    assert r.json().get("message") or r.json().get("detail")
    assert job_count(app) == 0 and run_dirs(settings) == []


@pytest.mark.parametrize("query", ["state=BOGUS", "limit=0", "limit=501", "offset=-1", "limit=ten"])
def test_bad_list_parameters_are_422(client, query):
    r = client.get(f"/v1/jobs?{query}")
    assert_clean(r)
    assert r.status_code == 422
    assert query.split("=")[0] in r.json()["message"]


def test_idempotency_key_too_long_is_422(client, app):
    r = client.post("/v1/jobs", json=small(), headers={"Idempotency-Key": "k" * 256})
    assert r.status_code == 422 and "idempotency-key" in r.json()["message"].lower()
    assert job_count(app) == 0


def test_fault_rank_that_does_not_exist_is_422(client, app, settings):
    job = create(client, small("f-rank"))
    move(app, job["id"], JobState.RUNNING)
    for rank in (-1, 2, 99):
        r = client.post(f"/v1/jobs/{job['id']}/faults", json={"rank": rank})
        assert_clean(r)
        assert r.status_code == 422, r.text
        assert "rank" in json.dumps(r.json())


# ---------------------------------------------------------------- 404, 409


def _routes(app, where) -> list[tuple[str, str]]:
    """(METHOD, path) of every operation the app publishes (its OpenAPI document)."""
    return [(method.upper(), path) for path, ops in app.openapi()["paths"].items() if where(path)
            for method in ops]


def _job_routes(app) -> list[tuple[str, str]]:
    return _routes(app, lambda path: "{job_id}" in path)


def test_every_job_route_is_covered(app):
    paths = {p for _, p in _job_routes(app)}
    assert {"/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel", "/v1/jobs/{job_id}/logs", "/v1/jobs/{job_id}/metrics",
            "/v1/jobs/{job_id}/events", "/v1/jobs/{job_id}/checkpoints", "/v1/jobs/{job_id}/faults"} <= paths


def test_unknown_job_is_404_on_every_job_route(client, app):
    create(client, small("exists"))
    routes = _job_routes(app)
    assert len(routes) >= 7
    for method, path in routes:
        r = client.request(method, path.replace("{job_id}", "no-such-job"))
        assert_clean(r)
        assert r.status_code == 404, (method, path, r.text)
        assert "no-such-job" in r.json()["detail"]
    assert client.get("/v1/jobs/exists").status_code == 200


@pytest.mark.parametrize("final", [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED])
def test_cancelling_a_finished_job_is_409(client, app, gateway, final):
    job = create(client, small("done"))
    move(app, job["id"], JobState.RUNNING, final)
    r = client.post("/v1/jobs/done/cancel")
    assert_clean(r)
    assert r.status_code == 409, r.text
    assert final.value in r.json()["detail"] and "CANCELLED" in r.json()["detail"]
    assert client.get("/v1/jobs/done").json()["state"] == final.value
    assert gateway.stopped == []


def test_cancelling_a_live_job_asks_ray_to_stop_it(client, app, gateway):
    job = create(client, small("live"))
    r = client.post("/v1/jobs/live/cancel")
    assert r.status_code == 200
    assert gateway.stopped == [job["submission_id"]]
    assert ledger.get_job(app.state.ledger, job_id="live").cancel_requested
    assert client.post("/v1/jobs/live/cancel").status_code == 200  # asking twice is fine


def test_cancelling_a_job_that_was_never_handed_to_ray_ends_it_at_once(client, app):
    job = create(client, small("never"))
    with app.state.ledger() as s:  # as if the request died between the ledger and Ray
        s.get(ledger.Job, job["id"]).state, s.get(ledger.Job, job["id"]).submission_id = "QUEUED", None
        s.commit()
    r = client.post("/v1/jobs/never/cancel")
    assert r.status_code == 200 and r.json()["state"] == "CANCELLED"


def training(rd: str, pids: dict[int, int], attempt: int = 1, *, new_driver: bool = False) -> None:
    """The run record of an attempt whose workers are up and have completed a step."""
    if new_driver or attempt == 1:
        events.emit(rd, "job_started", pid=1)
    events.emit(rd, "attempt_started", attempt=attempt, world_size=2, from_step=0)
    for rank, pid in pids.items():
        events.emit(rd, "worker_started", attempt=attempt, rank=rank, pid=pid, node_id="n1")
    events.emit(rd, "training_started", attempt=attempt, world_size=2, total_steps=4, from_step=0)
    if attempt > 1:
        events.emit(rd, "resumed", attempt=attempt, from_step=0, lost_steps=1, recovery_s=1.0)
    events.log_metrics(rd, step=1, epoch=0, loss=1.0, attempt=attempt)


@pytest.mark.parametrize(("states", "says"), [
    ((), "job idle is starting: its workers are not up yet; try again once it is training"),
    ((JobState.RUNNING, JobState.SUCCEEDED), "job idle has ended (SUCCEEDED)"),
    ((JobState.CANCELLED,), "job idle has ended (CANCELLED)"),
], ids=["submitted", "succeeded", "cancelled"])
def test_fault_on_a_job_that_is_not_training_is_409_saying_what_it_does(client, app, gateway, states, says):
    job = create(client, small("idle"))
    move(app, job["id"], *states)
    r = client.post("/v1/jobs/idle/faults", json={"rank": 0})
    assert_clean(r)
    assert r.status_code == 409, r.text
    assert r.json()["detail"].startswith(says), r.json()
    assert gateway.killed == []


def test_fault_while_the_workers_set_up_is_409_starting(client, app, settings, gateway):
    # Workers exist (worker_started) but none has completed a step: not yet training.
    job = create(client, small("setting-up"))
    rd = os.path.join(settings.runs_dir, "setting-up")
    events.emit(rd, "job_started", pid=1)
    events.emit(rd, "attempt_started", attempt=1, world_size=2, from_step=0)
    for rank, pid in ((0, 1000), (1, 1001)):
        events.emit(rd, "worker_started", attempt=1, rank=rank, pid=pid, node_id="n1")
    events.emit(rd, "training_started", attempt=1, world_size=2, total_steps=4, from_step=0)
    progress = client.get("/v1/jobs/setting-up").json()["progress"]
    assert progress["phase"] == "starting" and progress["total_steps"] == 4
    r = client.post(f"/v1/jobs/{job['id']}/faults", json={"rank": 1})
    assert r.status_code == 409 and "is starting: its workers are not up yet" in r.json()["detail"]
    assert gateway.killed == []


def test_fault_while_recovering_is_409_naming_the_failure(client, app, settings, gateway):
    job = create(client, small("mending"))
    rd = os.path.join(settings.runs_dir, "mending")
    training(rd, {0: 1000, 1: 1001})
    events.emit(rd, "worker_failed", rank=0, classification="infrastructure", error="gloo: connection closed")
    events.emit(rd, "worker_failed", rank=1, classification="infrastructure", error="worker process died",
                process_died=True)
    assert client.get("/v1/jobs/mending").json()["progress"]["phase"] == "recovering"
    r = client.post(f"/v1/jobs/{job['id']}/faults", json={"rank": 0})
    assert r.status_code == 409, r.text
    assert r.json()["detail"] == ("job mending is recovering from a failure of rank 1 (worker process died); "
                                  "its workers are being restarted")
    events.emit(rd, "backoff", attempt=2, delay_s=8, reason="the previous attempts failed at the same step")
    detail = client.post(f"/v1/jobs/{job['id']}/faults", json={"rank": 0}).json()["detail"]
    assert detail.endswith("after a back-off of 8s (repeated failures at one step)"), detail
    assert gateway.killed == []


def test_fault_on_a_training_job_kills_the_worker_of_that_rank(client, app, settings, gateway):
    job = create(client, small("busy"))
    rd = os.path.join(settings.runs_dir, "busy")
    training(rd, {0: 1000, 1: 1001})
    public = client.get("/v1/jobs/busy").json()
    assert public["progress"]["phase"] == "training" and public["state"] == "SUBMITTED"  # the reconciler is off
    r = client.post(f"/v1/jobs/{job['id']}/faults", json={"rank": 1})
    assert r.status_code == 202, r.text
    assert r.json() == {"job_id": "busy", "rank": 1, "pid": 1001, "node_id": "n1"}
    assert gateway.killed == [(1001, "n1")]
    r = client.post(f"/v1/jobs/{job['id']}/faults", json={})  # a random rank: one that runs
    assert r.status_code == 202 and r.json()["pid"] in (1000, 1001)


def test_fault_never_kills_a_pid_of_an_earlier_attempt_or_driver(client, app, settings, gateway):
    # Those processes have ended and their pids may belong to anything now.
    job = create(client, small("again", workers=2))
    rd = os.path.join(settings.runs_dir, "again")
    training(rd, {0: 1000, 1: 1001})
    events.emit(rd, "worker_failed", rank=1, classification="infrastructure", process_died=True)
    training(rd, {0: 2000}, attempt=2)  # rank 1 of attempt 2 has not written where it runs yet
    r = client.post(f"/v1/jobs/{job['id']}/faults", json={"rank": 1})
    assert r.status_code == 409 and "no worker of rank 1 in its current attempt" in r.json()["detail"], r.text
    events.emit(rd, "driver_lost", error="driver process lost")
    training(rd, {1: 3001}, attempt=3, new_driver=True)
    r = client.post(f"/v1/jobs/{job['id']}/faults", json={"rank": 0})
    assert r.status_code == 409 and "no worker of rank 0" in r.json()["detail"], r.text
    assert client.post(f"/v1/jobs/{job['id']}/faults", json={"rank": 1}).json()["pid"] == 3001
    assert gateway.killed == [(3001, "n1")]


def test_fault_on_a_worker_that_already_exited_is_409(settings):
    class Gone(FakeGateway):
        def kill_process(self, *, pid, node_id, **_):
            raise ProcessLookupError(pid)

    with TestClient(create_app(settings, Gone(), reconcile=False), headers=AUTH) as client:
        create(client, small("gone"))
        training(os.path.join(settings.runs_dir, "gone"), {0: 1000, 1: 1001})
        r = client.post("/v1/jobs/gone/faults", json={"rank": 1})
        assert r.status_code == 409 and "already exited" in r.json()["detail"]


# ---------------------------------------------------------------- 413


def test_body_over_the_limit_with_content_length_is_413(client, app, settings):
    body = json.dumps(small(model={"name": "simple_cnn", "factory": None}, job_id="big") | {"pad": "x" * MAX_BODY})
    r = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
    assert_clean(r)
    assert r.status_code == 413, r.text
    assert str(MAX_BODY) in r.json()["detail"]
    assert job_count(app) == 0 and run_dirs(settings) == []


def test_body_over_the_limit_without_content_length_is_413(client, app, settings):
    def chunks():
        yield b'{"job_id": "streamed", "pad": "'
        for _ in range(MAX_BODY // 256 + 2):
            yield b"x" * 256
        yield b'"}'

    r = client.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.request.headers.get("content-length") is None  # really streamed
    assert_clean(r)
    assert r.status_code == 413, r.text
    assert job_count(app) == 0 and run_dirs(settings) == []


def test_streamed_body_under_the_limit_is_accepted(client, app):
    def chunks():
        data = json.dumps(small("streamed-ok")).encode()
        for i in range(0, len(data), 16):
            yield data[i:i + 16]

    r = client.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 201, r.text
    assert r.json()["id"] == "streamed-ok"


# ---------------------------------------------------------------- 401


def _v1_routes(app) -> list[tuple[str, str]]:
    return _routes(app, lambda path: path.startswith("/v1"))


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-token"},
                                     {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": f"Basic {TOKEN}"},
                                     {"Authorization": TOKEN}, {"Authorization": "Bearer "}],
                         ids=["missing", "wrong", "longer", "basic", "bare", "empty"])
def test_every_v1_route_needs_the_token(app, settings, gateway, headers):
    with TestClient(app) as client:
        client.post("/v1/jobs", json=small("mine"), headers=AUTH)
        routes = _v1_routes(app)
        assert len(routes) >= 9
        for method, path in routes:
            kw = {"json": small("intruder")} if (method, path) == ("POST", "/v1/jobs") else {}
            r = client.request(method, path.replace("{job_id}", "mine"), headers=headers, **kw)
            assert_clean(r)
            assert r.status_code == 401, (method, path, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            assert "mine" not in r.text
        assert job_count(app) == 1 and run_dirs(settings) == ["mine"]
        assert len(gateway.submitted) == 1 and gateway.stopped == [] and gateway.killed == []


def test_health_and_metrics_need_no_token(app):
    with TestClient(app) as client:
        for path in ("/healthz", "/readyz", "/metrics"):
            assert client.get(path).status_code == 200, path


# ---------------------------------------------------------------- idempotency


def test_same_idempotency_key_twice_is_the_same_job(client, app, settings, gateway):
    first = client.post("/v1/jobs", json=small(), headers={"Idempotency-Key": "k-1"})
    second = client.post("/v1/jobs", json=small(), headers={"Idempotency-Key": "k-1"})
    assert (first.status_code, second.status_code) == (201, 200)
    assert first.json()["id"] == second.json()["id"]
    assert first.json()["submission_id"] == second.json()["submission_id"]
    assert len(gateway.submitted) == 1
    assert job_count(app) == 1 and run_dirs(settings) == [first.json()["id"]]


def test_same_idempotency_key_with_explicit_job_id_twice_is_the_same_job(client, app, gateway):
    first = client.post("/v1/jobs", json=small("named"), headers={"Idempotency-Key": "k-2"})
    second = client.post("/v1/jobs", json=small("named"), headers={"Idempotency-Key": "k-2"})
    assert (first.status_code, second.status_code) == (201, 200)
    assert len(gateway.submitted) == 1 and job_count(app) == 1


@pytest.mark.parametrize("second", [small(workers=4), small(training={"max_steps": 5, "global_batch_size": 8}),
                                    small("another-name"), small(model="mlp")],
                         ids=["workers", "training", "job_id", "model"])
def test_same_idempotency_key_with_a_different_body_is_409(client, app, settings, gateway, second):
    first = client.post("/v1/jobs", json=small(), headers={"Idempotency-Key": "k-3"})
    assert first.status_code == 201
    r = client.post("/v1/jobs", json=second, headers={"Idempotency-Key": "k-3"})
    assert_clean(r)
    assert r.status_code == 409, r.text
    assert "Idempotency-Key" in r.json()["detail"] and first.json()["id"] in r.json()["detail"]
    assert len(gateway.submitted) == 1 and job_count(app) == 1 and run_dirs(settings) == [first.json()["id"]]


def test_without_a_key_the_same_body_makes_two_jobs(client, app, gateway):
    create(client, small())
    create(client, small())
    assert job_count(app) == 2 and len(gateway.submitted) == 2


def test_reusing_a_job_id_is_409_and_changes_nothing(client, app, gateway):
    job = create(client, small("dup"))
    r = client.post("/v1/jobs", json=small("dup", workers=4))
    assert_clean(r)
    assert r.status_code == 409 and "dup" in r.json()["detail"]
    assert job_count(app) == 1 and len(gateway.submitted) == 1
    assert client.get("/v1/jobs/dup").json()["spec"]["workers"] == job["spec"]["workers"] == 2


def test_fifty_concurrent_posts_with_one_key_make_one_job(client, app, settings, gateway):
    def post(_):
        return client.post("/v1/jobs", json=small(), headers={"Idempotency-Key": "race"})

    with ThreadPoolExecutor(50) as pool:
        responses = list(pool.map(post, range(50)))
    for r in responses:
        assert_clean(r)
    codes = sorted(r.status_code for r in responses)
    assert codes.count(201) == 1 and codes.count(200) == 49, codes
    assert len({r.json()["id"] for r in responses}) == 1
    assert len(gateway.submitted) == 1
    assert job_count(app) == 1 and len(run_dirs(settings)) == 1


# ---------------------------------------------------------------- listing


def test_list_is_newest_first_paginated_and_filtered(client, app):
    ids = [create(client, small(f"j{i}"))["id"] for i in range(7)]
    newest_first = ids[::-1]
    page = client.get("/v1/jobs?limit=3").json()
    assert page["count"] == 7 and [j["id"] for j in page["data"]] == newest_first[:3]
    page = client.get("/v1/jobs?limit=3&offset=3").json()
    assert page["count"] == 7 and [j["id"] for j in page["data"]] == newest_first[3:6]
    page = client.get("/v1/jobs?limit=3&offset=6").json()
    assert [j["id"] for j in page["data"]] == newest_first[6:]
    assert client.get("/v1/jobs?offset=50").json() == {"data": [], "count": 7}
    assert [j["id"] for j in client.get("/v1/jobs").json()["data"]] == newest_first

    move(app, "j2", JobState.RUNNING)
    move(app, "j4", JobState.RUNNING, JobState.SUCCEEDED)
    running = client.get("/v1/jobs?state=RUNNING").json()
    assert running["count"] == 1 and [j["id"] for j in running["data"]] == ["j2"]
    submitted = client.get("/v1/jobs?state=SUBMITTED&limit=2").json()
    assert submitted["count"] == 5 and [j["id"] for j in submitted["data"]] == ["j6", "j5"]
    assert client.get("/v1/jobs?state=FAILED").json() == {"data": [], "count": 0}


# ---------------------------------------------------------------- what a job shows


def test_job_views_read_the_run_directory(client, settings):
    create(client, small("seen"))
    rd = os.path.join(settings.runs_dir, "seen")
    events.emit(rd, "attempt_started", attempt=1, total_steps=4)
    for step in (1, 2, 3):
        events.log_metrics(rd, step=step, epoch=0, loss=1.0 / step)
    events.emit(rd, "checkpoint_committed", step=2)

    job = client.get("/v1/jobs/seen").json()
    assert job["attempts"] == 1 and job["progress"] == {"phase": "training", "step": 3, "total_steps": 4, "epoch": 0}
    assert job["latest_checkpoint"]["step"] == 2
    metrics = client.get("/v1/jobs/seen/metrics?since_step=1").json()
    assert metrics["count"] == 2 and [m["step"] for m in metrics["data"]] == [2, 3]
    assert client.get("/v1/jobs/seen/metrics?limit=1").json()["count"] == 1
    evs = client.get("/v1/jobs/seen/events").json()
    assert [e["event"] for e in evs["data"]] == ["attempt_started", "checkpoint_committed"]
    # Only what was written since: the page asks with the previous answer's next_offset.
    assert client.get(f"/v1/jobs/seen/events?offset={evs['next_offset']}").json()["count"] == 0
    events.emit(rd, "resumed", attempt=2)
    newer = client.get(f"/v1/jobs/seen/events?offset={evs['next_offset']}").json()
    assert [e["event"] for e in newer["data"]] == ["resumed"] and newer["next_offset"] > evs["next_offset"]
    assert client.get("/v1/jobs/seen/events?offset=-1").status_code == 422
    assert client.get("/v1/jobs/seen/checkpoints").json() == {"data": [], "count": 0}  # none on disk
    assert client.get("/v1/jobs/seen/logs").text == "logs of etrain-seen-1\n"
    assert client.get("/v1/jobs/seen/logs?follow=true").text == "logs of etrain-seen-1\n"


def test_logs_of_a_job_not_yet_in_ray_are_empty(settings):
    with TestClient(create_app(settings, DownGateway(), reconcile=False), headers=AUTH) as client:
        create(client, small("waiting"))
        with client.app.state.ledger() as s:
            s.get(ledger.Job, "waiting").submission_id = None
            s.commit()
        r = client.get("/v1/jobs/waiting/logs")
        assert r.status_code == 200 and r.text == ""


def test_cluster(client):
    r = client.get("/v1/cluster")
    assert r.status_code == 200
    assert r.json()["cpus"] == {"total": 8, "free": 8} and r.json()["nodes"] == 1


def test_cluster_when_ray_is_down_is_503_with_a_reason(settings):
    with TestClient(create_app(settings, DownGateway(), reconcile=False), headers=AUTH) as client:
        r = client.get("/v1/cluster")
        assert r.status_code == 503 and "connection refused" in r.json()["detail"]


# ---------------------------------------------------------------- health, metrics


def test_healthz_and_readyz(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    r = client.get("/readyz")
    assert r.status_code == 200 and r.json() == {"ready": True, "ledger": "ok", "ray": "ok"}


def test_readyz_is_503_when_ray_is_unreachable(settings):
    with TestClient(create_app(settings, UnreachableGateway(), reconcile=False)) as client:
        r = client.get("/readyz")
        assert_no_traceback(r)
        assert r.status_code == 503
        assert r.json()["ready"] is False and r.json()["ledger"] == "ok"
        assert r.json()["ray"].startswith("unavailable")
        assert client.get("/healthz").status_code == 200  # alive, just not ready


def test_metrics_count_jobs_by_state(client, app):
    create(client, small("m1"))
    create(client, small("m2"))
    move(app, "m2", JobState.RUNNING)
    text = client.get("/metrics").text
    assert 'etrain_jobs{state="SUBMITTED"} 1.0' in text
    assert 'etrain_jobs{state="RUNNING"} 1.0' in text
    for state in JobState:
        assert f'etrain_jobs{{state="{state.value}"}}' in text
    # Timed by route template and status, a 404 too (an unmatched path has no route).
    client.get("/v1/jobs/m1")
    client.get("/v1/jobs/nope")
    text = client.get("/metrics").text
    assert 'etrain_http_request_seconds_count{method="POST",route="/v1/jobs",status="201"} 2.0' in text
    assert 'etrain_http_request_seconds_count{method="GET",route="/v1/jobs/{job_id}",status="200"} 1.0' in text
    assert 'etrain_http_request_seconds_count{method="GET",route="/v1/jobs/{job_id}",status="404"} 1.0' in text


# ---------------------------------------------------------------- unexpected errors


def test_an_unexpected_error_is_a_500_without_a_traceback(app):
    class Broken(FakeGateway):
        def cluster(self):
            raise RuntimeError('boom in File "/secret/path.py", line 1')

    app.dependency_overrides[get_gateway] = lambda: Broken()
    with TestClient(app, headers=AUTH, raise_server_exceptions=False) as client:
        r = client.get("/v1/cluster")
    assert r.status_code == 500
    assert r.json() == {"detail": "internal error; see the service log"}
    assert "boom" not in r.text and "Traceback" not in r.text


def test_huge_offset_is_422_not_500(client):
    # Found by the schemathesis run: SQLite cannot bind an offset past 2**63 - 1.
    r = client.get("/v1/jobs", params={"limit": 1, "offset": 2**63})
    assert r.status_code == 422 and "offset" in r.json()["message"]


# ---------------------------------------------------------------- the token before the body


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-token"}], ids=["missing", "wrong"])
@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'{"model": "gpt5"}', b"x" * (MAX_BODY + 10)],
                         ids=["malformed", "not-an-object", "invalid-spec", "over-the-limit"])
def test_without_the_token_any_body_is_401_never_422_or_413(app, settings, gateway, headers, body):
    # The token is checked before the body is read: a stranger learns nothing from it.
    with TestClient(app) as client:
        r = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/json", **headers})
        assert r.status_code == 401, r.text
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"detail": "missing or wrong bearer token"}
    assert job_count(app) == 0 and run_dirs(settings) == [] and gateway.submitted == {}


def test_without_the_token_a_streamed_body_over_the_limit_is_401(app):
    def chunks():
        for _ in range(MAX_BODY // 256 + 2):
            yield b"x" * 256

    with TestClient(app) as client:
        r = client.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 401, r.text


def test_with_the_token_the_same_bodies_get_their_own_answers(client):
    assert client.post("/v1/jobs", content=b"{not json", headers={"Content-Type": "application/json"}).status_code \
        == 422
    assert client.post("/v1/jobs", content=b"x" * (MAX_BODY + 10),
                       headers={"Content-Type": "application/json"}).status_code == 413


def test_the_openapi_document_still_names_the_bearer_scheme(app):
    doc = app.openapi()
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert doc["paths"]["/v1/jobs"]["post"]["security"] == [{"HTTPBearer": []}]


# ---------------------------------------------------------------- Idempotency-Key, run directories


def test_empty_idempotency_key_is_422(client, app, settings, gateway):
    r = client.post("/v1/jobs", json=small("keyless"), headers={"Idempotency-Key": ""})
    assert_clean(r)
    assert r.status_code == 422, r.text
    assert "idempotency-key" in r.json()["message"].lower()
    assert job_count(app) == 0 and run_dirs(settings) == [] and gateway.submitted == {}


def _foreign_run_dir(settings, job_id: str, **over) -> str:
    """A run directory the ledger does not know: `python -m workers.run` with the service's storage."""
    from workers.spec import JobSpec, write_spec_json

    spec = JobSpec.model_validate({**small(job_id, **over), "storage": settings.runs_dir})
    return write_spec_json(spec)


@pytest.mark.parametrize("same_spec", [False, True], ids=["other-spec", "same-spec"])
def test_a_job_id_naming_a_run_directory_the_ledger_does_not_hold_is_409(client, app, settings, gateway, same_spec):
    path = _foreign_run_dir(settings, "taken", **({} if same_spec else {"model": "mlp"}))
    before = open(path).read()
    r = client.post("/v1/jobs", json=small("taken"))
    assert_clean(r)
    assert r.status_code == 409, r.text
    assert "'taken'" in r.json()["detail"] and "another job's spec" in r.json()["detail"]
    assert settings.runs_dir not in r.text  # no server paths in answers
    assert job_count(app) == 0 and gateway.submitted == {}
    assert open(path).read() == before and os.listdir(os.path.dirname(path)) == ["spec.json"]


def test_a_job_whose_spec_json_was_replaced_never_runs_the_other_spec(settings):
    from service import jobs

    app = create_app(settings, DownGateway(), reconcile=False)
    with TestClient(app, headers=AUTH) as client:
        assert create(client, small("swapped"))["state"] == "QUEUED"  # Ray down; spec.json written
    # Before the reconciler hands it to Ray, its run directory gets another spec.
    os.remove(os.path.join(settings.runs_dir, "swapped", "spec.json"))
    _foreign_run_dir(settings, "swapped", model="mlp")
    gateway = FakeGateway()
    job = jobs.submit(app.state.ledger, settings, gateway, ledger.get_job(app.state.ledger, job_id="swapped"))
    assert job.state == "FAILED" and "another job's spec" in job.error
    assert gateway.submitted == {}


# ---------------------------------------------------------------- dataset roots


def test_a_fallback_spec_whose_files_are_missing_inside_an_allowed_root_is_accepted(client, settings):
    inside = settings.data_dir / "datasets" / "mnist"  # does not exist
    dataset = {"name": "idx", "images": str(inside / "i.gz"), "labels": str(inside / "l.gz"),
               "fallback_to_synthetic": True}
    assert create(client, small(dataset=dataset))["spec"]["dataset"]["images"] == str(inside / "i.gz")


def test_a_path_outside_the_roots_is_refused_naming_the_flag_that_allows_it(client):
    r = client.post("/v1/jobs", json=small(dataset={"name": "idx", "images": "/srv/data/i.gz",
                                                    "labels": "/srv/data/l.gz", "fallback_to_synthetic": True}))
    assert r.status_code == 422
    assert "etrain serve --dataset-root DIR" in r.json()["message"] and "ETRAIN_DATASET_ROOTS" in r.json()["message"]


@pytest.mark.parametrize("value", ['["/data/a", "/data/b"]', "/data/a:/data/b"], ids=["json", "path-list"])
def test_dataset_roots_from_the_environment(monkeypatch, tmp_path, value):
    monkeypatch.setenv("ETRAIN_DATASET_ROOTS", value)
    settings = Settings(data_dir=tmp_path)
    assert [str(p) for p in settings.dataset_roots] == ["/data/a", "/data/b"]
    assert settings.allowed_data_roots[1:] == ["/data/a", "/data/b"]
