from __future__ import annotations

from itertools import chain

import torch
from torch import nn

from workers.strategies.base import LossFn, low_precision
from workers.strategies.sharded import DataTimesModel


class Pipeline(DataTimesModel):
    """torch.distributed.pipelining: the layers split into `pp` contiguous stages, one per
    rank, each step's batch into micro-batches that flow through them (GPipe: all
    forwards, then all backwards; 1F1B: interleaved, so fewer activations are held).
    With `pp` < world size, a 2-D mesh: FSDP across the `world / pp` copies of each stage."""

    name = "pipeline"
    inner = "pp"
    holds_part_of_model = True

    def __init__(self, microbatches: int, schedule: str = "1f1b", pp: int | None = None,
                 param_dtype: torch.dtype | None = None):
        super().__init__()
        self.microbatches, self.schedule_name, self.degree, self.param_dtype = microbatches, schedule, pp, param_dtype
        self.schedule = None

    @classmethod
    def from_spec(cls, spec) -> Pipeline:
        return cls(spec.parallel.microbatches, spec.parallel.schedule, None,
                   low_precision(spec.precision))

    def setup(self, device: torch.device, rank: int, world_size: int) -> None:
        super().setup(device, rank, world_size)
        self.stage_index, self.stages = self.mesh["pp"].get_local_rank(), self.degree

    @property
    def owns_loss(self) -> bool:
        return self.stage_index == self.stages - 1

    @property
    def contributes_full_state(self) -> bool:
        return self.data_rank == 0  # one copy of each stage

    def wrap(self, model: nn.Module, task=None) -> nn.Module:
        # The whole model is built (same seed, same initial weights as one process), then
        # each rank keeps its stage.
        stages = list(task.pipeline_stages(model, self.stages))
        if len(stages) != self.stages:
            raise ValueError(f"the task's pipeline_stages(model, {self.stages}) returned {len(stages)} stages")
        self.stage_module = stages[self.stage_index]
        self.model = saved_part(model, self.stage_module)
        self.shard_data_parallel(self.stage_module, self.param_dtype, task)
        return self.stage_module

    def _build_schedule(self, loss_fn: LossFn) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stage = PipelineStage(self.stage_module, self.stage_index, self.stages, self.device, group=self.mesh["pp"].get_group())
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


def saved_part(model: nn.Module, stage: nn.Module) -> nn.Module:
    """What a stage's rank saves and optimizes, under the whole model's names, so stage
    parts never share a name and a checkpoint reshards by name: the stage itself where
    its names already are the model's (gpt's stages), else the model with every
    parameter and buffer the stage does not hold removed (the stage shares its modules)."""
    def tensors(module: nn.Module):
        return chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False))

    whole = {id(t): name for name, t in tensors(model)}
    own = list(tensors(stage))
    if all(whole.get(id(t)) == name for name, t in own):
        return stage
    kept = {id(t) for _, t in own}
    if not kept <= set(whole):
        raise ValueError("the task's pipeline_stages() returned a stage with parameters that are not the model's: "
                         "build the stages from the model's own modules")
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name in [n for n, t in store.items() if t is not None and id(t) not in kept]:
                del store[name]
    return model
