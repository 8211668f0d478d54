"""Parallelism strategies by name. Each wraps the model for training and owns how its
weights and optimizer state are saved and loaded (whole on rank 0, or sharded)."""

from __future__ import annotations

from workers.strategies.base import Strategy
from workers.strategies.ddp import DDP
from workers.strategies.fsdp import FSDP
from workers.strategies.hybrid import Hybrid
from workers.strategies.pipeline import Pipeline
from workers.strategies.tensor import TensorParallel

REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    if cls.name in REGISTRY:
        raise ValueError(f"strategy {cls.name!r} is registered twice")
    REGISTRY[cls.name] = cls
    return cls


for _cls in (DDP, FSDP, TensorParallel, Pipeline, Hybrid):
    register(_cls)


def build(spec) -> Strategy:
    """The strategy a JobSpec names, with its options."""
    try:
        cls = REGISTRY[spec.strategy]
    except KeyError:
        raise ValueError(f"unknown strategy {spec.strategy!r}; known: {', '.join(sorted(REGISTRY))}") from None
    return cls.from_spec(spec)
