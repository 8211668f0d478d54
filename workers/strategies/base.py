from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def low_precision(precision: str) -> torch.dtype | None:
    """The spec's precision as the dtype autocast and FSDP compute in; None for fp32."""
    return AMP_DTYPES.get(precision)


class Strategy:
    """How one rank takes part in training: which samples it reads, what part of the
    model it holds, how a step runs, and how its weights and optimizer state are saved.

    Data-parallel defaults (every rank a whole model and its own share of the batch);
    model-parallel strategies override what differs."""

    name = ""
    shards_parameters = False  # True: the full weights exist only after a gather

    @classmethod
    def from_spec(cls, spec) -> Strategy:
        return cls()

    def setup(self, device: torch.device, rank: int, world_size: int) -> None:
        """Called once the process group exists; model-parallel strategies build their mesh."""
        self.device, self.rank, self.world_size = device, rank, world_size

    @property
    def data_rank(self) -> int:
        """Which share of each global batch this rank reads: ranks that split one model
        (tensor, pipeline) read the same share."""
        return self.rank

    @property
    def data_world(self) -> int:
        return self.world_size

    @property
    def owns_loss(self) -> bool:
        """Whether this rank computes the loss (a pipeline's last stage only)."""
        return True

    def wrap(self, model: nn.Module, task: Any = None) -> nn.Module:
        """Return what this rank trains: its optimizer covers `self.model`'s parameters.
        `task` offers the hooks model-parallel strategies split the model by."""
        self.model = model
        return model

    def no_sync(self, trained: nn.Module):
        """Skip the gradient reduction for all but the last micro-batch of a step."""
        return contextlib.nullcontext()

    def train_step(self, trained: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn,
                   micro_batches: int, weight: float, scale: Callable[[torch.Tensor], torch.Tensor],
                   amp: Callable[[], contextlib.AbstractContextManager]) -> torch.Tensor:
        """Forward and backward over this rank's share, in `micro_batches` pieces; return
        the loss it contributes (detached). `weight` evens out unequal shares; `scale` is
        the fp16 loss scale; `amp` the autocast context for forward passes."""
        total = torch.zeros((), device=x.device)
        pieces = list(zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches)))
        for i, (xs, ys) in enumerate(pieces):
            sync = contextlib.nullcontext() if i == len(pieces) - 1 else self.no_sync(trained)
            with sync:
                with amp():
                    loss = loss_fn(trained(xs), ys) * (weight * len(xs) / len(x))
                scale(loss).backward()
            total += loss.detach()
        return total

    def save_state(self, directory: str, model: nn.Module, optimizer, *, background: bool = False) -> dict[str, Any]:
        """Write this rank's part of the weights and optimizer into `directory`; return what
        rank 0 should add to state.pt. Called on every rank."""
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def wait_saved(self, block: bool) -> bool:
        """Whether the background write started by save_state is done on this rank."""
        return True

    def load_state(self, directory: str, model: nn.Module, optimizer, state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0 (a collective where parameters are sharded)."""
        return model.state_dict()


def gather_on_rank0(part: dict[str, torch.Tensor], world_size: int) -> dict[str, torch.Tensor]:
    """Merge every rank's named tensors on rank 0 (each rank holds different names)."""
    if world_size == 1:
        return part
    parts = [None] * world_size if dist.get_rank() == 0 else None
    dist.gather_object(part, parts, dst=0)
    merged: dict[str, torch.Tensor] = {}
    for p in parts or []:
        merged.update(p)
    return merged
