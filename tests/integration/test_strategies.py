"""Strategies on a real Ray cluster: same losses as one process, exact resume after a
crash, for every strategy, in fp32, bf16 and fp16.

ddp and fsdp train the image model the recovery tests share; tensor, pipeline and the
hybrid meshes train a small gpt. The jobs run in waves of up to 8 workers side by side
(the session cluster's 8 logical CPUs), which overlaps Ray's fixed start-up and
tear-down costs; every test below reads the waves' outcomes."""

from __future__ import annotations

import os

import pytest

from tests.conftest import Outcome, finish, recovery_spec, start_job
from workers import events
from workers.loop import WorkerEnv, train
from workers.spec import JobSpec

# The waves fixture runs under the first test's time limit: 4 waves of jobs take ~6 minutes
# here, more on a loaded machine, so the limit is the module's, not the default 600 s.
pytestmark = [pytest.mark.ray, pytest.mark.timeout(1500)]

CRASH_AT = 14  # after the checkpoint of step 10: each resume recomputes steps 11-13


def gpt_spec(job_id: str, workers: int, faults: list[dict] | None = None, **fields) -> dict:
    return {
        "job_id": job_id,
        "model": {"name": "gpt", "layers": 2, "width": 32, "heads": 4, "context": 16},
        "dataset": {"name": "synthetic_tokens", "size": 1024, "vocab_size": 32},
        "workers": workers,
        "training": {"max_steps": 20, "global_batch_size": 16, "seed": 5, "lr": 3e-3},
        "checkpoint": {"every_steps": 10, "keep": 2},
        "failure": {"max_failures": 3, "collective_timeout_s": 10},
        "faults": faults or [],
        **fields,
    }


def crash(workers: int) -> list[dict]:
    return [{"at_step": CRASH_AT, "rank": workers - 1, "kind": "crash"}]


# name: (spec without job_id and faults, whether an undisturbed twin runs too). With a
# twin: its losses match one process and the crashed run ends bit-identical to it.
# Without (to keep the suite short): the crashed run's own losses, resumed at step 10,
# match one process; hybrid's bit-identical resume is shown by its pipeline variant.
CASES = {
    "fsdp": ({**recovery_spec("fsdp"), "strategy": "fsdp"}, True),
    "tensor": (gpt_spec("", 2, strategy="tensor"), True),
    "pipeline-1f1b": (gpt_spec("", 2, strategy="pipeline", parallel={"schedule": "1f1b", "microbatches": 4}), True),
    "hybrid-dp-pp-gpipe": (gpt_spec("", 4, strategy="hybrid",
                                    parallel={"pipeline": 2, "schedule": "gpipe", "microbatches": 2}), True),
    # These two also show bf16 (FSDP's mixed-precision policy on the data-parallel
    # dimension) and fp16 (loss scaling, its scale in the checkpoint) train and resume.
    "hybrid-dp-tp-bf16": (gpt_spec("", 4, strategy="hybrid", parallel={"tensor": 2}, precision="bf16"), False),
    "hsdp-fp16-async-checkpoint": (gpt_spec("", 4, strategy="hybrid", precision="fp16",
                                            parallel={"shard": 2, "async_checkpoint": True}), False),
}
# Each wave holds at most 8 workers.
WAVES = [["tensor", "pipeline-1f1b"], ["hybrid-dp-pp-gpipe"], ["hybrid-dp-tp-bf16", "hsdp-fp16-async-checkpoint"],
         ["fsdp"]]


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory) -> dict[str, dict[str, Outcome]]:
    """{case: {"crash": outcome, "twin": outcome}} for every case, wave after wave."""
    out: dict[str, dict[str, Outcome]] = {}
    for wave in WAVES:
        started = []
        for name in wave:
            spec, with_twin = CASES[name]
            tmp = tmp_path_factory.mktemp(name)
            started.append((name, "crash", start_job(ray_cluster, {**spec, "job_id": f"{name}-crash",
                                                                   "faults": crash(spec["workers"])}, tmp)))
            if with_twin:
                started.append((name, "twin", start_job(ray_cluster, {**spec, "job_id": f"{name}-twin"}, tmp)))
        for name, kind, (proc, run_dir) in started:
            outcome = finish(proc, run_dir, timeout=400)
            assert outcome.rc == 0, (name, kind, outcome.output[-3000:])
            out.setdefault(name, {})[kind] = outcome
    return out


def single_process_losses(tmp_path, spec: dict) -> list[float]:
    """The same model, data and global batch in this process, one worker, no Ray."""
    local = JobSpec.model_validate({**spec, "workers": 1, "strategy": "ddp", "parallel": {}, "faults": [],
                                    "job_id": "single", "storage": str(tmp_path / "single")})
    os.makedirs(local.run_dir, exist_ok=True)
    train(local, WorkerEnv(rank=0, world_size=1, local_rank=0))
    return [m["loss"] for m in events.metrics(local.run_dir)]


def final_lineage_losses(outcome: Outcome) -> list[float]:
    """Loss per step of the steps the final weights came from: a resumed attempt's steps
    replace those its predecessor ran past the checkpoint."""
    by_step = {}
    for m in events.metrics(str(outcome.run_dir)):
        by_step[m["step"]] = m["loss"]  # later attempts come later in the file
    return [by_step[s] for s in sorted(by_step)]


@pytest.mark.parametrize("name", ["ddp", *CASES])
def test_losses_match_one_process(name, request, tmp_path):
    if name == "ddp":  # the recovery tests' undisturbed twin
        spec, outcome = recovery_spec("x"), request.getfixturevalue("twin")
    else:
        spec, _ = CASES[name]
        outcome = request.getfixturevalue("runs")[name]
        outcome = outcome.get("twin") or outcome["crash"]
    distributed = final_lineage_losses(outcome)[:20]
    single = single_process_losses(tmp_path, spec)[:20]  # in the same precision
    assert len(distributed) == len(single) == 20
    # Split layers add partial sums (tensor), reduce shards (FSDP) or average micro-batches
    # (pipeline) in another order than one process: float32 rounding, ~1e-7 relative a
    # step; measured at most ~1e-6 after 20 steps, so 1e-4. In bf16 (8 mantissa bits) and
    # fp16 (11) each op rounds at ~4e-3 and ~5e-4 relative; measured at most 1.3e-3 over
    # 20 steps, so 1e-2. A real error (a wrong shard, a dropped micro-batch, a bad resume)
    # moves the loss by more: the loss falls ~0.7 over these 20 steps.
    tolerance = 1e-2 if spec.get("precision", "fp32") != "fp32" else 1e-4
    assert max(abs(a - b) for a, b in zip(distributed, single)) < tolerance, (name, distributed, single)
    assert sum(distributed[-5:]) < sum(distributed[:5])  # and it learns


@pytest.mark.parametrize("name", list(CASES))
def test_crash_resumes_exactly(name, runs):
    spec, with_twin = CASES[name]
    crashed = runs[name]["crash"]
    assert crashed.summary["restarts"] == 1
    if with_twin:
        assert crashed.summary["weights_sha256"] == runs[name]["twin"].summary["weights_sha256"], name
    (resumed,) = crashed.events("resumed")
    assert (resumed["failed_rank"], resumed["from_step"], resumed["lost_steps"]) == (spec["workers"] - 1, 10, 3)
    last = crashed.run_dir / "checkpoints" / f"step-{crashed.summary['final_step']:06d}"
    files = set(os.listdir(last))
    assert {".metadata", "manifest.json"} <= files
    assert {f"__{r}_0.distcp" for r in range(spec["workers"])} <= files  # every rank wrote its part


def test_fp16_checkpoints_hold_the_loss_scale(runs):
    import torch

    crashed = runs["hsdp-fp16-async-checkpoint"]["crash"]
    state = torch.load(crashed.run_dir / "checkpoints" / "step-000010" / "state.pt", weights_only=False)
    assert set(state["scaler"]) >= {"scale", "_growth_tracker"}
