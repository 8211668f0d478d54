from __future__ import annotations

import torch
from torch import nn

from workers.strategies.base import low_precision
from workers.strategies.sharded import Sharded


class FSDP(Sharded):
    """FSDP2: parameters, gradients and optimizer state sharded across ranks (fully_shard
    per block, then the root). With `shard` < world size it is HSDP: shards within
    groups of `shard` ranks, replicas across the groups (a 2-D mesh)."""

    name = "fsdp"

    def __init__(self, cpu_offload: bool = False, param_dtype: torch.dtype | None = None, shard: int | None = None):
        super().__init__()
        self.cpu_offload, self.param_dtype, self.shard = cpu_offload, param_dtype, shard

    @classmethod
    def from_spec(cls, spec) -> FSDP:
        return cls(cpu_offload=spec.fsdp.cpu_offload, param_dtype=low_precision(spec.precision),
                   shard=spec.parallel.shard)

    def wrap(self, model: nn.Module, task=None) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        kwargs = {}
        if self.shard and self.shard < self.world_size:
            kwargs["mesh"] = init_device_mesh(self.device.type, (self.world_size // self.shard, self.shard),
                                              mesh_dim_names=("replicate", "shard"))
        kwargs.update(fsdp_policies(self.device, self.cpu_offload, self.param_dtype))
        shard_blocks(model, units(task, model), **kwargs)
        self.model = model
        return model

    def no_sync(self, trained: nn.Module):
        return NoGradientSync(trained)


class NoGradientSync:
    """FSDP2's counterpart of DDP's no_sync(): accumulate gradients locally."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __enter__(self):
        self.module.set_requires_gradient_sync(False)

    def __exit__(self, *exc):
        self.module.set_requires_gradient_sync(True)


def fsdp_policies(device: torch.device, cpu_offload: bool, param_dtype: torch.dtype | None) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    kwargs = {}
    if cpu_offload:  # pin_memory needs a CUDA driver: on CPU-only machines, don't pin
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    if param_dtype is not None:  # compute in low precision, reduce gradients in fp32
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    return kwargs


def shard_blocks(model: nn.Module, blocks: list[nn.Module], **kwargs) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def units(task, model: nn.Module) -> list[nn.Module]:
    """The modules FSDP gathers one at a time: the task's `fsdp_units(model)` if it has
    the hook, else what _blocks finds."""
    hook = getattr(task, "fsdp_units", None)
    return list(hook(model)) if callable(hook) else _blocks(model)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """A model's repeated blocks where it names them
    (torchvision ResNet's layer1..4, a transformer's layers), else its direct children
    that hold parameters."""
    for attr in ("layers", "blocks", "h"):
        container = getattr(model, attr, None)
        if isinstance(container, nn.ModuleDict):
            return list(container.values())
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            return list(container)
    named = [getattr(model, f"layer{i}") for i in range(1, 5) if hasattr(model, f"layer{i}")]
    if named:
        return named
    return [child for child in model.children() if any(True for _ in child.parameters())]
