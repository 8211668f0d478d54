"""A world size that does not divide the global batch (an elastic job at 3 workers):
shares differ by one sample and are weighted by size, so the step is the one process's."""

from __future__ import annotations

import os


from tests.helpers.ranks import run_ranks
from workers import events
from workers.loop import WorkerEnv, train
from workers.spec import JobSpec


def spec(tmp_path, job_id, workers, **fields) -> JobSpec:
    return JobSpec.model_validate({
        "job_id": job_id, "model": "mlp", "workers": workers, "storage": str(tmp_path),
        "dataset": {"name": "synthetic", "size": 512, "image_size": 8, "noise": 2.0},
        "training": {"max_steps": 12, "global_batch_size": 16, "seed": 4, "optimizer": "sgd", "lr": 0.1, **fields},
        "checkpoint": {"every_steps": 6},
    })


def test_three_workers_and_accumulation_train_like_one_process(tmp_path, one_rank_group):
    single = spec(tmp_path, "single", 1)
    os.makedirs(single.run_dir)
    train(single, WorkerEnv(0, 1, 0))
    three = spec(tmp_path, "three", 3, micro_batch_size=2)  # shares 5, 5, 6 in 3 micro-batches each
    run_ranks(three, 3, str(tmp_path / "store3"))
    a = [m["loss"] for m in events.metrics(single.run_dir)]
    b = [m["loss"] for m in events.metrics(three.run_dir)]
    # The same mean gradient summed in another order: float32 rounding only.
    assert len(a) == len(b) == 12 and max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
