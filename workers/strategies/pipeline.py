from __future__ import annotations

import torch
from torch import nn

from workers.strategies.base import LossFn
from workers.strategies.fsdp import fsdp_policies, shard_blocks
from workers.strategies.sharded import Sharded


class Pipeline(Sharded):
    """torch.distributed.pipelining: the layers split into `pp` contiguous stages, one per
    rank, each step's batch into micro-batches that flow through them (GPipe: all
    forwards, then all backwards; 1F1B: interleaved, so fewer activations are held).
    With `pp` < world size, a 2-D mesh: FSDP across the `world / pp` copies of each stage."""

    name = "pipeline"
    holds_part_of_model = True

    def __init__(self, microbatches: int, schedule: str = "1f1b", pp: int | None = None,
                 param_dtype: torch.dtype | None = None):
        super().__init__()
        self.microbatches, self.schedule_name, self.pp, self.param_dtype = microbatches, schedule, pp, param_dtype
        self.schedule = None

    @classmethod
    def from_spec(cls, spec) -> Pipeline:
        return cls(spec.parallel.microbatches, spec.parallel.schedule, None,
                   {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec.precision))

    def setup(self, device: torch.device, rank: int, world_size: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        super().setup(device, rank, world_size)
        pp = self.pp or world_size
        self.mesh = init_device_mesh(device.type, (world_size // pp, pp), mesh_dim_names=("dp", "pp"))
        self.stage_index, self.stages = self.mesh["pp"].get_local_rank(), pp

    @property
    def data_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def data_world(self) -> int:
        return self.mesh["dp"].size()

    @property
    def owns_loss(self) -> bool:
        return self.stage_index == self.stages - 1

    @property
    def contributes_full_state(self) -> bool:
        return self.data_rank == 0  # one copy of each stage

    def wrap(self, model: nn.Module) -> nn.Module:
        if not hasattr(model, "keep_stage"):
            raise ValueError(f"{type(model).__name__} has no keep_stage(): pipeline parallelism needs model 'gpt'")
        # The whole model is built (same seed, same initial weights as one process), then
        # each rank keeps its stage.
        model.keep_stage(self.stage_index, self.stages)
        if self.data_world > 1:
            shard_blocks(model, mesh=self.mesh["dp"], **fsdp_policies(self.device, False, self.param_dtype))
        self.model = model
        return model

    def _build_schedule(self, loss_fn: LossFn) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stage = PipelineStage(self.model, self.stage_index, self.stages, self.device, group=self.mesh["pp"].get_group())
        cls = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
        # scale_grads: the stage divides gradients by the micro-batch count, so a step is
        # the mean over the whole batch, as in one process.
        self.schedule = cls(stage, n_microbatches=self.microbatches, loss_fn=loss_fn, scale_grads=True)

    def train_step(self, trained, x, y, loss_fn, micro_batches, weight, scale, amp) -> torch.Tensor:
        if self.schedule is None:  # fp16 (so `scale`) is refused for pipelines when the spec is read
            self._build_schedule(lambda out, target: loss_fn(out, target) * weight)
        losses: list[torch.Tensor] = []
        first, last = self.stage_index == 0, self.owns_loss
        with amp():  # the schedule runs forwards and backwards interleaved: one context for both
            self._run(x, y, losses, first, last)
        if not last:
            return torch.zeros((), device=x.device)
        return torch.stack([loss.detach() for loss in losses]).mean()

    def _run(self, x, y, losses, first: bool, last: bool) -> None:
        if first and last:
            self.schedule.step(x, target=y, losses=losses)
        elif first:
            self.schedule.step(x)
        elif last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
