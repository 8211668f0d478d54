"""The strategy registry, and FSDP's sharded save/load in one process (a 1-rank gloo group)."""

from __future__ import annotations

import os

import pytest

from workers import strategies
from workers.faults import InjectedFault
from workers.loop import WorkerEnv, train
from workers.spec import JobSpec
from workers.strategies.base import Strategy


def test_registry_refuses_duplicates_and_names_the_known_ones():
    class Again(Strategy):
        name = "ddp"

    with pytest.raises(ValueError, match="registered twice"):
        strategies.register(Again)

    class Spec:
        strategy = "zero3"

    with pytest.raises(ValueError, match="unknown strategy 'zero3'; known: ddp, fsdp, hybrid, pipeline, tensor"):
        strategies.build(Spec())


def fsdp_job(tmp_path, job_id, **fields) -> JobSpec:
    spec = JobSpec.model_validate({
        "job_id": job_id, "model": "simple_cnn", "strategy": "fsdp", "workers": 1,
        "dataset": {"name": "synthetic", "size": 384, "noise": 2.0},
        "training": {"max_steps": 30, "global_batch_size": 32, "seed": 7},
        "checkpoint": {"every_steps": 10}, "storage": str(tmp_path), **fields,
    })
    os.makedirs(spec.run_dir, exist_ok=True)
    return spec


@pytest.mark.parametrize("options", [{}, {"fsdp": {"cpu_offload": True}}, {"precision": "bf16"}],
                         ids=["plain", "cpu-offload", "bf16-policy"])
def test_fsdp_checkpoints_are_sharded_and_resume_exactly(tmp_path, one_rank_group, options):
    twin = train(fsdp_job(tmp_path, "twin", **options), WorkerEnv(0, 1, 0))
    spec = fsdp_job(tmp_path, "faulty", **options, faults=[{"at_step": 17, "rank": 0, "kind": "exception"}])
    with pytest.raises(InjectedFault):
        train(spec, WorkerEnv(0, 1, 0))
    files = set(os.listdir(os.path.join(spec.run_dir, "checkpoints", "step-000010")))
    assert {".metadata", "__0_0.distcp", "state.pt", "manifest.json"} <= files
    assert train(spec, WorkerEnv(0, 1, 0))["weights_sha256"] == twin["weights_sha256"]
