from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workers.strategies.base import Strategy


class DDP(Strategy):
    """Every rank holds the whole model; gradients are averaged with all-reduce."""

    name = "ddp"

    def wrap(self, model: nn.Module, device: torch.device, world_size: int) -> nn.Module:
        if world_size == 1:
            return model
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
