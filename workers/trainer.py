"""Ray Train's TorchTrainer, less a Ray worker process this project never uses, and a warm
spare for one it starts with every worker group."""

from __future__ import annotations

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.execution.callback import WorkerGroupCallback


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
