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
from workers.watchdog import Watchdog
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
        self.attempt, self.from_step = len(attempts) + 1, from_step
        self.pending = self.attempt > 1
        if not self.pending:
            return
        since = attempts[-1]["time"]
        recent = [e for e in events.events(run_dir) if e["time"] >= since]
        failed = [e for e in recent if e["event"] in ("fault_injected", "worker_failed", "driver_lost")]
        culprit = failures.culprit(failed) or {}
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
    """One attempt on one rank. Every error it raises, from set-up to the final save, is
    classified first (DESIGN.md invariant 4); a hang anywhere is the watchdog's."""
    watchdog = Watchdog(spec.failure.hang_timeout_s, spec.run_dir, env.rank).start()
    try:
        return _train(spec, env, watchdog)
    except Exception as exc:
        reached = max((m["step"] for m in events.metrics(spec.run_dir)), default=0)
        kind = failures.record_worker_error(spec.run_dir, exc, rank=env.rank, step=watchdog.step + 1,
                                            attempt=watchdog.attempt, completed_steps=max(watchdog.step, reached),
                                            activity=watchdog.activity)
        if kind == failures.DETERMINISTIC:
            raise failures.DeterministicTrainingError(
                f"{failures.signature(exc)} (while {watchdog.activity}; step {watchdog.step + 1}, rank {env.rank})"
            ) from exc
        raise
    finally:
        watchdog.stop()


def _train(spec: JobSpec, env: WorkerEnv, watchdog: Watchdog) -> dict[str, Any] | None:
    run_dir = spec.run_dir
    rank, world = env.rank, env.world_size
    cfg = spec.training
    torch.set_num_threads(max(1, int(spec.resources.cpu)))
    torch.use_deterministic_algorithms(True, warn_only=True)
    watchdog.beat("choosing the checkpoint to resume from")
    if spec.resources.gpu > 0 and not torch.cuda.is_available():
        raise RuntimeError(f"resources.gpu is {spec.resources.gpu:g} but this worker sees no CUDA device")
    device = torch.device(f"cuda:{env.local_rank}" if spec.resources.gpu > 0 else "cpu")

    # Rank 0 clears what a failed attempt half-wrote and lists the checkpoints to try,
    # newest first; the others take its word so every rank resumes from the same step.
    if rank == 0:
        checkpoint.clear_partial(run_dir)
        candidates = checkpoint.sound(run_dir)
        recovery = Recovery(run_dir, from_step=candidates[0][0] if candidates else 0, world_size=world)
        delay = failures.backoff_s(run_dir, recovery.attempt)
        if delay:
            events.emit(run_dir, "backoff", attempt=recovery.attempt, delay_s=delay,
                        reason="the previous attempts failed at the same step")
        # Recorded before anything that may fail, so an attempt that dies in set-up still
        # counts (restarts, back-off); training_started follows once it can train.
        note_resize(run_dir, recovery.attempt, world, recovery.from_step)
        events.emit(run_dir, "attempt_started", attempt=recovery.attempt, world_size=world,
                    from_step=recovery.from_step, checkpoint=candidates[0][1] if candidates else None)
        decided = (candidates, recovery.attempt, delay)
    else:
        recovery, decided = None, None
    candidates, attempt, delay = _broadcast(decided, world)
    watchdog.attempt = attempt
    _pause(delay, watchdog)

    _seed_everything(cfg.seed)
    watchdog.beat(f"loading the dataset (dataset.name = {spec.dataset.name})")
    splits: Splits = load(spec.dataset, cfg.seed, context=spec.model.context)
    watchdog.beat("setting up the strategy and the sampler")
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
    # Where each rank runs, so a worker can be found (and killed on request) through Ray.
    events.emit(run_dir, "worker_started", attempt=attempt, rank=rank, pid=os.getpid(), node_id=env.node_id,
                durable=False)

    def new_model() -> nn.Module:
        return build_model(spec.model, in_channels=splits.in_channels, num_classes=splits.num_classes,
                           image_size=splits.image_size).to(device)

    amp_dtype = low_precision(spec.precision)
    # fp16 needs loss scaling so small gradients survive; its state is checkpointed.
    scaler = torch.amp.GradScaler(device.type, enabled=spec.precision == "fp16")
    watchdog.beat(f"building the model (model.name = {spec.model.name})")
    # Before the optimizer: sharding swaps in new parameters, a pipeline keeps one stage.
    trained = strategy.wrap(new_model())
    model = strategy.model
    optimizer = make_optimizer(cfg, model.parameters())
    schedule = make_schedule(cfg, optimizer, total_steps)
    step, epoch, batch_index = 0, 0, 0
    found = _load_newest(spec, env, candidates, strategy, model, optimizer, schedule, scaler, device, watchdog)
    if found:
        step, epoch, batch_index = found["step"], found["epoch"], found["batch_index"]
    if rank == 0:
        recovery.from_step = step
        events.emit(run_dir, "training_started", attempt=attempt, world_size=world, total_steps=total_steps,
                    from_step=step, checkpoint=found["path"] if found else None)
    injector = FaultInjector(spec.faults, run_dir, rank)
    pending: dict[str, Any] | None = None  # a checkpoint still being written in the background
    profiler = StepProfiler()
    watchdog.beat("training", step)

    loss_value = float("nan")
    t_last = time.perf_counter()
    while step < total_steps:
        for batch_index, indices in sampler.batches(epoch, batch_index):
            if step >= total_steps:
                break
            injector.maybe_fire(step + 1)
            profiler.before(step + 1)
            watchdog.beat(f"reading the batch of step {step + 1}")
            injector.maybe_fire(step + 1, phase="data")
            x, y = splits.train.batch(indices)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            watchdog.beat(f"training step {step + 1}")
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
            watchdog.beat(step=step)
            if pending and _all(strategy.wait_saved(block=False), world, device):
                _commit(spec, env, pending, watchdog, injector)
                pending = None
            now = time.perf_counter()
            step_s, t_last = now - t_last, now
            if rank == 0:
                if recovery.pending:
                    recovery.record(run_dir)
                events.log_metrics(run_dir, step=step, epoch=epoch, loss=loss_value, lr=schedule.get_last_lr()[0],
                                   samples_per_s=cfg.global_batch_size / step_s, step_s=step_s, attempt=attempt)
            if step % spec.checkpoint.every_steps == 0 or step == total_steps:
                if pending:  # the previous background write must be sealed first
                    waited = time.perf_counter()
                    watchdog.beat(f"waiting for the background checkpoint of step {pending['step']}")
                    strategy.wait_saved(block=True)
                    pending["blocked_s"] += time.perf_counter() - waited
                    _commit(spec, env, pending, watchdog, injector)
                watchdog.beat(f"writing the checkpoint of step {step}")
                pending = _save(spec, env, strategy, model, optimizer, schedule, scaler, injector, watchdog,
                                step=step, epoch=epoch, next_batch=batch_index + 1, loss=loss_value,
                                # The last one in the foreground: the job ends when it is sealed.
                                background=spec.parallel.async_checkpoint and strategy.shards_parameters
                                and step < total_steps)
            t_last = time.perf_counter()
        else:
            epoch, batch_index = epoch + 1, 0
            continue
        break

    profiler.record(run_dir, rank, world)
    watchdog.beat("gathering the final weights")
    weights = strategy.full_state_dict(model)  # a collective for sharded strategies
    if strategy.shards_parameters:
        # Rank 0 alone evaluates the whole model: no rank of a split one can.
        whole = None
        if rank == 0:
            whole = new_model()
            whole.load_state_dict(weights)
        accuracy, val_loss = evaluate(whole, splits, 0, 1, device, cfg.eval_batch_size, watchdog) if rank == 0 \
            else (0, 0)
    else:
        accuracy, val_loss = evaluate(model, splits, rank, world, device, cfg.eval_batch_size, watchdog)
    if rank != 0:
        return None
    watchdog.beat("writing the final weights")
    digest = state_sha256(weights)
    os.makedirs(os.path.join(run_dir, "final"), exist_ok=True)
    torch.save(weights, os.path.join(run_dir, "final", "model.pt"))
    if recovery.pending:  # failed after the last step: nothing recomputed
        recovery.record(run_dir)
    return events.emit(run_dir, "finished", attempt=attempt, final_step=step, loss=loss_value,
                       val_loss=val_loss, val_accuracy=accuracy, weights_sha256=digest, world_size=world)


def _pause(delay_s: float, watchdog: Watchdog) -> None:
    """Back off before retrying; every rank waits, beating, so no collective times out."""
    deadline = time.monotonic() + delay_s
    while (left := deadline - time.monotonic()) > 0:
        watchdog.beat(f"backing off {delay_s:g}s after repeated failures")
        time.sleep(min(1.0, left))


def _load_newest(spec, env, candidates, strategy, model, optimizer, schedule, scaler, device,
                 watchdog: Watchdog) -> dict[str, Any] | None:
    """Load the newest checkpoint every rank can read. One that a rank cannot load (a
    shard torch cannot read, state that does not fit the model) is moved aside with a
    `checkpoint_skipped` event and the previous one is tried. Loading overwrites all of
    the state it touches, so a half-loaded bad one leaves nothing behind."""
    rank, world = env.rank, env.world_size
    for step, path in candidates:
        watchdog.beat(f"loading the checkpoint of step {step}")
        error = None
        try:
            state = checkpoint.load_shard(path, "state.pt")
            strategy.load_state(path, model, optimizer, state)
            schedule.load_state_dict(state["schedule"])
            if state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
            rng = os.path.join(path, f"rng-rank{rank}.pt")
            rng_state = checkpoint.load_shard(path, f"rng-rank{rank}.pt") if os.path.exists(rng) else None
        except Exception as e:
            if failures.is_communication_error(e):
                raise
            error = e
        if _all(error is None, world, device):
            if rng_state is not None:
                _set_rng_state(rng_state)
            else:  # a rank the checkpoint's world did not have: a fresh stream of its own
                _seed_everything(spec.training.seed + 1000 * rank + state["step"])
            return {"step": state["step"], "epoch": state["epoch"], "batch_index": state["batch_index"], "path": path}
        if error is not None:
            events.emit(spec.run_dir, "checkpoint_skipped", step=step, rank=rank, error=failures.signature(error)[:1000])
        if world > 1:
            dist.barrier()
        if rank == 0:
            checkpoint.set_aside(spec.run_dir, step)
    if candidates:
        # The model and optimizer may hold part of a bad checkpoint: start again, from scratch.
        raise RuntimeError(f"no checkpoint of {spec.job_id} could be loaded; they were set aside, the next attempt "
                           "starts from step 0")
    return None


def _save(spec, env, strategy, model, optimizer, schedule, scaler, injector, watchdog, *, step, epoch, next_batch,
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
    _commit(spec, env, pending, watchdog, injector)
    return None


def _commit(spec, env, pending: dict[str, Any], watchdog: Watchdog, injector: FaultInjector | None = None) -> None:
    watchdog.beat(f"waiting for every rank's shards of step {pending['step']}")
    if env.world_size > 1:
        dist.barrier()
    run_dir, step, path = spec.run_dir, pending["step"], None
    committed = time.perf_counter()
    if env.rank == 0:
        watchdog.beat(f"sealing the checkpoint of step {step}")
        if injector is not None:
            injector.maybe_fire(step, phase="commit")
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


def evaluate(model: nn.Module, splits: Splits, rank: int, world: int, device, batch_size: int,
             watchdog: Watchdog | None = None) -> tuple[float, float]:
    """Accuracy and mean loss on the validation split (per token for gpt), each rank a
    strided share."""
    model.eval()
    correct = torch.zeros(3, dtype=torch.float64)
    indices = torch.arange(rank, len(splits.val), world)
    with torch.no_grad():
        for lo in range(0, len(indices), batch_size):
            if watchdog is not None:
                watchdog.beat("evaluating on the validation split")
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
