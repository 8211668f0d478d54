"""Sharded state on Ray: a 4-worker FSDP job stopped and resumed on 2 workers, and
meshes that cannot work refused before any worker."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_job, write_spec
from tests.integration.test_strategies import gpt_spec
from workers import events

pytestmark = pytest.mark.ray


def test_fsdp_stopped_on_four_workers_resumes_on_two(ray_cluster, tmp_path):
    # max_failures 0: the exception at step 13 stops the job, after step 10 was committed.
    spec = gpt_spec("reshard", 4, [{"at_step": 13, "rank": 1, "kind": "exception"}], strategy="fsdp",
                    failure={"max_failures": 0, "collective_timeout_s": 10})
    stopped = run_job(ray_cluster, spec, tmp_path)
    assert stopped.rc == 1 and stopped.summary["final_step"] == 12, stopped.output[-3000:]

    resumed = run_job(ray_cluster, {**spec, "workers": 2}, tmp_path)  # the same job, on 2 workers
    assert resumed.rc == 0, resumed.output[-3000:]
    attempts = resumed.events("attempt_started")
    assert [(a["world_size"], a["from_step"]) for a in attempts] == [(4, 0), (2, 10)]
    assert resumed.summary["final_step"] == 20
    assert [(r["old_size"], r["new_size"]) for r in resumed.summary["resizes"]] == [(4, 2)]
    by_attempt = {}
    for m in events.metrics(str(resumed.run_dir)):
        by_attempt.setdefault(m["attempt"], {})[m["step"]] = m["loss"]
    four, two = by_attempt[1], by_attempt[2]
    # Step 11 again, now on 2 workers from the 4 workers' resharded state: the same
    # weights, optimizer moments and global batch give the same loss up to float32
    # rounding of the different reduction (a wrong or missing shard would not).
    assert abs(two[11] - four[11]) < 1e-4, (four, two)
    assert abs(two[12] - four[12]) < 1e-4
    losses = [four[s] for s in range(1, 11)] + [two[s] for s in range(11, 21)]
    assert sum(losses[-5:]) < sum(losses[:5]) - 0.1  # and it keeps learning


def test_inconsistent_degrees_are_refused_before_any_worker(ray_cluster, tmp_path):
    spec = gpt_spec("bad-mesh", 4, strategy="hybrid", parallel={"tensor": 3}, storage=str(tmp_path / "runs"))
    proc = subprocess.run([sys.executable, "-m", "workers.run", str(write_spec(tmp_path, spec))], cwd=ROOT,
                          env=ray_cluster.env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "degrees must multiply to the worker count: parallel.tensor (3) does not divide workers (4)" in proc.stderr
    assert not (tmp_path / "runs").exists()  # no run directory: nothing was started
