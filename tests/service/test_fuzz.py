"""Fuzzing the API: whatever arrives, never a 5xx and never a traceback (DESIGN.md
invariant 6), and a rejected request leaves nothing behind. Bounded example counts
keep this well under a minute."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from api.app import create_app
from service import ledger
from service.settings import Settings
from tests.fakes import FakeGateway

TOKEN = "fuzz-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TRACEBACK_MARKS = ("Traceback", 'File "')


def _app(data_dir):
    # A task's check runs in a child process; it must end well inside the fuzzer's 10 s
    # read timeout even on a loaded machine (a task that imports torch takes seconds).
    settings = Settings(data_dir=data_dir, token=TOKEN, storage=None, dataset_roots=[], max_body_bytes=8192,
                        task_check_timeout_s=4)
    return create_app(settings, FakeGateway(cpus=16), reconcile=False)


# ---------------------------------------------------------------- schemathesis over the OpenAPI document


# POST /v1/code takes raw bytes as application/zip: send them as for application/octet-stream.
schemathesis.serializer.alias("application/zip", "application/octet-stream")

# Built at import: schemathesis reads the schema when it collects the tests (its lazy,
# fixture-based loader does not work with pytest 9). The directory goes when the process ends.
_FUZZ_DIR = tempfile.mkdtemp(prefix="etrain-fuzz-")
atexit.register(shutil.rmtree, _FUZZ_DIR, True)
fuzz_app = _app(Path(_FUZZ_DIR))
schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)


@pytest.fixture(scope="module", autouse=True)
def _fuzz_dir():
    with TestClient(fuzz_app, headers=AUTH) as client:  # a job to find, so job routes get past 404 too
        r = client.post("/v1/jobs", json={"job_id": "known", "training": {"max_steps": 2}})
        assert r.status_code in (200, 201, 409), r.text
    yield
    ledger.engine_of(fuzz_app.state.ledger).dispose()


@schema.parametrize()
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_operation_answers_5xx(case):
    response = case.call(headers=AUTH)
    case.validate_response(response, checks=[not_a_server_error])
    text = response.text
    assert not any(mark in text for mark in TRACEBACK_MARKS), text[:2000]


# ---------------------------------------------------------------- random JSON at POST /v1/jobs

FIELDS = ["job_id", "model", "dataset", "strategy", "workers", "resources", "training", "precision", "checkpoint",
          "failure", "faults", "storage", "name", "root", "images", "labels", "size", "factory", "cpu", "gpu",
          "max_steps", "epochs", "global_batch_size", "lr", "optimizer", "every_steps", "at_step", "rank", "kind"]
VALUES = ["simple_cnn", "mlp", "custom", "synthetic", "idx", "image_folder", "mnist", "ddp", "crash", "/etc",
          "../x", "/tmp/\x00", "os:system", "fp32"]

scalars = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20) | st.sampled_from(VALUES))
keys = st.sampled_from(FIELDS) | st.text(max_size=12)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=5),
    max_leaves=20,
)
VALID = {"workers": 2, "dataset": {"name": "synthetic", "size": 64},
         "training": {"max_steps": 4, "global_batch_size": 8}}
SECTIONS = {"dataset": ["name", "root", "images", "labels", "size", "num_classes", "noise", "val_fraction"],
            "training": ["max_steps", "epochs", "global_batch_size", "lr", "optimizer", "seed", "momentum"],
            "resources": ["cpu", "gpu"], "checkpoint": ["every_steps", "keep"],
            "model": ["name", "hidden", "factory"]}


def _mutate_section(section: str):
    """A valid spec with a few random values in one of its parts: gets past the outer checks."""
    fields = st.dictionaries(st.sampled_from(SECTIONS[section]), scalars, min_size=1, max_size=3)
    return st.builds(lambda over: {**VALID, section: {**VALID.get(section, {}), **over}}, fields)


bodies = st.one_of(
    st.dictionaries(keys, json_values, max_size=8),  # anything at all
    st.builds(lambda over: {**VALID, **over}, st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=2)),
    *[_mutate_section(name) for name in SECTIONS],
)


@pytest.fixture(scope="module")
def json_client(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("randomjson")
    app = _app(data_dir)
    with TestClient(app, headers=AUTH) as client:
        yield client


def _state(app) -> tuple[int, set[str]]:
    runs = app.state.settings.runs_dir
    return ledger.job_rows(app.state.ledger)[1], set(os.listdir(runs)) if os.path.isdir(runs) else set()


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=bodies, key=st.none() | st.sampled_from(["k1", "k2"]))
def test_random_json_bodies_never_break_post_jobs(json_client, body, key):
    app = json_client.app
    before_count, before_dirs = _state(app)
    headers = {"Idempotency-Key": key} if key else {}
    # allow_nan: Python's json (and so FastAPI) reads NaN and Infinity; send them too.
    r = json_client.post("/v1/jobs", content=json.dumps(body, allow_nan=True),
                         headers={**headers, "Content-Type": "application/json"})
    assert r.status_code in {201, 200, 409, 413, 422}, (r.status_code, r.text[:2000])
    assert not any(mark in r.text for mark in TRACEBACK_MARKS), r.text[:2000]
    after_count, after_dirs = _state(app)
    if r.status_code == 201:
        assert after_count == before_count + 1 and after_dirs == before_dirs | {r.json()["id"]}
    else:  # never a half-created job
        assert (after_count, after_dirs) == (before_count, before_dirs), r.text[:500]
        if r.status_code == 422:
            assert r.json().get("message") or r.json().get("detail")
