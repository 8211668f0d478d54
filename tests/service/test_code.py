"""Users' own code (issue 9, the service's half): POST /v1/code stores a zip by its digest
and refuses what would unpack outside its root; jobs name an archive in `code`; a job's
`task` is checked in a subprocess before it is accepted; ETRAIN_ALLOW_CODE=false turns
all of it off; Ray gets the archive as the working directory; `etrain submit --code DIR`.
No Ray here (the real thing is test_own_code.py)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import sys
import textwrap
import zipfile

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from api.app import create_app
from service import code, jobs, ledger
from service.cli import app as cli
from service.gateway import RayGateway, runtime_env
from service.lifecycle import JobState
from service.settings import Settings
from tests.conftest import free_port
from tests.fakes import FakeGateway
from tests.service.test_cli import Server, error_line

TOKEN = "code-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ZIP = {"Content-Type": "application/zip"}
LIMIT = 64 * 1024

TASK = textwrap.dedent("""\
    import torch
    from torch import nn


    class Tiny:
        def __init__(self, config):
            self.n = int(config.get("n", 64))

        def model(self):
            return nn.Linear(2, 1)

        def datasets(self):
            x = torch.randn(self.n, 2, generator=torch.Generator().manual_seed(0))
            data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
            return data, data

        def loss(self, output, target):
            return nn.functional.mse_loss(output, target)


    def make_task(config):
        return Tiny(config)
    """)


def zip_of(entries: list[tuple[str | zipfile.ZipInfo, bytes | str]]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in entries:
            zf.writestr(name, data)
    return buffer.getvalue()


def symlink_entry(name: str, target: str) -> tuple[zipfile.ZipInfo, str]:
    entry = zipfile.ZipInfo(name)
    entry.create_system = 3
    entry.external_attr = (stat.S_IFLNK | 0o777) << 16
    return entry, target


def small(**over) -> dict:
    return {"model": "simple_cnn", "workers": 2, "dataset": {"name": "synthetic", "size": 64},
            "training": {"max_steps": 4, "global_batch_size": 8}, **over}


def task_job(code_id: str | None, **over) -> dict:
    body = {"task": "tiny_task:make_task", "workers": 2, "training": {"max_steps": 4, "global_batch_size": 8},
            **over}
    return {**body, "code": code_id} if code_id else body


def make_settings(tmp_path, **over) -> Settings:
    return Settings(**{"data_dir": tmp_path / "data", "token": TOKEN, "storage": None, "dataset_roots": [],
                       "max_code_bytes": LIMIT, **over})


@pytest.fixture
def settings(tmp_path) -> Settings:
    return make_settings(tmp_path)


@pytest.fixture
def gateway() -> FakeGateway:
    return FakeGateway()


def stored_files(settings) -> list[str]:
    """Everything in the archive store, temporary files included."""
    where = code.code_dir(settings)
    return sorted(os.listdir(where)) if where.is_dir() else []


def upload(client, data: bytes, **headers):
    return client.post("/v1/code", content=data, headers={**ZIP, **headers})


@pytest.fixture
def task_code(tmp_path) -> tuple[os.PathLike, bytes]:
    """A directory holding a tiny task module, and its archive."""
    where = tmp_path / "own"
    where.mkdir()
    (where / "tiny_task.py").write_text(TASK)
    return where, code.make_archive(where)


# ---------------------------------------------------------------- POST /v1/code


def test_an_archive_is_stored_once_by_its_digest(client, settings):
    data = zip_of([("train.py", "print('hi')\n"), ("pkg/__init__.py", "")])
    first = upload(client, data)
    assert first.status_code == 201, first.text
    code_id = first.json()["id"]
    assert len(code_id) == 64 and code_id == hashlib.sha256(data).hexdigest()
    again = upload(client, data)
    assert again.status_code == 200 and again.json()["id"] == code_id
    assert stored_files(settings) == [f"{code_id}.zip"]  # no temporary file left behind
    assert (code.code_dir(settings) / f"{code_id}.zip").read_bytes() == data
    meta = client.get(f"/v1/code/{code_id}")
    assert meta.status_code == 200 and meta.json()["size"] == len(data) and meta.json()["created"] > 0
    assert client.get(f"/v1/code/{'0' * 64}").status_code == 404
    assert client.get("/v1/code/..%2F..%2Ftoken").status_code == 404


BAD_ENTRIES = {
    "dot-dot": ([("../evil.py", "x")], "'../evil.py'"),
    "dot-dot-inside": ([("ok.py", ""), ("pkg/../../evil.py", "x")], "'pkg/../../evil.py'"),
    "backslash-dot-dot": ([("..\\evil.py", "x")], "'..\\\\evil.py'"),
    "absolute": ([("/etc/cron.d/evil", "x")], "'/etc/cron.d/evil'"),
    "drive": ([("C:/Windows/evil.py", "x")], "'C:/Windows/evil.py'"),
    "symlink": ([symlink_entry("data", "/etc/passwd")], "'data'"),
    "shadows-workers": ([("workers/run.py", "x")], "'workers/run.py'"),
}


@pytest.mark.parametrize("case", list(BAD_ENTRIES))
def test_an_entry_that_would_land_outside_the_root_is_refused_by_name(client, settings, case):
    entries, named = BAD_ENTRIES[case]
    r = upload(client, zip_of(entries))
    assert r.status_code == 422, r.text
    assert named in r.json()["detail"], r.json()
    assert stored_files(settings) == []


@pytest.mark.parametrize("data", [b"not a zip at all", b"", zip_of([("a.py", "x" * 1000)])[:-30]],
                         ids=["text", "empty", "truncated"])
def test_bytes_that_are_not_a_zip_are_refused(client, settings, data):
    r = upload(client, data)
    assert r.status_code == 422, r.text
    assert "zip" in r.json()["detail"]
    assert stored_files(settings) == []


def test_an_archive_over_the_limit_is_refused_as_it_arrives(client, settings):
    big = os.urandom(LIMIT + 1)
    r = upload(client, big)
    assert r.status_code == 413 and str(LIMIT) in r.json()["detail"], r.text
    # No Content-Length (chunked): counted while it is read.
    r = client.post("/v1/code", content=iter([big[:LIMIT // 2], big[LIMIT // 2:]]), headers=ZIP)
    assert r.request.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.request.headers
    assert r.status_code == 413, r.text
    assert stored_files(settings) == []


def test_an_archive_near_the_limit_is_not_held_to_the_smaller_json_body_limit(tmp_path):
    data = zip_of([("blob.bin", os.urandom(LIMIT - 500))])  # stored, not deflated
    settings = make_settings(tmp_path, max_body_bytes=1024)
    assert settings.max_body_bytes < len(data) <= LIMIT
    with TestClient(create_app(settings, FakeGateway(), reconcile=False), headers=AUTH) as client:
        assert upload(client, data).status_code == 201


@pytest.mark.parametrize("content_type", ["application/octet-stream", "application/json", None])
def test_only_application_zip_is_taken(client, settings, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    r = client.post("/v1/code", content=zip_of([("a.py", "")]), headers=headers)
    assert r.status_code == 415 and "application/zip" in r.json()["detail"], r.text
    assert stored_files(settings) == []


def test_code_routes_need_the_token(app, settings):
    with TestClient(app) as stranger:
        assert stranger.post("/v1/code", content=zip_of([("a.py", "")]), headers=ZIP).status_code == 401
        assert stranger.get(f"/v1/code/{'0' * 64}").status_code == 401
    assert stored_files(settings) == []


# ---------------------------------------------------------------- ETRAIN_ALLOW_CODE


def test_code_is_on_by_default():
    assert Settings().allow_code is True


@pytest.mark.parametrize("job", [task_job(None), task_job("ab" * 32), small(requirements=["einops"]),
                                 small(model={"name": "custom", "factory": "m:f"})],
                         ids=["task", "code", "requirements", "custom-model"])
def test_with_code_off_archives_and_jobs_that_run_code_get_403(tmp_path, job):
    settings = make_settings(tmp_path, allow_code=False)
    app = create_app(settings, FakeGateway(), reconcile=False)
    with TestClient(app, headers=AUTH) as client:
        r = upload(client, zip_of([("a.py", "")]))
        assert r.status_code == 403 and "ETRAIN_ALLOW_CODE=false" in r.json()["detail"], r.text
        r = client.post("/v1/jobs", json=job)
        assert r.status_code == 403, r.text
        assert "operator turned users' own code off" in r.json()["detail"]
        assert ledger.job_rows(app.state.ledger)[1] == 0
        assert client.post("/v1/jobs", json=small()).status_code == 201  # built-in models still run
    assert stored_files(settings) == []


def test_etrain_allow_code_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("ETRAIN_ALLOW_CODE", "false")
    monkeypatch.setenv("ETRAIN_MAX_CODE_BYTES", "1234")
    settings = Settings()
    assert settings.allow_code is False and settings.max_code_bytes == 1234


# ---------------------------------------------------------------- jobs that name an archive


def test_a_job_naming_an_unknown_archive_is_refused(client, app, gateway):
    r = client.post("/v1/jobs", json=small(code="ab" * 32))
    assert r.status_code == 422, r.text
    assert r.json()["message"] == f"code: no code archive {'ab' * 32}; upload it with POST /v1/code " \
                                  "(`etrain submit --code DIR` does both)"
    assert ledger.job_rows(app.state.ledger)[1] == 0 and gateway.submitted == {}


def test_a_job_with_code_reaches_ray_with_its_archive(client, app, settings, gateway):
    code_id = upload(client, zip_of([("helper.py", "")])).json()["id"]
    r = client.post("/v1/jobs", json=small(job_id="with-code", code=code_id, requirements=["numpy"]))
    assert r.status_code == 201, r.text
    sent = gateway.submitted["etrain-with-code-1"]
    assert sent["code_path"] == str(code.code_dir(settings) / f"{code_id}.zip")
    assert sent["requirements"] == ["numpy"]
    # The driver is lost: the resubmission runs the very same code.
    job = jobs.resubmit(app.state.ledger, settings, gateway, ledger.get_job(app.state.ledger, job_id="with-code"))
    assert gateway.submitted[job.submission_id]["code_path"] == sent["code_path"]
    # An archive gone from the store fails the job, saying so, rather than retrying without it.
    os.unlink(sent["code_path"])
    job = jobs.resubmit(app.state.ledger, settings, gateway, job)
    assert job.state == JobState.FAILED.value and f"code archive {code_id} is no longer stored" in job.error


def test_a_job_without_code_reaches_ray_without_a_runtime_env(client, gateway):
    assert client.post("/v1/jobs", json=small(job_id="plain")).status_code == 201
    assert gateway.submitted["etrain-plain-1"]["code_path"] is None
    assert gateway.submitted["etrain-plain-1"]["requirements"] == []


# ---------------------------------------------------------------- the task check (workers.check)


def test_a_task_lacking_the_hook_its_strategy_needs_is_refused_before_it_is_accepted(client, app, gateway, task_code):
    _, data = task_code
    code_id = upload(client, data).json()["id"]
    r = client.post("/v1/jobs", json=task_job(code_id, job_id="tensor-task", strategy="tensor"))
    assert r.status_code == 422, r.text
    message = r.json()["message"]
    assert message.startswith("task: ") and "tensor_plan" in message and "\n" not in message, message
    assert ledger.job_rows(app.state.ledger)[1] == 0 and gateway.submitted == {}
    # The same task under DDP needs nothing more: accepted.
    r = client.post("/v1/jobs", json=task_job(code_id, job_id="ddp-task"))
    assert r.status_code == 201, r.text
    assert list(gateway.submitted) == ["etrain-ddp-task-1"]


def test_a_task_that_cannot_be_imported_is_refused(client, app, task_code):
    _, data = task_code
    code_id = upload(client, data).json()["id"]
    r = client.post("/v1/jobs", json=task_job(code_id, task="not_there:make_task"))
    assert r.status_code == 422 and "not_there" in r.json()["message"], r.text
    assert ledger.job_rows(app.state.ledger)[1] == 0


def fake_python(tmp_path, script: str) -> str:
    """An 'interpreter' for the check that records how it was run, then runs `script`."""
    path = tmp_path / "fake-python"
    record = tmp_path / "check-call.json"
    path.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"json.dump({{'argv': sys.argv[1:], 'cwd': os.getcwd(), 'env': dict(os.environ),"
                    f" 'code': sorted(os.listdir(sys.argv[-1])) if '--code' in sys.argv else None,"
                    f" 'spec': json.load(open(sys.argv[3]))}}, open({str(record)!r}, 'w'))\n{script}\n")
    path.chmod(0o755)
    return str(path)


def checked(tmp_path, monkeypatch, script: str, job: dict, timeout: float = 30) -> tuple[object, dict | None]:
    settings = make_settings(tmp_path, python=fake_python(tmp_path, script), task_check_timeout_s=timeout)
    app = create_app(settings, FakeGateway(), reconcile=False)
    # Set once the service has read its settings, as a real one would have them in its environment.
    monkeypatch.setenv("ETRAIN_TOKEN", "secret-token")
    monkeypatch.setenv("DATABASE_URL", "postgresql://secret")
    with TestClient(app, headers=AUTH) as client:
        code_id = upload(client, zip_of([("tiny_task.py", TASK)])).json()["id"]
        r = client.post("/v1/jobs", json={**job, "code": code_id} if job.get("code") == "upload" else job)
    record = tmp_path / "check-call.json"
    return r, json.loads(record.read_text()) if record.exists() else None


def test_the_check_runs_in_a_subprocess_without_the_services_secrets(tmp_path, monkeypatch):
    r, call = checked(tmp_path, monkeypatch, "sys.exit(0)", task_job("upload", job_id="c1"))
    assert r.status_code == 201, r.text
    assert call["argv"][:2] == ["-m", "workers.check"] and call["argv"][3] == "--code"
    assert call["spec"]["task"] == "tiny_task:make_task" and call["spec"]["job_id"] == "c1"
    assert call["code"] == ["tiny_task.py"]  # the archive, unpacked
    assert not call["cwd"].startswith(str(tmp_path / "data"))
    assert "ETRAIN_TOKEN" not in call["env"] and "DATABASE_URL" not in call["env"]
    assert not os.path.exists(os.path.dirname(call["argv"][2]))  # the scratch directory is gone


def test_the_checks_last_line_is_the_answer(tmp_path, monkeypatch):
    script = "print('noise from the import', file=sys.stderr); print('the reason', file=sys.stderr); sys.exit(2)"
    r, _ = checked(tmp_path, monkeypatch, script, task_job("upload"))
    assert r.status_code == 422 and r.json()["message"] == "task: the reason", r.text


def test_a_check_that_crashes_is_a_422_that_says_so(tmp_path, monkeypatch):
    r, _ = checked(tmp_path, monkeypatch, "raise SystemExit('boom')", task_job("upload"))
    assert r.status_code == 422 and r.json()["message"] == \
        "task: checking task 'tiny_task:make_task' failed (exit code 1): boom", r.text


def test_a_check_that_hangs_is_stopped_and_is_a_422_that_says_so(tmp_path, monkeypatch):
    # The check's child sleeps on too: the whole process group is ended.
    script = ("import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
              f"open({str(tmp_path / 'child')!r}, 'w').write(str(p.pid)); time.sleep(60)")
    r, _ = checked(tmp_path, monkeypatch, script, task_job("upload"), timeout=2)
    assert r.status_code == 422 and r.json()["message"] == \
        "task: checking task 'tiny_task:make_task' took over 2s (importing it must not train or download anything)"
    child = int((tmp_path / "child").read_text())
    assert not alive(child)


def alive(pid: int) -> bool:
    """Whether a process runs (a killed one may linger as a zombie until its new parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_task_with_requirements_is_not_checked_here(tmp_path, monkeypatch):
    r, call = checked(tmp_path, monkeypatch, "sys.exit(2)", task_job("upload", requirements=["einops"]))
    assert r.status_code == 201 and call is None, r.text


def test_a_task_without_an_archive_is_checked_without_code(tmp_path, monkeypatch):
    r, call = checked(tmp_path, monkeypatch, "sys.exit(0)", task_job(None))
    assert r.status_code == 201 and "--code" not in call["argv"], r.text


# ---------------------------------------------------------------- the Ray gateway


class FakeJobClient:
    def __init__(self):
        self.calls: list[dict] = []

    def submit_job(self, **kw):
        self.calls.append(kw)
        return kw["submission_id"]


def test_the_runtime_env_holds_the_archive_and_the_requirements():
    assert runtime_env(None) is None
    assert runtime_env("/d/code/x.zip") == {"working_dir": "/d/code/x.zip"}
    assert runtime_env("/d/code/x.zip", ("einops>=0.7",)) == {"working_dir": "/d/code/x.zip", "pip": ["einops>=0.7"]}
    assert runtime_env(None, ["einops"]) == {"pip": ["einops"]}


def test_ray_gateway_submits_the_archive_as_working_dir(tmp_path):
    gateway = RayGateway(make_settings(tmp_path, python="/venv/bin/python"))
    gateway._client = client = FakeJobClient()
    gateway.submit(submission_id="s1", spec_path="/runs/j/spec.json", job_id="j")
    gateway.submit(submission_id="s2", spec_path="/runs/j/spec.json", job_id="j", code_path="/d/code/x.zip")
    gateway.submit(submission_id="s3", spec_path="/runs/j/spec.json", job_id="j", code_path="/d/code/x.zip",
                   requirements=["einops"])
    plain, with_code, with_pip = client.calls
    assert plain["runtime_env"] is None and plain["entrypoint"] == "exec /venv/bin/python -m workers.run /runs/j/spec.json"
    assert with_code["runtime_env"] == {"working_dir": "/d/code/x.zip"}
    assert with_code["entrypoint"] == plain["entrypoint"]
    # With pip, Ray runs the job in a virtualenv of its own: its `python`, not this one.
    assert with_pip["runtime_env"] == {"working_dir": "/d/code/x.zip", "pip": ["einops"]}
    assert with_pip["entrypoint"] == "exec python -m workers.run /runs/j/spec.json"


# ---------------------------------------------------------------- the archive the CLI makes


def test_the_same_tree_makes_the_same_archive(tmp_path, task_code):
    where, first = task_code
    (where / "__pycache__").mkdir()
    (where / "__pycache__" / "tiny_task.cpython-311.pyc").write_bytes(b"\0")
    (where / "stale.pyc").write_bytes(b"\0")
    (where / ".git").mkdir()
    (where / ".git" / "HEAD").write_text("ref: x\n")
    (where / "pkg").mkdir()
    (where / "pkg" / "b.py").write_text("")
    (where / "pkg" / "a.py").write_text("")
    os.utime(where / "tiny_task.py", (1, 1))
    data = code.make_archive(where)
    assert code.make_archive(where) == data
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert zf.namelist() == ["pkg/a.py", "pkg/b.py", "tiny_task.py"]
    # Only the contents count, not when or where the files were written.
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("tiny_task.py", "pkg/a.py", "pkg/b.py"):
        (copy / name).parent.mkdir(exist_ok=True)
        (copy / name).write_bytes((where / name).read_bytes())
    assert code.make_archive(copy) == data
    code.check_archive(io.BytesIO(data), max_unpacked=LIMIT)


# ---------------------------------------------------------------- etrain submit --code


@pytest.fixture
def server(tmp_path, monkeypatch):
    def start(**over):
        gateway = FakeGateway()
        application = create_app(make_settings(tmp_path, **over), gateway, reconcile=False)
        running = Server(application, free_port())
        started.append(running)
        monkeypatch.setenv("ETRAIN_URL", f"http://127.0.0.1:{running.port}")
        monkeypatch.setenv("ETRAIN_TOKEN", TOKEN)
        return application, gateway

    started: list[Server] = []
    try:
        yield start
    finally:
        for running in started:
            running.stop()


def test_submit_with_code_uploads_the_directory_and_names_it(server, tmp_path, task_code):
    application, gateway = server()
    where, data = task_code
    spec = tmp_path / "job.yaml"
    spec.write_text("job_id: own\ntask: tiny_task:make_task\nworkers: 2\n"
                    "training: {max_steps: 4, global_batch_size: 8}\n")
    result = CliRunner().invoke(cli, ["submit", str(spec), "--code", str(where)])
    assert result.exit_code == 0, result.output
    assert "own" in result.output and "SUBMITTED" in result.output
    code_id = hashlib.sha256(data).hexdigest()
    assert ledger.get_job(application.state.ledger, job_id="own").spec_dict["code"] == code_id
    assert gateway.submitted["etrain-own-1"]["code_path"].endswith(f"/code/{code_id}.zip")


def test_submit_with_a_missing_code_directory_is_one_line(server, tmp_path):
    server()
    spec = tmp_path / "job.yaml"
    spec.write_text("job_id: own\nworkers: 2\n")
    line = error_line(CliRunner().invoke(cli, ["submit", str(spec), "--code", str(tmp_path / "nowhere")]))
    assert line == f"error: --code {tmp_path / 'nowhere'}: no such directory"
    line = error_line(CliRunner().invoke(cli, ["submit", str(spec), "--code", str(spec)]))
    assert line == f"error: --code {spec}: not a directory"


def test_submit_whose_code_is_refused_shows_the_services_reason(server, tmp_path, task_code):
    application, _ = server(allow_code=False)
    where, _ = task_code
    spec = tmp_path / "job.yaml"
    spec.write_text("job_id: own\ntask: tiny_task:make_task\nworkers: 2\n")
    line = error_line(CliRunner().invoke(cli, ["submit", str(spec), "--code", str(where)]))
    assert line.startswith(f"error: the service refused the code in {where} (") and \
        "403: the operator turned users' own code off on this service (ETRAIN_ALLOW_CODE=false)" in line, line
    assert ledger.job_rows(application.state.ledger)[1] == 0
