"""The trainer leaves out Ray Train's Ray Data callback (a DatasetManager actor per
worker group) only where a run has no Ray datasets."""

from __future__ import annotations

from ray.train import ScalingConfig
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

from workers.trainer import Trainer


def callbacks(**kwargs) -> list[type]:
    trainer = Trainer(lambda: None, scaling_config=ScalingConfig(num_workers=1), **kwargs)
    return [type(c) for c in trainer._create_default_callbacks()]


def test_without_ray_datasets_no_dataset_manager_is_started():
    kinds = callbacks()
    assert DatasetsCallback not in kinds
    assert any(k.__name__ == "BackendSetupCallback" for k in kinds)  # the rest is Ray Train's own


def test_with_ray_datasets_the_callback_stays():
    # A dataset factory: Ray Train calls it once the workers start, not here.
    assert DatasetsCallback in callbacks(datasets={"train": lambda: None})
