"""The trainer leaves out Ray Train's Ray Data callback (a DatasetManager actor per
worker group) only where a run has no Ray datasets, and on a cluster the driver started
the placement-group cleaner and the autoscaling coordinator."""

from __future__ import annotations

from ray.train import ScalingConfig
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.execution.scaling_policy import (
    ElasticScalingPolicy,
    FixedScalingPolicy,
    create_scaling_policy,
)
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from workers.trainer import NoAutoscalerPolicy, Trainer


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


def test_on_a_cluster_of_its_own_no_cleaner_and_no_autoscaler_requests():
    assert PlacementGroupCleanerCallback in callbacks()  # a cluster at RAY_ADDRESS keeps Ray's defaults
    assert PlacementGroupCleanerCallback not in callbacks(own_cluster=True)


def policy_sent(monkeypatch, own_cluster: bool, num_workers) -> object:
    """The scaling policy the trainer hands its controller (no controller is started)."""
    sent = {}
    monkeypatch.setattr(DataParallelTrainer, "_initialize_and_run_controller", lambda self, **kw: sent.update(kw))
    trainer = Trainer(lambda: None, scaling_config=ScalingConfig(num_workers=num_workers), own_cluster=own_cluster)
    trainer._initialize_and_run_controller(scaling_policy=create_scaling_policy(trainer.scaling_config))
    return sent["scaling_policy"]


def test_a_fixed_run_on_its_own_cluster_asks_no_autoscaler_and_an_elastic_one_keeps_its_coordinator(monkeypatch):
    assert type(policy_sent(monkeypatch, False, 2)) is FixedScalingPolicy
    own = policy_sent(monkeypatch, True, 2)
    assert isinstance(own, NoAutoscalerPolicy)
    own.after_controller_start(None)  # Ray's would start the coordinator actor and wait for it
    own._maybe_send_resource_request()
    assert own._coordinator_client is None
    assert type(policy_sent(monkeypatch, True, (1, 2))) is ElasticScalingPolicy
