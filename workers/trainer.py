"""Ray Train's TorchTrainer, less a Ray worker process this project never uses."""

from __future__ import annotations

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback


class Trainer(TorchTrainer):
    """Ray Train adds its Ray Data callback to every run, and that callback starts a
    DatasetManager actor for every worker group, datasets or not: one more Ray worker
    process per start and restart (measured ~1.9 CPU-s to boot here), competing for the
    cores with the workers that are starting. This project's workers read their own data
    (workers/data.py), so with no Ray datasets the callback is left out. Ray 2.60 offers
    no setting for it; the method is private, and Ray is pinned to 2.60.0 in
    pyproject.toml."""

    def _create_default_callbacks(self):
        callbacks = super()._create_default_callbacks()
        if self.datasets:
            return callbacks
        return [c for c in callbacks if not isinstance(c, DatasetsCallback)]
