"""Validation during training (evaluation.every_steps), without Ray: scores land in that
step's metrics line, and training ends with the same weights as without it, resumed or not."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from tests.helpers.ranks import run_ranks
from workers import events
from workers.faults import InjectedFault
from workers.loop import WorkerEnv, train
from workers.spec import JobSpec


def job(tmp_path, job_id, every: int | None = 20, **overrides) -> JobSpec:
    spec = JobSpec.model_validate({
        "job_id": job_id, "model": "simple_cnn", "workers": 1,
        "dataset": {"name": "synthetic", "size": 384, "noise": 2.0},
        "training": {"max_steps": 60, "global_batch_size": 32, "seed": 7},
        "checkpoint": {"every_steps": 10, "keep": 3}, "storage": str(tmp_path),
        **({"evaluation": {"every_steps": every}} if every else {}), **overrides,
    })
    os.makedirs(spec.run_dir, exist_ok=True)
    return spec


def one_rank() -> WorkerEnv:
    return WorkerEnv(rank=0, world_size=1, local_rank=0)


def validated(run_dir: str) -> dict[int, dict]:
    return {m["step"]: m for m in events.metrics(run_dir) if "val_loss" in m}


def test_every_steps_must_be_a_positive_count():
    with pytest.raises(ValidationError, match="evaluation.every_steps must be at least 1"):
        JobSpec.model_validate({"evaluation": {"every_steps": 0}})
    assert JobSpec().evaluation is None


def test_validation_every_20_steps_leaves_the_weights_and_resume_exact(tmp_path):
    plain = train(job(tmp_path, "plain", every=None), one_rank())
    assert validated(os.path.join(tmp_path, "plain")) == {}

    spec = job(tmp_path, "evaluated")
    finished = train(spec, one_rank())
    assert finished["weights_sha256"] == plain["weights_sha256"]  # evaluation did not disturb training
    rows = validated(spec.run_dir)
    assert sorted(rows) == [20, 40, 60]
    for row in rows.values():
        assert set(row["val_metrics"]) == {"accuracy"}
        assert row["val_accuracy"] == row["val_metrics"]["accuracy"]
        assert 0 <= row["val_accuracy"] <= 1 and row["val_loss"] > 0
    # Step 60's scores are the final evaluation's: one code path, same model.
    assert rows[60]["val_loss"] == pytest.approx(finished["val_loss"], rel=1e-6)
    assert rows[60]["val_accuracy"] == pytest.approx(finished["val_accuracy"])

    faulty = job(tmp_path, "faulty", faults=[{"at_step": 45, "rank": 0, "kind": "exception"}])
    with pytest.raises(InjectedFault):
        train(faulty, one_rank())
    resumed = train(faulty, one_rank())  # from the checkpoint of step 40, which step 40's validation preceded
    assert resumed["weights_sha256"] == plain["weights_sha256"]
    steps = [m["step"] for m in events.metrics(faulty.run_dir) if "val_loss" in m]
    assert steps == [20, 40, 60]


def test_a_split_model_is_validated_on_every_rank_and_keeps_its_weights(tmp_path):
    """Tensor parallel, on 2 ranks: no rank holds the model, so every rank scores its share
    with a whole one built from broadcast weights (the path fsdp, pipeline and hybrid take)."""
    strategy = "tensor"

    def seq_job(job_id, every):
        return JobSpec.model_validate({
            "job_id": job_id, "task": "tests.helpers.seq_task:make_task", "workers": 2, "strategy": strategy,
            "training": {"max_steps": 12, "global_batch_size": 32, "seed": 5, "lr": 0.01},
            "checkpoint": {"every_steps": 5}, "storage": str(tmp_path),
            **({"evaluation": {"every_steps": every}} if every else {}),
        })

    plain = run_ranks(seq_job("plain", None), 2, str(tmp_path / "store-plain"))
    evaluated = run_ranks(seq_job("evaluated", 4), 2, str(tmp_path / "store-evaluated"))
    assert evaluated["weights_sha256"] == plain["weights_sha256"]
    rows = validated(str(tmp_path / "evaluated"))
    assert sorted(rows) == [4, 8, 12]
    assert all(row["val_metrics"] == {} and "val_accuracy" not in row for row in rows.values())  # mse only
    assert rows[12]["val_loss"] == pytest.approx(evaluated["val_loss"], rel=1e-5)
