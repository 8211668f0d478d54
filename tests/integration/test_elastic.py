"""Acceptance for elastic worker counts: a job {min: 1, max: 2} on two worker nodes
keeps training when one node dies, grows back when a node joins, and ends with the step
count it would have had undisturbed.

The nodes are real `ray start` processes joined to the session's head; stopping one's
process group is that node dying. Only they offer the `elastic_slot` resource the job
asks for, so its workers run there and nowhere else."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from service.embedded import EmbeddedRay
from tests.conftest import ROOT, Outcome, last_json_line, wait_while_running, write_spec
from tests.helpers.paced import GATE_ENV
from workers.run import START_TIMEOUT_ENV

pytestmark = pytest.mark.ray

SLOT = "elastic_slot"


def _events(run_dir, kind):
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["event"] == kind]


def _steps(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _trained_at(run_dir, size: int) -> bool:
    """An attempt of `size` workers has completed a step."""
    attempts = _events(run_dir, "attempt_started")
    if not attempts or attempts[-1]["world_size"] != size:
        return False
    return any(m.get("attempt") == attempts[-1]["attempt"] for m in _steps(run_dir))


def test_elastic_job_shrinks_on_lost_node_and_grows_back(ray_cluster, tmp_path):
    gate = tmp_path / "slow"
    gate.write_text("while this file exists, every training step takes 0.25 s")
    nodes: list[EmbeddedRay] = []

    def add_node(name: str) -> EmbeddedRay:
        # The node's processes, so the job's workers on it, see the gate's path.
        env = {k: v for k, v in ray_cluster.env.items() if k != "RAY_ADDRESS"}
        node = EmbeddedRay.worker_node(ray_cluster.address, num_cpus=1, resources={SLOT: 1},
                                       log_path=str(tmp_path / f"{name}.log"), env={**env, GATE_ENV: str(gate)})
        node.start()
        nodes.append(node)
        return node

    spec = {
        "job_id": "elastic",
        "model": {"name": "custom", "factory": "tests.helpers.paced:paced_linear"},
        "dataset": {"name": "synthetic", "size": 4000, "image_size": 8, "val_fraction": 0.1},
        "workers": {"min": 1, "max": 2, "resize_check_s": 5},
        "resources": {"cpu": 1, "custom": {SLOT: 1}},
        "training": {"epochs": 8, "global_batch_size": 30, "seed": 3, "optimizer": "sgd", "lr": 0.05},
        "checkpoint": {"every_steps": 10},
        "storage": str(tmp_path / "runs"),
        "failure": {"max_failures": 5, "collective_timeout_s": 10},
    }
    try:
        first, _ = add_node("node-a"), add_node("node-b")
        log = tmp_path / "driver.log"
        # The driver's output goes to a file: Ray logs much while nodes come and go, and
        # an unread pipe would fill and stop the driver.
        with open(log, "w") as out:
            # After the node dies Ray first waits this long for 2 workers again: shorter
            # than the default here, as the test knows no node will come back by itself.
            env = {**ray_cluster.env, START_TIMEOUT_ENV: "8"}
            proc = subprocess.Popen([sys.executable, "-m", "workers.run", str(write_spec(tmp_path, spec))], cwd=ROOT,
                                    env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        run_dir = tmp_path / "runs" / "elastic"
        try:
            wait_while_running("training on 2 workers", lambda: _trained_at(run_dir, 2), proc, log, 180)
            first.stop(grace_s=0)  # the node dies: SIGKILL to its raylet and workers
            wait_while_running("training on 1 worker after the node was lost", lambda: _trained_at(run_dir, 1), proc, log, 180)
            add_node("node-c")
            wait_while_running("training on 2 workers after a node joined", lambda: _trained_at(run_dir, 2)
                  and len(_events(run_dir, "resized")) >= 2, proc, log, 180)
            gate.unlink()  # full speed from here: let it finish
            proc.wait(timeout=240)
        finally:
            gate.unlink(missing_ok=True)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        outcome = Outcome(proc.returncode, last_json_line(log.read_text()), log.read_text(), run_dir)
    finally:
        for node in nodes:
            node.stop(grace_s=0)

    assert outcome.rc == 0, outcome.output[-4000:]
    summary = outcome.summary
    resizes = [(r["old_size"], r["new_size"]) for r in summary["resizes"]]
    assert resizes == [(2, 1), (1, 2)], summary
    assert summary["world_size"] == 2
    # The undisturbed run's length: 8 epochs of the 3600 training samples in batches of
    # 30 (each attempt computes it from the data, whatever its worker count).
    undisturbed_steps = 8 * (3600 // 30)
    assert {a["total_steps"] for a in outcome.events("training_started")} == {undisturbed_steps}
    assert summary["final_step"] == undisturbed_steps
    # Every step of the final lineage was trained: resumed attempts pick up where their
    # checkpoint left off, with no step skipped.
    attempts = outcome.events("attempt_started")
    covered = set()
    for a, b in zip(attempts, attempts[1:] + [None]):
        stop = b["from_step"] if b else undisturbed_steps
        covered |= {m["step"] for m in _steps(run_dir) if m["attempt"] == a["attempt"] and m["step"] <= stop}
    assert covered == set(range(1, undisturbed_steps + 1))
    # The lost node was a failure (a recovery, counted against max_failures); the grow was not.
    causes = [r["cause"] for r in summary["recoveries"]]
    assert "resize" in causes and any(c != "resize" for c in causes), summary
