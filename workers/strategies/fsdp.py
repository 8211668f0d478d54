from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from workers.strategies.base import Strategy

class FSDP(Strategy):
    """FSDP2: parameters, gradients and optimizer state sharded across ranks
    (fully_shard per block, then the root). Checkpoints go through torch.distributed.checkpoint
    (one file per rank plus .metadata, sealed by the run directory's manifest like any shard),
    so a different number of ranks can load them."""

    name = "fsdp"
    shards_parameters = True

    def __init__(self, cpu_offload: bool = False, param_dtype: torch.dtype | None = None):
        self.cpu_offload = cpu_offload
        self.param_dtype = param_dtype

    @classmethod
    def from_spec(cls, spec) -> FSDP:
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
        return cls(cpu_offload=spec.fsdp.cpu_offload, param_dtype=dtypes.get(spec.precision))

    def wrap(self, model: nn.Module, device: torch.device, world_size: int) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kwargs = {}
        if self.cpu_offload:  # pin_memory needs a CUDA driver: on CPU-only machines, don't pin
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        if self.param_dtype is not None:  # compute in low precision, reduce gradients in fp32
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        for block in _blocks(model):
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def save_state(self, directory: str, model: nn.Module, optimizer) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        os.makedirs(directory, exist_ok=True)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=directory)
        return {}

    def load_state(self, directory: str, model: nn.Module, optimizer, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        loaded = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(loaded, checkpoint_id=directory)  # reshards when the world size changed
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The units FSDP gathers one at a time: a model's repeated blocks where it names them
    (torchvision ResNet's layer1..4, a transformer's layers), else its direct children
    that hold parameters."""
    for attr in ("layers", "blocks", "h"):
        container = getattr(model, attr, None)
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            return list(container)
    named = [getattr(model, f"layer{i}") for i in range(1, 5) if hasattr(model, f"layer{i}")]
    if named:
        return named
    return [child for child in model.children() if any(True for _ in child.parameters())]
