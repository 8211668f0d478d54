"""Tasks: what is trained (model, data, loss), apart from how it is distributed.

A task is any object with `model()`, `datasets()` and `loss(output, target)`, and the
optional hooks `metrics`, `optimizer`, `fsdp_units`, `tensor_plan` and
`pipeline_stages` (README, "Your own code"). Duck-typed: a user's task imports nothing
from this project. The built-in models and datasets are tasks too (builtin.py), found
through `BUILTIN` by the kind of dataset the spec names.
"""

from __future__ import annotations

import importlib
from typing import Any

from workers.spec import TEXT_DATASETS, JobSpec

REQUIRED = ("model", "datasets", "loss")
# "module:Class" of the built-in tasks, imported when used: checking a user's task
# (`python -m workers.check`, run by the service on every submission) must not pay for
# torch and torchvision unless the task itself imports them.
BUILTIN: dict[str, str] = {"images": "workers.tasks.builtin:ImageTask", "text": "workers.tasks.builtin:TextTask"}


class TaskError(ValueError):
    """The spec's task cannot be imported, built, or run with the spec's strategy."""


def builtin_kind(spec: JobSpec) -> str:
    return "text" if spec.dataset.name in TEXT_DATASETS else "images"


def describe(spec: JobSpec) -> str:
    return f"task {spec.task}" if spec.task else f"{spec.model.name} on {spec.dataset.name}"


def load(spec: JobSpec) -> Any:
    """The spec's task, built afresh (a user's from `task_config`, on every attempt)."""
    if not spec.task:
        return _named(BUILTIN[builtin_kind(spec)])(spec)
    try:
        factory = _named(spec.task)
    except (ImportError, AttributeError) as e:
        raise TaskError(f"task {spec.task!r} cannot be imported: {type(e).__name__}: {e} (ship the code with "
                        "--code DIR, or put the module on the workers' PYTHONPATH)") from e
    task = factory(dict(spec.task_config))
    missing = [hook for hook in REQUIRED if not callable(getattr(task, hook, None))]
    if missing:
        raise TaskError(f"task {spec.task!r} returned a {type(task).__name__} without {', '.join(m + '()' for m in missing)}: "
                        f"a task needs model(), datasets() and loss(output, target)")
    return task


def _named(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def needed_hooks(spec: JobSpec) -> list[str]:
    """The optional hooks the spec's strategy cannot do without."""
    p, strategy = spec.parallel, spec.strategy
    if strategy == "tensor" or (strategy == "hybrid" and p.tensor > 1):
        return ["tensor_plan"]
    if strategy == "pipeline" or (strategy == "hybrid" and p.pipeline > 1):
        return ["pipeline_stages"]
    return []


def hook_error(spec: JobSpec, task: Any) -> str | None:
    """Why the task cannot run under the spec's strategy, or None."""
    missing = [hook for hook in needed_hooks(spec) if not callable(getattr(task, hook, None))]
    if not missing:
        return None
    signatures = {"tensor_plan": "tensor_plan(model)", "pipeline_stages": "pipeline_stages(model, n)"}
    return (f"strategy {spec.strategy!r} needs the task's {signatures[missing[0]]} hook; {describe(spec)} "
            f"({type(task).__name__}) has none")
