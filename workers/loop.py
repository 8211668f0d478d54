"""The per-worker training loop.

It runs the same under Ray Train (`ray_train_func`) and under plain torchrun
(bench/), given a `WorkerEnv`; the process group already exists when it starts.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from workers import checkpoint, events, failures, strategies
from workers.data import Splits, load
from workers.data.sampler import ResumableDistributedSampler
from workers.faults import FaultInjector
from workers.models import build_model
from workers.profiling import StepProfiler
from workers.spec import JobSpec, TrainingSpec
from workers.strategies.base import low_precision


@dataclass
class WorkerEnv:
    rank: int
    world_size: int
    local_rank: int
    # Called on every rank after a commit; rank 0 gets the committed path, others None.
    on_checkpoint: Callable[[dict[str, Any], str | None], None] = lambda metrics, path: None
    node_id: str | None = None


def weights_sha256(model: nn.Module) -> str:
    return state_sha256(model.state_dict())


def state_sha256(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over a state dict in name order, so two runs compare by one string."""
    h = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_optimizer(cfg: TrainingSpec, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    cls = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def make_schedule(cfg: TrainingSpec, optimizer, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "cosine":
            span = max(1, total_steps - cfg.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - cfg.warmup_steps) / span)))
        if cfg.schedule == "step":
            return cfg.gamma ** (step // cfg.step_size)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Recovery:
    """What the previous attempt lost, worked out from the run directory."""

    def __init__(self, run_dir: str, from_step: int, world_size: int | None = None):
        attempts = events.events(run_dir, "attempt_started")
        self.attempt = len(attempts) + 1
        self.pending = self.attempt > 1
        if not self.pending:
            return
        since = attempts[-1]["time"]
        recent = [e for e in events.events(run_dir) if e["time"] >= since]
        failed = [e for e in recent if e["event"] in ("fault_injected", "worker_failed", "driver_lost")]
        culprit = self._culprit(failed) or {}
        self.failed_rank = culprit.get("rank")
        self.cause = culprit.get("kind") or culprit.get("error") or "unknown"
        progress = [m for m in events.metrics(run_dir) if m.get("attempt") == attempts[-1].get("attempt")]
        self.reached_step = max((m["step"] for m in progress), default=from_step)
        self.failure_time = min((e["time"] for e in failed), default=time.time())
        if world_size is not None and world_size > attempts[-1].get("world_size", world_size):
            # An elastic job grown by Ray: it kills the old workers (their errors are only
            # echoes of that), so their last step is when that attempt ended.
            self.cause, self.failed_rank = "resize", None
            self.failure_time = max((m["time"] for m in progress), default=attempts[-1]["time"])
        self.from_step = from_step

    @staticmethod
    def _culprit(failed: list[dict[str, Any]]) -> dict[str, Any] | None:
        # What failed first-hand: an injected fault, a dead process or driver, then a
        # non-communication error; peers' connection errors are only echoes of it.
        for match in (lambda e: e["event"] == "fault_injected",
                      lambda e: e.get("process_died") or e["event"] == "driver_lost",
                      lambda e: e.get("classification") != failures.INFRASTRUCTURE,
                      lambda e: True):
            hit = next((e for e in failed if match(e)), None)
            if hit is not None:
                return hit
        return None

    def record(self, run_dir: str) -> dict[str, Any]:
        self.pending = False
        return events.emit(
            run_dir, "resumed", attempt=self.attempt, failed_rank=self.failed_rank, cause=self.cause,
            from_step=self.from_step, reached_step=self.reached_step,
            lost_steps=max(0, self.reached_step - self.from_step),
            recovery_s=round(time.time() - self.failure_time, 3),
        )


def _broadcast(obj: Any, world_size: int) -> Any:
    if world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def train(spec: JobSpec, env: WorkerEnv) -> dict[str, Any] | None:
    run_dir = spec.run_dir
    rank, world = env.rank, env.world_size
    cfg = spec.training
    torch.set_num_threads(max(1, int(spec.resources.cpu)))
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device(f"cuda:{env.local_rank}" if spec.resources.gpu > 0 else "cpu")

    # Rank 0 clears what a failed attempt half-wrote and picks the checkpoint; the others
    # take its word so every rank resumes from the same step.
    if rank == 0:
        checkpoint.clear_partial(run_dir)
        found = checkpoint.latest(run_dir)
        recovery = Recovery(run_dir, from_step=found[0] if found else 0, world_size=world)
        decided = (found, recovery.attempt)
    else:
        recovery, decided = None, None
    found, attempt = _broadcast(decided, world)

    _seed_everything(cfg.seed)
    splits: Splits = load(spec.dataset, cfg.seed, context=spec.model.context)
    if rank == 0 and splits.notice and attempt == 1:
        print(splits.notice, flush=True)
    strategy = strategies.build(spec)
    strategy.setup(device, rank, world)  # builds the device mesh: a collective
    sampler = ResumableDistributedSampler(len(splits.train), cfg.global_batch_size, rank=strategy.data_rank,
                                          world_size=strategy.data_world, seed=cfg.seed)
    # Gradient accumulation: every rank runs the same number of micro-batches (sharded
    # strategies gather parameters in each forward, a collective all must join).
    micro_batches = -(-sampler.max_local_batch // (cfg.micro_batch_size or sampler.max_local_batch))
    # Each rank's loss counts by its share of the global batch, so unequal shares (a world
    # size that does not divide it) still average to the global batch's mean gradient.
    weight = sampler.local_batch * strategy.data_world / cfg.global_batch_size
    total_steps = cfg.max_steps or cfg.epochs * sampler.steps_per_epoch
    if rank == 0:
        note_resize(run_dir, attempt, world, found[0] if found else 0)
        events.emit(run_dir, "attempt_started", attempt=attempt, world_size=world, total_steps=total_steps,
                    from_step=found[0] if found else 0, checkpoint=found[1] if found else None)
    # Where each rank runs, so a worker can be found (and killed on request) through Ray.
    events.emit(run_dir, "worker_started", attempt=attempt, rank=rank, pid=os.getpid(), node_id=env.node_id,
                durable=False)

    def new_model() -> nn.Module:
        return build_model(spec.model, in_channels=splits.in_channels, num_classes=splits.num_classes,
                           image_size=splits.image_size).to(device)

    amp_dtype = low_precision(spec.precision)
    # fp16 needs loss scaling so small gradients survive; its state is checkpointed.
    scaler = torch.amp.GradScaler(device.type, enabled=spec.precision == "fp16")
    # Before the optimizer: sharding swaps in new parameters, a pipeline keeps one stage.
    trained = strategy.wrap(new_model())
    model = strategy.model
    optimizer = make_optimizer(cfg, model.parameters())
    schedule = make_schedule(cfg, optimizer, total_steps)
    step, epoch, batch_index = 0, 0, 0
    if found:
        state = checkpoint.load_shard(found[1], "state.pt")
        strategy.load_state(found[1], model, optimizer, state)
        schedule.load_state_dict(state["schedule"])
        if state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        step, epoch, batch_index = state["step"], state["epoch"], state["batch_index"]
        if os.path.exists(os.path.join(found[1], f"rng-rank{rank}.pt")):
            _set_rng_state(checkpoint.load_shard(found[1], f"rng-rank{rank}.pt"))
        else:  # a rank the checkpoint's world did not have: a fresh stream of its own
            _seed_everything(cfg.seed + 1000 * rank + step)
    injector = FaultInjector(spec.faults, run_dir, rank)
    pending: dict[str, Any] | None = None  # a checkpoint still being written in the background
    profiler = StepProfiler()
    if rank == 0:
        print(f"[train] attempt {attempt}: {world} worker(s), {'resuming from step ' + str(step) if found else 'starting'}"
              f" of {total_steps}", flush=True)

    loss_value = float("nan")
    try:
        t_last = time.perf_counter()
        while step < total_steps:
            for batch_index, indices in sampler.batches(epoch, batch_index):
                if step >= total_steps:
                    break
                injector.maybe_fire(step + 1)
                profiler.before(step + 1)
                x, y = splits.train.batch(indices)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                local = strategy.train_step(trained, x, y, loss_fn, micro_batches, weight, scaler.scale,
                                            lambda: torch.autocast(device.type, dtype=amp_dtype,
                                                                   enabled=amp_dtype is not None))
                if scaler.is_enabled() and strategy.shards_parameters and world > 1:
                    _agree_on_overflow(scaler, optimizer)
                scaler.step(optimizer)
                scaler.update()
                schedule.step()
                step += 1
                profiler.after(step)
                loss_value = _mean_loss(local, strategy.owns_loss, world)
                if pending and _all(strategy.wait_saved(block=False), world, device):
                    _commit(spec, env, pending)
                    pending = None
                now = time.perf_counter()
                step_s, t_last = now - t_last, now
                if rank == 0:
                    if recovery.pending:
                        r = recovery.record(run_dir)
                        print(f"[train] recovered: rank {r['failed_rank']} failed, resumed from step {r['from_step']},"
                              f" recomputed {r['lost_steps']} step(s), {r['recovery_s']:.1f}s to this step", flush=True)
                    events.log_metrics(run_dir, step=step, epoch=epoch, loss=loss_value, lr=schedule.get_last_lr()[0],
                                       samples_per_s=cfg.global_batch_size / step_s, step_s=step_s, attempt=attempt)
                    if step % max(1, total_steps // 20) == 0 or step == total_steps:
                        print(f"[train] step {step}/{total_steps} epoch {epoch} loss {loss_value:.4f} "
                              f"{cfg.global_batch_size / step_s:.0f} samples/s", flush=True)
                if step % spec.checkpoint.every_steps == 0 or step == total_steps:
                    if pending:  # the previous background write must be sealed first
                        waited = time.perf_counter()
                        strategy.wait_saved(block=True)
                        pending["blocked_s"] += time.perf_counter() - waited
                        _commit(spec, env, pending)
                    pending = _save(spec, env, strategy, model, optimizer, schedule, scaler, injector, step=step,
                                    epoch=epoch, next_batch=batch_index + 1, loss=loss_value,
                                    # The last one in the foreground: the job ends when it is sealed.
                                    background=spec.parallel.async_checkpoint and strategy.shards_parameters
                                    and step < total_steps)
                t_last = time.perf_counter()
            else:
                epoch, batch_index = epoch + 1, 0
                continue
            break
    except Exception as exc:
        reached = max((m["step"] for m in events.metrics(run_dir)), default=0)
        kind = failures.record_worker_error(run_dir, exc, rank=rank, step=step + 1, attempt=attempt,
                                            completed_steps=max(step, reached))
        if kind == failures.DETERMINISTIC:
            raise failures.DeterministicTrainingError(f"{failures.signature(exc)} (step {step + 1}, rank {rank})") from exc
        raise

    profiler.record(run_dir, rank, world)
    weights = strategy.full_state_dict(model)  # a collective for sharded strategies
    if strategy.shards_parameters:
        # Rank 0 alone evaluates the whole model: no rank of a split one can.
        whole = None
        if rank == 0:
            whole = new_model()
            whole.load_state_dict(weights)
        accuracy, val_loss = evaluate(whole, splits, 0, 1, device, cfg.eval_batch_size) if rank == 0 else (0, 0)
    else:
        accuracy, val_loss = evaluate(model, splits, rank, world, device, cfg.eval_batch_size)
    if rank != 0:
        return None
    digest = state_sha256(weights)
    os.makedirs(os.path.join(run_dir, "final"), exist_ok=True)
    torch.save(weights, os.path.join(run_dir, "final", "model.pt"))
    if recovery.pending:  # failed after the last step: nothing recomputed
        recovery.record(run_dir)
    return events.emit(run_dir, "finished", attempt=attempt, final_step=step, loss=loss_value,
                       val_loss=val_loss, val_accuracy=accuracy, weights_sha256=digest, world_size=world)


def _save(spec, env, strategy, model, optimizer, schedule, scaler, injector, *, step, epoch, next_batch,
          loss, background) -> dict[str, Any] | None:
    """Every rank writes its shards, then rank 0 seals the checkpoint once all are in.
    A background save returns what _commit needs later, when every rank's writer is done."""
    started = time.perf_counter()
    run_dir, rank = spec.run_dir, env.rank
    tmp = checkpoint.tmp_dir(run_dir, step)
    weights = strategy.save_state(tmp, model, optimizer, background=background)
    if rank == 0:
        checkpoint.write_shard(tmp, "state.pt", {
            **weights, "schedule": schedule.state_dict(), "scaler": scaler.state_dict(),
            "step": step, "epoch": epoch, "batch_index": next_batch,
        })
    checkpoint.write_shard(tmp, f"rng-rank{rank}.pt", _rng_state())
    injector.maybe_fire(step, phase="checkpoint")
    pending = {"step": step, "epoch": epoch, "next_batch": next_batch, "loss": loss, "started": started,
               "blocked_s": time.perf_counter() - started, "background": background}
    if background:
        return pending
    _commit(spec, env, pending)
    return None


def _commit(spec, env, pending: dict[str, Any]) -> None:
    if env.world_size > 1:
        dist.barrier()
    run_dir, step, path = spec.run_dir, pending["step"], None
    committed = time.perf_counter()
    if env.rank == 0:
        path = checkpoint.commit(run_dir, step, {"epoch": pending["epoch"], "batch_index": pending["next_batch"],
                                                 "world_size": env.world_size, "loss": pending["loss"]})
        checkpoint.prune(run_dir, spec.checkpoint.keep)
    saved = time.perf_counter()
    env.on_checkpoint({"step": step, "loss": pending["loss"]}, path)
    if env.rank == 0:
        # blocked_s: how long training waited for this checkpoint; save_s: until it was sealed.
        blocked = pending["blocked_s"] + (saved - committed)
        events.emit(run_dir, "checkpoint_committed", step=step, path=os.path.relpath(path, run_dir),
                    save_s=round(saved - pending["started"], 4), blocked_s=round(blocked, 4),
                    background=pending["background"], report_s=round(time.perf_counter() - saved, 4))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over classes (images) or over every position's next token (gpt)."""
    return nn.functional.cross_entropy(output.flatten(0, -2).float(), target.flatten())


def _mean_loss(local: torch.Tensor, owns_loss: bool, world: int) -> float:
    """The step's loss over the global batch: the mean of what the ranks that compute a
    loss report (all of them, except in a pipeline)."""
    if world == 1:
        return local.item()
    t = torch.stack([local.float() * owns_loss, torch.tensor(float(owns_loss), device=local.device)])
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def _all(flag: bool, world: int, device: torch.device) -> bool:
    if world == 1:
        return flag
    t = torch.tensor([int(flag)], device=device)  # on the default group's device: NCCL takes no CPU tensors
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _agree_on_overflow(scaler: torch.amp.GradScaler, optimizer) -> None:
    """fp16 with sharded weights: each rank checks only its own gradient shards for
    inf/NaN, so one rank could skip a step the others take. Make them agree.
    GradScaler has no public hook for this; found_inf_per_device is what step() reads."""
    scaler.unscale_(optimizer)
    for found in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
        dist.all_reduce(found, op=dist.ReduceOp.MAX)


def note_resize(run_dir: str, attempt: int, world: int, from_step: int) -> None:
    """An attempt that runs with a different worker count than the one before is a resize."""
    before = events.events(run_dir, "attempt_started")
    if before and before[-1].get("world_size") != world:
        events.emit(run_dir, "resized", attempt=attempt, old_size=before[-1]["world_size"], new_size=world,
                    from_step=from_step)


def evaluate(model: nn.Module, splits: Splits, rank: int, world: int, device, batch_size: int) -> tuple[float, float]:
    """Accuracy and mean loss on the validation split (per token for gpt), each rank a
    strided share."""
    model.eval()
    correct = torch.zeros(3, dtype=torch.float64)
    indices = torch.arange(rank, len(splits.val), world)
    with torch.no_grad():
        for lo in range(0, len(indices), batch_size):
            x, y = splits.val.batch(indices[lo : lo + batch_size])
            logits = model(x.to(device))
            correct[0] += (logits.argmax(-1).cpu() == y).sum()
            correct[1] += y.numel()
            correct[2] += nn.functional.cross_entropy(logits.flatten(0, -2).float(), y.flatten().to(device),
                                                      reduction="sum").item()
    model.train()
    if world > 1:
        dist.all_reduce(correct)
    return (correct[0] / max(1, correct[1])).item(), (correct[2] / max(1, correct[1])).item()
