from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Strategy:
    """Data-parallel defaults; strategies that shard parameters override the state methods."""

    name = ""
    shards_parameters = False  # True: every rank must run every forward (evaluation too)

    @classmethod
    def from_spec(cls, spec) -> Strategy:
        return cls()

    def wrap(self, model: nn.Module, device: torch.device, world_size: int) -> nn.Module:
        raise NotImplementedError

    def save_state(self, directory: str, model: nn.Module, optimizer) -> dict[str, Any]:
        """Write this rank's part of the weights and optimizer into `directory`; return what
        rank 0 should add to state.pt. Called on every rank."""
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state(self, directory: str, model: nn.Module, optimizer, state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0 (a collective where parameters are sharded)."""
        return model.state_dict()
