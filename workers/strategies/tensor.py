from __future__ import annotations

import contextlib

import torch
from torch import nn

from workers.strategies.base import low_precision
from workers.strategies.fsdp import NoGradientSync
from workers.strategies.sharded import DataTimesModel


class TensorParallel(DataTimesModel):
    """DTensor tensor parallelism: each of the model's linear layers split across `tp`
    ranks (by column, then by row, so one block needs two all-reduces). With `tp` <
    world size, a 2-D mesh: FSDP across the `world / tp` data-parallel groups."""

    name = "tensor"
    inner = "tp"

    def __init__(self, tp: int | None = None, param_dtype: torch.dtype | None = None):
        super().__init__()
        self.degree, self.param_dtype = tp, param_dtype

    @classmethod
    def from_spec(cls, spec) -> TensorParallel:
        return cls(tp=None, param_dtype=low_precision(spec.precision))  # strategy 'tensor': all ranks

    def wrap(self, model: nn.Module, task=None) -> nn.Module:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, self.mesh["tp"], task.tensor_plan(model))
        self.shard_data_parallel(model, self.param_dtype, task)
        self.model = model
        return model

    def no_sync(self, trained: nn.Module):
        return NoGradientSync(trained) if self.data_world > 1 else contextlib.nullcontext()
