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
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from workers import checkpoint, events, failures, strategies
from workers.data import Splits, load
from workers.data.sampler import ResumableDistributedSampler
from workers.faults import FaultInjector
from workers.models import build_model
from workers.spec import JobSpec, TrainingSpec


AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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

    def __init__(self, run_dir: str, from_step: int):
        attempts = events.events(run_dir, "attempt_started")
        self.attempt = len(attempts) + 1
        self.pending = self.attempt > 1
        if not self.pending:
            return
        since = attempts[-1]["time"]
        recent = [e for e in events.events(run_dir) if e["time"] >= since]
        failed = [e for e in recent if e["event"] in ("fault_injected", "worker_failed", "driver_lost")]
        self.failure_time = min((e["time"] for e in failed), default=time.time())
        culprit = self._culprit(failed) or {}
        self.failed_rank = culprit.get("rank")
        self.cause = culprit.get("kind") or culprit.get("error") or "unknown"
        reached = [m["step"] for m in events.metrics(run_dir) if m.get("attempt") == attempts[-1].get("attempt")]
        self.reached_step = max(reached, default=from_step)
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
        recovery = Recovery(run_dir, from_step=found[0] if found else 0)
        decided = (found, recovery.attempt)
    else:
        recovery, decided = None, None
    found, attempt = _broadcast(decided, world)

    _seed_everything(cfg.seed)
    splits: Splits = load(spec.dataset, cfg.seed)
    if rank == 0 and splits.notice and attempt == 1:
        print(splits.notice, flush=True)
    sampler = ResumableDistributedSampler(len(splits.train), cfg.global_batch_size, rank=rank, world_size=world, seed=cfg.seed)
    total_steps = cfg.max_steps or cfg.epochs * sampler.steps_per_epoch
    if rank == 0:
        events.emit(run_dir, "attempt_started", attempt=attempt, world_size=world, total_steps=total_steps,
                    from_step=found[0] if found else 0, checkpoint=found[1] if found else None)
    # Where each rank runs, so a worker can be found (and killed on request) through Ray.
    events.emit(run_dir, "worker_started", attempt=attempt, rank=rank, pid=os.getpid(), node_id=env.node_id,
                durable=False)

    model = build_model(spec.model, in_channels=splits.in_channels, num_classes=splits.num_classes,
                        image_size=splits.image_size).to(device)
    amp_dtype = AMP_DTYPES.get(spec.precision)
    # fp16 needs loss scaling so small gradients survive; its state is checkpointed.
    scaler = torch.amp.GradScaler(device.type, enabled=spec.precision == "fp16")
    strategy = strategies.build(spec)
    trained = strategy.wrap(model, device, world)  # before the optimizer: FSDP swaps in sharded parameters
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
    loss_fn = nn.CrossEntropyLoss()
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
                x, y = splits.train.batch(indices)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss = loss_fn(trained(x), y)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                schedule.step()
                step += 1
                loss_t = loss.detach().clone()
                if world > 1:
                    dist.all_reduce(loss_t)
                loss_value = loss_t.item() / world
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
                    _save(spec, env, strategy, model, optimizer, schedule, scaler, injector, step=step, epoch=epoch,
                          next_batch=batch_index + 1, loss=loss_value)
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

    accuracy, val_loss = evaluate(model, splits, rank, world, device, cfg.eval_batch_size,
                                  every_rank_runs_all=strategy.shards_parameters)
    weights = strategy.full_state_dict(model)  # a collective for sharded strategies
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
          loss) -> None:
    """Every rank writes its shards, then rank 0 seals the checkpoint once all are in."""
    started = time.perf_counter()
    run_dir, rank = spec.run_dir, env.rank
    tmp = checkpoint.tmp_dir(run_dir, step)
    weights = strategy.save_state(tmp, model, optimizer)
    if rank == 0:
        checkpoint.write_shard(tmp, "state.pt", {
            **weights, "schedule": schedule.state_dict(), "scaler": scaler.state_dict(),
            "step": step, "epoch": epoch, "batch_index": next_batch,
        })
    checkpoint.write_shard(tmp, f"rng-rank{rank}.pt", _rng_state())
    injector.maybe_fire(step, phase="checkpoint")
    if env.world_size > 1:
        dist.barrier()
    path = None
    if rank == 0:
        path = checkpoint.commit(run_dir, step, {"epoch": epoch, "batch_index": next_batch,
                                                 "world_size": env.world_size, "loss": loss})
        checkpoint.prune(run_dir, spec.checkpoint.keep)
    saved = time.perf_counter()
    env.on_checkpoint({"step": step, "loss": loss}, path)
    if rank == 0:
        events.emit(run_dir, "checkpoint_committed", step=step, path=os.path.relpath(path, run_dir),
                    save_s=round(saved - started, 4), report_s=round(time.perf_counter() - saved, 4))


def evaluate(model: nn.Module, splits: Splits, rank: int, world: int, device, batch_size: int,
             every_rank_runs_all: bool = False) -> tuple[float, float]:
    """Accuracy and mean loss on the validation split, each rank a strided share; or,
    where parameters are sharded (every forward is a collective), all of it on every rank."""
    model.eval()
    correct = torch.zeros(3, dtype=torch.float64)
    if every_rank_runs_all:
        rank, world = 0, 1
    indices = torch.arange(rank, len(splits.val), world)
    with torch.no_grad():
        for lo in range(0, len(indices), batch_size):
            x, y = splits.val.batch(indices[lo : lo + batch_size])
            logits = model(x.to(device))
            correct[0] += (logits.argmax(1).cpu() == y).sum()
            correct[1] += len(y)
            correct[2] += nn.functional.cross_entropy(logits, y.to(device), reduction="sum").item()
    model.train()
    if world > 1:
        dist.all_reduce(correct)
    return (correct[0] / max(1, correct[1])).item(), (correct[2] / max(1, correct[1])).item()
