from __future__ import annotations

import contextlib

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workers.strategies.base import Strategy


class DDP(Strategy):
    """Every rank holds the whole model; gradients are averaged with all-reduce."""

    name = "ddp"

    def wrap(self, model: nn.Module, task=None) -> nn.Module:
        self.model = model
        if self.world_size == 1:
            return model
        return DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def no_sync(self, trained: nn.Module):
        return trained.no_sync() if isinstance(trained, DistributedDataParallel) else contextlib.nullcontext()
