"""A user's task under the model-parallel strategies, on 2 gloo processes without Ray:
its own tensor_plan and pipeline_stages, the whole model's names in what is saved, and
an exact resume."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import run_ranks
from workers.spec import JobSpec


def seq_job(tmp_path, job_id, **fields) -> JobSpec:
    return JobSpec.model_validate({
        "job_id": job_id, "task": "tests.helpers.seq_task:make_task", "workers": 2,
        "training": {"max_steps": 12, "global_batch_size": 32, "seed": 5, "lr": 0.01},
        "checkpoint": {"every_steps": 5}, "storage": str(tmp_path), **fields,
    })


@pytest.mark.parametrize("strategy", ["pipeline", "tensor"])
def test_a_users_split_hooks_train_like_one_process_and_resume_exactly(tmp_path, strategy):
    split = {"strategy": strategy, "parallel": {"microbatches": 2}}
    run_ranks(seq_job(tmp_path, "one", workers=1), 1, str(tmp_path / "store-one"))  # its final weights, below
    twin = run_ranks(seq_job(tmp_path, "twin", **split), 2, str(tmp_path / "store-twin"))
    faulty = seq_job(tmp_path, "faulty", **split, faults=[{"at_step": 8, "rank": 1, "kind": "exception"}])
    with pytest.raises(RuntimeError, match="InjectedFault"):
        run_ranks(faulty, 2, str(tmp_path / "store-faulty"))
    resumed = run_ranks(faulty, 2, str(tmp_path / "store-resumed"))
    assert resumed["weights_sha256"] == twin["weights_sha256"]
    # The final weights carry the model's own names, whole, and match one process.
    whole = torch.load(tmp_path / "twin" / "final" / "model.pt")
    alone = torch.load(tmp_path / "one" / "final" / "model.pt")
    assert set(whole) == set(alone) == {f"{i}.{p}" for i in (0, 2, 4) for p in ("weight", "bias")}
    for name in alone:
        torch.testing.assert_close(whole[name], alone[name], rtol=1e-4, atol=1e-5)
