from __future__ import annotations

from workers.strategies.base import Strategy, low_precision
from workers.strategies.fsdp import FSDP
from workers.strategies.pipeline import Pipeline
from workers.strategies.tensor import TensorParallel


class Hybrid(Strategy):
    """A 2-D mesh: data parallel (FSDP) times tensor or pipeline parallel, or HSDP
    (replicate x shard). It only chooses; the strategy it builds does the work."""

    name = "hybrid"

    @classmethod
    def from_spec(cls, spec) -> Strategy:
        p = spec.parallel
        dtype = low_precision(spec.precision)
        if p.tensor > 1:
            return TensorParallel(tp=p.tensor, param_dtype=dtype)
        if p.pipeline > 1:
            return Pipeline(p.microbatches, p.schedule, pp=p.pipeline, param_dtype=dtype)
        return FSDP(cpu_offload=spec.fsdp.cpu_offload, param_dtype=dtype, shard=p.shard)
