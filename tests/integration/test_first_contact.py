"""What a new user meets first, on a real local Ray cluster: errors before the first
step fail at once and say why, a hang anywhere is recovered, output a person can read,
and two local jobs started at once leave each other alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, finish, free_port, last_json_line, recovery_spec, run_job, write_spec

pytestmark = pytest.mark.ray
HANG_TIMEOUT_S = 10


def _one_attempt_failure(outcome, cause: str) -> None:
    assert outcome.rc == 1, outcome.output[-3000:]
    assert outcome.summary["status"] == "failed"
    assert cause in outcome.summary["error"], outcome.summary["error"]
    assert len(outcome.events("attempt_started")) <= 1  # never retried
    assert outcome.events("training_started") == []


@pytest.mark.parametrize("case", ["unparsable-data-file", "smaller-than-one-batch", "model-cannot-be-built"])
def test_an_error_before_the_first_step_fails_in_one_attempt_naming_the_cause(ray_cluster, tmp_path, case):
    bad = tmp_path / "images-idx3-ubyte.gz"
    bad.write_bytes(b"\x1f\x8b not really gzip")
    spec = {
        "unparsable-data-file": ({"dataset": {"name": "idx", "images": str(bad), "labels": str(bad)}}, str(bad)),
        "smaller-than-one-batch": ({"dataset": {"name": "synthetic", "size": 40}},
                                   "fewer than one global batch (training.global_batch_size = 64)"),
        "model-cannot-be-built": ({"model": {"name": "custom", "factory": "tests.helpers.bad_model:unbuildable"}},
                                  "building the model (model.name = custom)"),
    }[case]
    outcome = run_job(ray_cluster, {**recovery_spec(case), **spec[0]}, tmp_path)
    _one_attempt_failure(outcome, spec[1])
    (failed,) = [e for e in outcome.events("worker_failed") if e["classification"] == "deterministic"][:1]
    assert "Traceback" in failed["traceback"]
    # The driver showed it as one short block, not Ray's traceback dump.
    assert "[train] rank 0 failed at step 1" in outcome.output or "[train] rank 1 failed at step 1" in outcome.output
    assert len(outcome.output.splitlines()) < 15, outcome.output


def test_a_spec_the_workers_cannot_run_fails_in_one_attempt(tmp_path):
    """resources.gpu on a cluster whose "GPU" is a label on a machine without one: what
    the workers get cannot run the spec (NCCL needs a CUDA device)."""
    from service.embedded import EmbeddedRay

    head = EmbeddedRay(gcs_port=free_port(), dashboard_port=free_port(), num_cpus=2,
                       log_path=str(tmp_path / "gpu-head.log"), extra_env={"PYTHONPATH": str(ROOT)})
    head.cmd += ["--num-gpus", "1"]
    head.start()
    try:
        env = {**os.environ, **head.env, "RAY_ADDRESS": head.gcs_address}
        spec = {**recovery_spec("no-real-gpu"), "workers": 1, "resources": {"gpu": 1}, "storage": str(tmp_path / "runs")}
        proc = subprocess.Popen([sys.executable, "-m", "workers.run", str(write_spec(tmp_path, spec))], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        outcome = finish(proc, tmp_path / "runs" / "no-real-gpu")
    finally:
        head.stop()
    _one_attempt_failure(outcome, "resources.gpu is 1 but the workers Ray placed have no usable GPU")


@pytest.mark.parametrize("where", ["rank-1-in-data-loading", "rank-0-sealing-a-checkpoint"])
def test_a_hang_is_detected_within_the_timeout_and_recovered_exactly(ray_cluster, twin, tmp_path, where):
    fault = {"rank-1-in-data-loading": {"at_step": 14, "rank": 1, "kind": "hang", "phase": "data"},
             "rank-0-sealing-a-checkpoint": {"at_step": 20, "rank": 0, "kind": "hang", "phase": "commit"}}[where]
    spec = recovery_spec(where, [fault])
    # The collective timeout is longer than the watchdog's, so it is the watchdog that
    # finds the stuck rank (a peer waiting on it would find only an echo, later).
    # 10 s, not less: while a worker group starts, a loaded 2-core machine can leave a
    # worker's threads unscheduled for several seconds.
    spec["failure"] = {**spec["failure"], "collective_timeout_s": 60, "hang_timeout_s": HANG_TIMEOUT_S}
    outcome = run_job(ray_cluster, spec, tmp_path)
    assert outcome.rc == 0, outcome.output[-3000:]
    assert outcome.summary["weights_sha256"] == twin.summary["weights_sha256"]
    assert outcome.summary["restarts"] == 1
    (injected,) = outcome.events("fault_injected")
    hung = [e for e in outcome.events("worker_failed")
            if e.get("hung") and e["rank"] == fault["rank"] and e["time"] > injected["time"]]
    assert hung, outcome.events("worker_failed")
    assert hung[0]["time"] - injected["time"] <= HANG_TIMEOUT_S + 2, (injected, hung[0])
    expected = "reading the batch of step 14" if fault["phase"] == "data" else "sealing the checkpoint of step 20"
    assert expected in hung[0]["activity"]
    (resumed,) = outcome.events("resumed")
    assert resumed["failed_rank"] == fault["rank"] and resumed["from_step"] == 10


def test_the_readme_job_prints_each_line_once_and_nothing_of_rays(ray_cluster, tmp_path):
    spec_path = ROOT / "examples" / "demo.yaml"
    runs = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-m", "workers.run", str(spec_path), "--storage", str(runs)], cwd=ROOT,
                          env=ray_cluster.env, capture_output=True, text=True, timeout=600)
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 0, "\n".join(lines[-50:])
    assert len(lines) <= 60, "\n".join(lines)
    ours = [line for line in lines if line.startswith("[train] ")]
    assert len(ours) == len(set(ours)), "\n".join(lines)  # every line once
    summary = last_json_line(done.stdout)
    assert lines[-1].startswith("{") and summary["status"] == "succeeded"
    # Nothing else: no Ray log line, no traceback (a failure block indents its few lines).
    others = [line for line in lines[:-1] if not line.startswith(("[train] ", "    ", "notice: "))]
    assert others == [], "\n".join(others)
    assert any("fault injected: crash on rank 1 at step 170" in line for line in ours)
    assert any(line.startswith("[train] recovered: rank 1 failed") for line in ours)
    progress = [line for line in ours if " samples/s, elapsed " in line]
    assert progress and all("ETA" in line for line in progress[:-1])


def test_two_local_runs_started_at_once_leave_each_other_alone(twin, tmp_path):
    """Each `python -m workers.run` without RAY_ADDRESS starts a cluster of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env["PYTHONPATH"] = str(ROOT)
    procs = []
    for name in ("local-a", "local-b"):
        spec = {**recovery_spec(name), "storage": str(tmp_path / "runs")}
        procs.append(subprocess.Popen([sys.executable, "-m", "workers.run", "--verbose",
                                       str(write_spec(tmp_path, spec, f"{name}.yaml"))],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outcomes = [finish(p, tmp_path / "runs" / name, timeout=400) for p, name in zip(procs, ("local-a", "local-b"))]
    for outcome in outcomes:
        assert outcome.rc == 0, outcome.output[-3000:]
        assert outcome.summary["weights_sha256"] == twin.summary["weights_sha256"]
        assert "multiple active Ray instances" not in outcome.output

