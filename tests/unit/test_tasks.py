"""The task seam: loading a user's task, the hooks a strategy needs, and workers.run
refusing a spec its task cannot run before any worker starts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, write_spec
from workers import tasks
from workers.check import problem
from workers.data.loader import read
from workers.spec import JobSpec

EXAMPLE = ROOT / "examples" / "own-task"


def wave(**changes) -> JobSpec:
    return JobSpec.model_validate({"task": "sine:make_task", "task_config": {"samples": 256}, **changes})


def test_a_users_task_is_imported_from_the_code_directory_and_built_from_task_config():
    assert problem(wave(), str(EXAMPLE)) is None
    task = tasks.load(wave())
    train, val = task.datasets()
    assert len(train) == 256 and len(val) == 32
    x, y = train[0]
    assert task.loss(task.model()(x[None]), y[None]).dim() == 0


@pytest.mark.parametrize("strategy, hook", [("tensor", "tensor_plan(model)"), ("pipeline", "pipeline_stages(model, n)")])
def test_a_strategy_whose_hook_the_task_lacks_is_named(strategy, hook):
    reason = problem(wave(strategy=strategy, parallel={"microbatches": 2}), str(EXAMPLE))
    assert reason and f"strategy {strategy!r} needs the task's {hook} hook" in reason and "SineTask" in reason


def test_a_task_that_cannot_be_imported_or_lacks_the_contract_is_named(tmp_path):
    assert "cannot be imported" in problem(JobSpec.model_validate({"task": "no_such_module_xyz:make"}))
    (tmp_path / "half.py").write_text("class T:\n    def model(self): pass\n\ndef make(config): return T()\n")
    reason = problem(JobSpec.model_validate({"task": "half:make"}), str(tmp_path))
    assert "without datasets(), loss()" in reason


def test_built_in_tasks_come_from_the_registry_and_keep_the_split_hooks():
    from workers.tasks.builtin import ImageTask

    assert type(tasks.load(JobSpec.model_validate({}))) is ImageTask
    text = tasks.load(JobSpec.model_validate({"model": "gpt", "dataset": "synthetic_tokens"}))
    assert callable(text.tensor_plan) and callable(text.pipeline_stages)


def test_a_map_style_dataset_reads_through_a_dataloader_with_worker_processes():
    data = torch.utils.data.TensorDataset(torch.arange(40.0)[:, None], torch.arange(40))
    order = [torch.tensor([3, 1, 2]), torch.tensor([9, 8])]
    for workers in (0, 2):
        batches = list(read(data, order, workers=workers))
        assert [b[1].tolist() for b in batches] == [[3, 1, 2], [9, 8]]
    before = torch.get_rng_state()
    list(read(data, order))
    assert torch.equal(before, torch.get_rng_state())  # the training RNG is not the loader's


def test_workers_run_refuses_the_spec_before_any_worker_starts(tmp_path):
    spec = {"job_id": "no-tensor-plan", "task": "sine:make_task", "strategy": "tensor", "workers": 2,
            "storage": str(tmp_path / "runs")}
    done = subprocess.run([sys.executable, "-m", "workers.run", str(write_spec(tmp_path, spec)), "--code", str(EXAMPLE)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "needs the task's tensor_plan(model) hook" in done.stderr
    assert "attempt_started" not in (tmp_path / "runs" / "no-tensor-plan" / "events.jsonl").read_text()


def test_the_check_command_says_the_same_with_exit_2(tmp_path):
    spec = write_spec(tmp_path, {"task": "sine:make_task", "strategy": "pipeline", "workers": 2})
    done = subprocess.run([sys.executable, "-m", "workers.check", str(spec), "--code", str(EXAMPLE)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "pipeline_stages(model, n)" in done.stderr
    ok = write_spec(tmp_path, {"task": "sine:make_task", "strategy": "fsdp", "workers": 2}, "ok.yaml")
    assert subprocess.run([sys.executable, "-m", "workers.check", str(ok), "--code", str(EXAMPLE)]).returncode == 0


def test_checking_a_task_that_cannot_be_imported_does_not_import_torch(tmp_path):
    """The service checks every submitted task in a child process: a bad name must be
    answered at once, not after torch's import."""
    spec = write_spec(tmp_path, {"task": "no_such_module_xyz:make"})
    code = ("import sys; from workers.check import main; rc = main([sys.argv[1]]); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, str(spec)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "cannot be imported" in done.stderr, done.stderr
