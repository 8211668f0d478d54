"""Acceptance (issue 9): a user's own task, shipped with `etrain submit --code DIR`, trains
through the real service (`etrain serve` with its own Ray head): the loss falls, and a run
whose worker crashes resumes to the very weights of an undisturbed one."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import httpx
import pytest
import yaml

from service.code import make_archive
from tests.conftest import ROOT
from tests.service.conftest import start_serve, stop_serve

pytestmark = pytest.mark.ray

EXAMPLE = ROOT / "examples" / "own-task"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    data = tmp_path_factory.mktemp("own-code")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "ETRAIN_RAY_ADDRESS", "ETRAIN_TOKEN")}
    serve = start_serve(["--data-dir", str(data), "--num-cpus", "4"], env, data / "serve.log")
    try:
        yield serve, data
    finally:
        stop_serve(serve)


def submit_own_task(serve, data, spec: dict, tmp_path) -> subprocess.Popen:
    """`etrain submit SPEC --code examples/own-task --watch`, from the repository root."""
    path = tmp_path / f"{spec['job_id']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return subprocess.Popen([sys.executable, "-m", "service.cli", "submit", str(path), "--code", "examples/own-task",
                             "--watch", "--url", serve.url, "--data-dir", str(data)],
                            cwd=ROOT, env=serve.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def succeeded(proc: subprocess.Popen, serve, timeout: float = 300) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"no verdict after {timeout:.0f}s:\n{out[-4000:]}\n--- serve.log ---\n{serve.output()[-3000:]}")
    finally:
        if proc.poll() is None:  # interrupted: leave no client behind
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"{out[-4000:]}\n--- serve.log ---\n{serve.output()[-3000:]}"
    assert "SUCCEEDED" in out and "Traceback" not in out, out[-4000:]
    return out


def test_own_task_trains_and_resumes_exactly_through_the_service(served, tmp_path):
    serve, data = served
    spec = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    undisturbed = {**spec, "job_id": "wave-undisturbed"}
    crashed = {**spec, "job_id": "wave-crashed", "faults": [{"at_step": 14, "rank": 1, "kind": "crash"}]}
    # One after the other: on two cores, two at once took longer, not shorter.
    for job in (undisturbed, crashed):
        succeeded(submit_own_task(serve, data, job, tmp_path), serve)

    token = (data / "token").read_text().strip()
    code_id = hashlib.sha256(make_archive(EXAMPLE)).hexdigest()
    with httpx.Client(base_url=serve.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as api:
        views = {j["job_id"]: api.get(f"/v1/jobs/{j['job_id']}").json() for j in (undisturbed, crashed)}
        losses = {job_id: [m["loss"] for m in api.get(f"/v1/jobs/{job_id}/metrics").json()["data"]]
                  for job_id in views}
        assert api.get(f"/v1/code/{code_id}").status_code == 200
    for job_id, view in views.items():
        assert view["state"] == "SUCCEEDED", view
        assert view["spec"]["code"] == code_id and view["spec"]["task"] == "sine:make_task"
        assert losses[job_id][-1] < losses[job_id][0], (job_id, losses[job_id])
    assert views["wave-undisturbed"]["restarts"] == 0
    assert views["wave-crashed"]["restarts"] == 1, views["wave-crashed"]
    digests = {job_id: (view["result"] or {}).get("weights_sha256") for job_id, view in views.items()}
    assert digests["wave-undisturbed"] and digests["wave-undisturbed"] == digests["wave-crashed"], digests
    # One archive for both: the same tree uploads to the same id.
    assert sorted(os.listdir(data / "code")) == [f"{code_id}.zip"]
