"""Ray Train's TorchTrainer, less the Ray worker processes this project has no use for
and torch in the driver, and a warm spare for one it starts with every worker group."""

from __future__ import annotations

from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.execution.callback import WorkerGroupCallback
from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer


class Trainer(DataParallelTrainer):
    """Ray's TorchTrainer only fills in a default `TorchConfig`, from `ray.train.torch`,
    which imports torch: this project always passes its backend config
    (workers/torch_backend.py in exact mode), so the driver never needs torch.

    Each actor Ray Train starts is one more Ray worker process booting (~1-2 CPU-s
    each here) beside the workers that are starting, on the same cores. Left out:

    - Ray Data's callback, with no Ray datasets: it starts a DatasetManager actor for
      every worker group, datasets or not. This project's workers read their own data
      (workers/data.py).
    - On a cluster this driver started (`own_cluster`), which it stops when the job ends:
      the placement-group cleaner, a detached actor that removes the run's placement
      groups should the controller die, where the cluster ends with the job anyway; and
      the autoscaling coordinator, an actor the controller asks for resources and waits
      for (up to 5 s) before it starts the first worker group, where no autoscaler runs.
      An elastic run keeps the coordinator: its policy reads the reserved resources there.

    Ray 2.60 offers no setting for either; the methods are private, and Ray is pinned
    to 2.60.0 in pyproject.toml."""

    def __init__(self, *args, own_cluster: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.own_cluster = own_cluster

    def _create_default_callbacks(self):
        drop = (() if self.datasets else (DatasetsCallback,)) + \
            ((PlacementGroupCleanerCallback,) if self.own_cluster else ())
        return [c for c in super()._create_default_callbacks() if not isinstance(c, drop)]

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        if self.own_cluster and type(controller_init_kwargs.get("scaling_policy")) is FixedScalingPolicy:
            controller_init_kwargs["scaling_policy"] = NoAutoscalerPolicy(self.scaling_config)
        return super()._initialize_and_run_controller(**controller_init_kwargs)


class NoAutoscalerPolicy(FixedScalingPolicy):
    """A fixed worker count on a cluster with no autoscaler: nothing to ask for resources."""

    def after_controller_start(self, train_run_context) -> None:
        pass

    def _maybe_send_resource_request(self) -> None:
        pass

    def _send_resource_request(self) -> None:
        pass


class SyncActorSpare(WorkerGroupCallback):
    """Runs in the controller (failure.spares): a warm spare for the synchronization
    actor Ray Train starts with every worker group, on the controller's node and in the
    controller's runtime env. Without one that actor's process boots beside the new
    workers on every restart (~1.9 CPU-s here), while they build their task. The
    workers' own spares are theirs to ask for (workers/run.py); this one only the
    controller can, since only its runtime env string is the actor's. A
    WorkerGroupCallback, Ray-internal, because no public callback sees a group start;
    Ray Train passes a run's callbacks that are not UserCallbacks on as they are
    ("custom workarounds built on top of internal callbacks", its source says)."""

    def __init__(self):
        self._stop = None  # made in the controller: an Event does not pickle

    def after_worker_group_start(self, worker_group) -> None:
        import threading

        from workers import spares

        self._stop = threading.Event()
        spares.keep(1, train=False, stop=self._stop)

    def before_worker_group_shutdown(self, worker_group) -> None:
        self._halt()

    def before_worker_group_abort(self, worker_group_context) -> None:
        self._halt()

    def _halt(self) -> None:
        if self._stop is not None:
            self._stop.set()
