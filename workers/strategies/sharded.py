"""What every strategy whose ranks hold different parts of the model shares: its
checkpoints go through torch.distributed.checkpoint (one file per rank plus .metadata,
sealed by the run directory's manifest like any shard), so a different number or layout
of ranks can load them, and they can be written in the background."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from workers import storage
from workers.strategies.base import Strategy, gather_on_rank0


class Sharded(Strategy):
    shards_parameters = True

    def __init__(self) -> None:
        self._pending = None  # the future of a background save
        self._save_group = None

    def save_state(self, directory: str, model: nn.Module, optimizer, *, background: bool = False) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        model_sd, optim_sd = _state_dicts(model, optimizer)
        storage.makedirs(directory)
        state = {"model": model_sd, "optimizer": optim_sd}
        if not background:
            dcp.save(state, checkpoint_id=directory)
            return {}
        if self._save_group is None:
            # The writer thread's collectives need a group of their own: on the default
            # group they interleave with training's and both sides deadlock. gloo: the
            # writer works on CPU copies, and NCCL takes no CPU tensors.
            self._save_group = dist.new_group(backend="gloo")
        # Copies the state to CPU memory first, so the next steps may change the weights.
        self._pending = dcp.async_save(state, checkpoint_id=directory, process_group=self._save_group)
        return {}

    def wait_saved(self, block: bool) -> bool:
        if self._pending is None:
            return True
        if not block and not self._pending.done():
            return False
        self._pending.result()  # raises what the writer raised
        self._pending = None
        return True

    def load_state(self, directory: str, model: nn.Module, optimizer, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        model_sd, optim_sd = _state_dicts(model, optimizer)
        loaded = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(loaded, checkpoint_id=directory)  # reshards when the ranks or the mesh changed
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"],
                       options=_flat())

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Every rank gathers its module's full tensors (a collective within each mesh
        # dimension); where ranks hold different modules (pipeline stages), rank 0 merges.
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        mine = {k: v.detach().cpu() for k, v in full.items()} if self.contributes_full_state else {}
        return gather_on_rank0(mine, self.world_size) if self.holds_part_of_model else mine

    @property
    def contributes_full_state(self) -> bool:
        return self.rank == 0 or self.holds_part_of_model

    holds_part_of_model = False  # True where ranks hold different modules, not shards of one


class DataTimesModel(Sharded):
    """A 2-D mesh ("dp", `inner`): groups of `degree` ranks split one model (tensor or
    pipeline parallel), and the `world / degree` groups are data parallel (FSDP). The
    ranks of one group read the same share of each batch."""

    inner = ""

    def setup(self, device: torch.device, rank: int, world_size: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        super().setup(device, rank, world_size)
        self.degree = self.degree or world_size  # None: the whole world splits one model
        self.mesh = init_device_mesh(device.type, (world_size // self.degree, self.degree),
                                     mesh_dim_names=("dp", self.inner))

    @property
    def data_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def data_world(self) -> int:
        return self.mesh["dp"].size()

    def shard_data_parallel(self, model: nn.Module, param_dtype: torch.dtype | None, task=None) -> None:
        from workers.strategies.fsdp import fsdp_policies, shard_blocks, units

        if self.data_world > 1:
            shard_blocks(model, units(task, model), mesh=self.mesh["dp"], **fsdp_policies(self.device, False, param_dtype))


def _state_dicts(model: nn.Module, optimizer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, optimizer, options=_flat())


def _flat():
    # Optimizer settings keyed by parameter name, not by param-group index: pipeline
    # stages each have a group 0 of different parameters, and a checkpoint keeps one
    # copy of a key, so by index one stage would load another's group.
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)
