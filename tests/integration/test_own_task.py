"""A user's own task (examples/own-task), shipped with the job, on a real local Ray
cluster: through `workers.run --code`, through `ray job submit --working-dir`, under
fsdp with the task's fsdp_units, and with a bug in the user's loss."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, Outcome, finish, last_json_line, write_spec

EXAMPLE = ROOT / "examples" / "own-task"


def wave_spec(job_id: str, storage: Path, **changes) -> dict:
    spec = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    return {**spec, "job_id": job_id, "storage": str(storage), **changes}


def run_with_code(cluster, spec: dict, tmp: Path, code: Path) -> Outcome:
    # From a directory where the task's module is not importable: only --code brings it.
    proc = subprocess.Popen([sys.executable, "-m", "workers.run", str(write_spec(tmp, spec, f"{spec['job_id']}.yaml")),
                             "--code", str(code)], cwd=tmp, env=cluster.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return finish(proc, Path(spec["storage"]) / spec["job_id"])


@pytest.fixture(scope="module")
def fsdp_runs(ray_cluster, tmp_path_factory) -> dict[str, Outcome]:
    tmp = tmp_path_factory.mktemp("own-task")
    # Through DataLoader worker processes too: a resume must not depend on their state.
    twin = wave_spec("wave-fsdp-twin", tmp / "runs", strategy="fsdp", dataset={"loader_workers": 2})
    crash = {**twin, "job_id": "wave-fsdp-crash", "faults": [{"at_step": 14, "rank": 1, "kind": "crash"}]}
    outcomes = {"twin": run_with_code(ray_cluster, twin, tmp, EXAMPLE)}

    ray = shutil.which("ray", path=ray_cluster.env["PATH"])
    env = {k: v for k, v in ray_cluster.env.items() if k != "RAY_ADDRESS"}
    path = write_spec(tmp, crash, "crash.yaml")
    done = subprocess.run([ray, "job", "submit", "--address", ray_cluster.dashboard, "--working-dir", str(EXAMPLE),
                           "--", "python", "-m", "workers.run", str(path)],
                          env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
    outcomes["crash"] = Outcome(done.returncode, last_json_line(done.stdout), done.stdout + done.stderr,
                                tmp / "runs" / crash["job_id"])
    return outcomes


pytestmark = pytest.mark.ray


def test_the_example_task_trains_through_workers_run_with_code(fsdp_runs):
    twin = fsdp_runs["twin"]
    assert twin.rc == 0, twin.output[-3000:]
    losses = [m["loss"] for m in map(yaml.safe_load, (twin.run_dir / "metrics.jsonl").read_text().splitlines())]
    assert len(losses) == 40 and losses[-1] < 0.5 * losses[0], losses
    assert twin.summary["val_metrics"]["mae"] < 0.5 and twin.summary["val_loss"] < losses[0]
    assert "task sine:make_task" in twin.output


def test_a_crash_under_ray_job_submit_resumes_bit_identical_with_the_tasks_fsdp_units(fsdp_runs):
    twin, crash = fsdp_runs["twin"], fsdp_runs["crash"]
    assert crash.rc == 0, crash.output[-3000:]
    assert crash.summary["restarts"] == 1 and crash.summary["recoveries"][0]["from_step"] == 10
    assert crash.summary["weights_sha256"] == twin.summary["weights_sha256"]
    # fsdp: each rank wrote its own shard of every checkpoint.
    latest = crash.run_dir / "checkpoints" / (crash.run_dir / "checkpoints" / "LATEST").read_text().strip()
    assert len(list(latest.rglob("*.distcp"))) == 2


BROKEN_LOSS = '''
import torch
from torch import nn


class Task:
    def model(self):
        return nn.Linear(4, 2)

    def datasets(self):
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.TensorDataset(torch.randn(256, 4, generator=g), torch.randint(0, 2, (256,), generator=g)), None

    def loss(self, output, target):
        raise ValueError(f"my loss wants one-hot targets, got shape {tuple(target.shape)}")


def make_task(config):
    return Task()
'''


def test_a_task_whose_loss_raises_fails_in_one_attempt_with_the_users_message(ray_cluster, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "broken_loss.py").write_text(textwrap.dedent(BROKEN_LOSS))
    spec = {"job_id": "broken-loss", "task": "broken_loss:make_task", "workers": 2, "storage": str(tmp_path / "runs"),
            "training": {"max_steps": 10, "global_batch_size": 16}, "failure": {"max_failures": 3}}
    outcome = run_with_code(ray_cluster, spec, tmp_path, code)
    assert outcome.rc == 1, outcome.output[-3000:]
    summary = outcome.summary
    assert summary["status"] == "failed" and summary["restarts"] == 0
    assert "my loss wants one-hot targets" in summary["error"]
    assert "broken_loss.py" in summary["traceback"] and "in loss" in summary["traceback"]
    failed = [e for e in outcome.events("worker_failed") if e["classification"] == "deterministic"]
    assert failed and "my loss wants one-hot targets" in failed[0]["error"]
    assert "broken_loss.py" in failed[0]["traceback"]
    assert len(outcome.events("attempt_started")) == 1
