from __future__ import annotations

import contextlib

import torch
from torch import nn

from workers.strategies.fsdp import NoGradientSync, fsdp_policies, shard_blocks
from workers.strategies.sharded import Sharded


class TensorParallel(Sharded):
    """DTensor tensor parallelism: each of the model's linear layers split across `tp`
    ranks (by column, then by row, so one block needs two all-reduces). With `tp` <
    world size, a 2-D mesh: FSDP across the `world / tp` data-parallel groups."""

    name = "tensor"

    def __init__(self, tp: int | None = None, param_dtype: torch.dtype | None = None):
        super().__init__()
        self.tp, self.param_dtype = tp, param_dtype

    @classmethod
    def from_spec(cls, spec) -> TensorParallel:
        return cls(tp=None, param_dtype=_dtype(spec.precision))  # strategy 'tensor': all ranks

    def setup(self, device: torch.device, rank: int, world_size: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        super().setup(device, rank, world_size)
        tp = self.tp or world_size
        self.mesh = init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))

    @property
    def data_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def data_world(self) -> int:
        return self.mesh["dp"].size()

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.tensor.parallel import parallelize_module

        if not hasattr(model, "tensor_parallel_plan"):
            raise ValueError(f"{type(model).__name__} has no tensor_parallel_plan(): tensor parallelism needs model 'gpt'")
        parallelize_module(model, self.mesh["tp"], model.tensor_parallel_plan())
        if self.data_world > 1:
            shard_blocks(model, mesh=self.mesh["dp"], **fsdp_policies(self.device, False, self.param_dtype))
        self.model = model
        return model

    def no_sync(self, trained: nn.Module):
        return NoGradientSync(trained) if self.data_world > 1 else contextlib.nullcontext()


def _dtype(precision: str) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
