"""The per-worker training loop.

It runs the same under Ray Train (`ray_train_func`) and under plain torchrun
(bench/), given a `WorkerEnv`; the process group already exists when it starts. What
is trained comes from the spec's task (workers/tasks); when checkpoints are written and
loaded is the CheckpointManager's; what a failed attempt cost is recovery.py's.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from workers import checkpoint, events, failures, metrics_read, recovery, segments, storage, strategies, tasks
from workers.checkpointing import CheckpointManager, rng_state, seed_everything, set_rng_state
from workers.data.loader import read
from workers.data.sampler import ResumableDistributedSampler
from workers.faults import FaultInjector
from workers.profiling import StepProfiler
from workers.spec import JobSpec, TrainingSpec
from workers.strategies.base import low_precision
from workers.watchdog import Watchdog


@dataclass
class WorkerEnv:
    rank: int
    world_size: int
    local_rank: int
    # Called on every rank after a commit; rank 0 gets the committed path, others None.
    on_checkpoint: Callable[[dict[str, Any], str | None], None] = lambda metrics, path: None
    node_id: str | None = None
    # failure.mode live: which start of the worker group this worker belongs to (a
    # replacement joins its survivors' one), and a barrier across that start's workers.
    generation: str | None = None
    barrier: Callable[[], None] | None = None
    # When this worker's process started, and when the training code got control with
    # the process group up (epoch seconds): the bench splits a restart's seconds by them.
    process_started: float | None = None
    ready: float | None = None
    # Called once the worker group is up, the checkpoint loaded, about to train.
    on_started: Callable[[], Any] = lambda: None


@dataclass
class Trainable:
    """What one rank trains and everything a checkpoint restores besides the position."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler


@dataclass
class LoopState:
    """Where training is: the step done last and the next batch of the data order."""

    step: int = 0
    epoch: int = 0
    batch_index: int = 0
    loss: float = math.nan


def weights_sha256(model: nn.Module) -> str:
    return state_sha256(model.state_dict())


def state_sha256(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over a state dict in name order, so two runs compare by one string."""
    h = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


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
        if spec.failure.mode == "live":
            from workers import live  # torchft: imported only where a job asks for it

            return live.train(spec, env, watchdog)
        return _train(spec, env, watchdog)
    except Exception as exc:
        _flush_record()  # so the steps this rank logged count in what the failure cost
        reached = max(metrics_read.reached(spec.run_dir).values(), default=0)
        kind = failures.record_worker_error(spec.run_dir, exc, rank=env.rank, step=watchdog.step + 1,
                                            attempt=watchdog.attempt, completed_steps=max(watchdog.step, reached),
                                            activity=watchdog.activity)
        if kind == failures.DETERMINISTIC:
            raise failures.DeterministicTrainingError(
                f"{failures.signature(exc)} (while {watchdog.activity}; step {watchdog.step + 1}, rank {env.rank})"
            ) from exc
        raise
    finally:
        _flush_record()
        watchdog.stop()


def _flush_record() -> None:
    """Write what this process holds of the run record (on an object store, metrics are
    flushed every few seconds): a Ray worker process outlives the attempt, or is killed."""
    try:
        segments.flush()
    except Exception as e:  # the storage is unreachable: the error that brought us here matters more
        print(f"[train] could not write the run record: {type(e).__name__}: {e}", flush=True)


def worker_device(spec: JobSpec, env: WorkerEnv) -> torch.device:
    """This worker's threads, determinism and device (both failure modes)."""
    torch.set_num_threads(max(1, int(spec.resources.cpu)))
    torch.use_deterministic_algorithms(True, warn_only=True)
    if spec.resources.gpu > 0 and not torch.cuda.is_available():
        raise RuntimeError(f"resources.gpu is {spec.resources.gpu:g} but this worker sees no CUDA device")
    return torch.device(f"cuda:{env.local_rank}" if spec.resources.gpu > 0 else "cpu")


def task_optimizer(task, cfg, model: nn.Module) -> torch.optim.Optimizer:
    """The task's own optimizer where it has one, else the spec's."""
    if callable(getattr(task, "optimizer", None)):
        return task.optimizer(model.parameters())
    return make_optimizer(cfg, model.parameters())


def _train(spec: JobSpec, env: WorkerEnv, watchdog: Watchdog) -> dict[str, Any] | None:
    run_dir = spec.run_dir
    rank, world = env.rank, env.world_size
    cfg = spec.training
    device = worker_device(spec, env)
    watchdog.beat("choosing the checkpoint to resume from")

    # Rank 0 decides where the attempt starts; the others take its word so every rank
    # resumes from the same step.
    attempt, accounting = recovery.begin(run_dir, world) if rank == 0 else (None, None)
    attempt = _broadcast(attempt, world)
    watchdog.attempt = attempt.number
    _pause(attempt.delay_s, watchdog)

    seed_everything(cfg.seed)
    # What the worker was doing, in the words of the spec, should it fail there.
    model_of, data_of = ((f"task.model() of {spec.task}", f"task.datasets() of {spec.task}") if spec.task
                         else (f"model.name = {spec.model.name}", f"dataset.name = {spec.dataset.name}"))
    watchdog.beat(f"building the task ({spec.task or 'built-in'})")
    task = tasks.load(spec)
    watchdog.beat(f"loading the dataset ({data_of})")
    train_set, val_set = task.datasets()
    watchdog.beat("setting up the strategy and the sampler")
    strategy = strategies.build(spec)
    strategy.setup(device, rank, world)  # builds the device mesh: a collective
    sampler = ResumableDistributedSampler(len(train_set), cfg.global_batch_size, rank=strategy.data_rank,
                                          world_size=strategy.data_world, seed=cfg.seed)
    # Gradient accumulation: every rank runs the same number of micro-batches (sharded
    # strategies gather parameters in each forward, a collective all must join).
    micro_batches = -(-sampler.max_local_batch // (cfg.micro_batch_size or sampler.max_local_batch))
    # Each rank's loss counts by its share of the global batch, so unequal shares (a world
    # size that does not divide it) still average to the global batch's mean gradient.
    weight = sampler.local_batch * strategy.data_world / cfg.global_batch_size
    total_steps = cfg.max_steps or cfg.epochs * sampler.steps_per_epoch
    # Where each rank runs, so a worker can be found (and killed on request) through Ray.
    events.emit(run_dir, events.WorkerStarted(attempt=attempt.number, rank=rank, pid=os.getpid(), node_id=env.node_id,
                                              process_started=env.process_started, ready=env.ready), durable=False)

    def new_model() -> nn.Module:
        return task.model().to(device)

    amp_dtype = low_precision(spec.precision)
    watchdog.beat(f"building the model ({model_of})")
    # Before the optimizer: sharding swaps in new parameters, a pipeline keeps one stage.
    trained = strategy.wrap(new_model(), task)
    model = strategy.model
    optimizer = task_optimizer(task, cfg, model)
    # fp16 needs loss scaling so small gradients survive; its state is checkpointed.
    fit = Trainable(model, optimizer, make_schedule(cfg, optimizer, total_steps),
                    torch.amp.GradScaler(device.type, enabled=spec.precision == "fp16"))
    injector = FaultInjector(spec.faults, run_dir, rank)
    checkpoints = CheckpointManager(spec, env, strategy, fit, device, watchdog, injector)
    state = LoopState()
    found = checkpoints.load_newest(attempt.candidates)
    if found:
        state.step, state.epoch, state.batch_index = found["step"], found["epoch"], found["batch_index"]
        if found.get("loss") is not None:
            state.loss = found["loss"]
    if rank == 0:
        accounting.from_step = state.step
        events.emit(run_dir, events.TrainingStarted(attempt=attempt.number, world_size=world, total_steps=total_steps,
                                                    from_step=state.step, checkpoint=found["path"] if found else None))
    profiler = StepProfiler()
    scoring = dict(task=task, dataset=val_set, device=device, batch_size=cfg.eval_batch_size, watchdog=watchdog,
                   workers=spec.dataset.loader_workers)
    every = spec.evaluation.every_steps if spec.evaluation and val_set is not None else 0
    watchdog.beat("training", state.step)
    env.on_started()

    def amp():
        return torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)

    t_last = time.perf_counter()
    while state.step < total_steps:
        order = list(sampler.batches(state.epoch, state.batch_index))
        batches = read(train_set, [indices for _, indices in order], workers=spec.dataset.loader_workers,
                       seed=cfg.seed + 7919 * state.epoch + state.batch_index)
        for batch_index, _ in order:
            if state.step >= total_steps:
                break
            step = state.step + 1
            injector.maybe_fire(step)
            profiler.before(step)
            watchdog.beat(f"reading the batch of step {step}")
            injector.maybe_fire(step, phase="data")
            x, y = next(batches)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            watchdog.beat(f"training step {step}", on_peers=True)
            optimizer.zero_grad(set_to_none=True)
            local = strategy.train_step(trained, x, y, task.loss, micro_batches, weight, fit.scaler.scale, amp)
            if fit.scaler.is_enabled() and strategy.shards_parameters and world > 1:
                _agree_on_overflow(fit.scaler, optimizer)
            fit.scaler.step(optimizer)
            fit.scaler.update()
            fit.schedule.step()
            state.step = step
            profiler.after(step)
            state.loss = _mean_loss(local, strategy.owns_loss, world)
            watchdog.beat(step=step)
            checkpoints.seal_written()
            now = time.perf_counter()
            step_s, t_last = now - t_last, now
            # After the step's clock stopped: samples/s stays the training pace.
            val = None
            if every and step % every == 0:
                val = validate_now(strategy, model, new_model, scoring, rank, world)
            if rank == 0:
                if accounting.pending:
                    accounting.record(run_dir)
                events.log_metrics(run_dir, events.MetricsLine(
                    step=step, epoch=state.epoch, loss=state.loss, lr=fit.schedule.get_last_lr()[0],
                    samples_per_s=cfg.global_batch_size / step_s, step_s=step_s, attempt=attempt.number,
                    **val_fields(val)))
            checkpoints.save_on_cadence(step, state.epoch, batch_index + 1, state.loss, total_steps)
            t_last = time.perf_counter()
        else:
            state.epoch, state.batch_index = state.epoch + 1, 0
            continue
        break

    profiler.record(run_dir, rank, world)
    watchdog.beat("gathering the final weights", on_peers=True)
    weights = strategy.full_state_dict(model)  # a collective for sharded strategies
    scores = None
    if val_set is not None:
        scores = score(strategy, model, new_model, scoring, rank, world, weights=weights)
    if rank != 0:
        return None
    watchdog.beat("writing the final weights")
    digest = state_sha256(weights)
    checkpoint.write_shard(storage.join(run_dir, "final"), "model.pt", weights)
    if accounting.pending:  # failed after the last step: nothing recomputed
        accounting.record(run_dir)
    scores = scores or {}
    return events.emit(run_dir, events.Finished(
        attempt=attempt.number, final_step=state.step, loss=state.loss, val_loss=scores.pop("loss", None),
        val_accuracy=scores.get("accuracy"), val_metrics=scores, weights_sha256=digest, world_size=world))


def _pause(delay_s: float, watchdog: Watchdog) -> None:
    """Back off before retrying; every rank waits, beating, so no collective times out."""
    deadline = time.monotonic() + delay_s
    while (left := deadline - time.monotonic()) > 0:
        watchdog.beat(f"backing off {delay_s:g}s after repeated failures")
        time.sleep(min(1.0, left))


def _mean_loss(local: torch.Tensor, owns_loss: bool, world: int) -> float:
    """The step's loss over the global batch: the mean of what the ranks that compute a
    loss report (all of them, except in a pipeline)."""
    if world == 1:
        return local.item()
    t = torch.stack([local.float() * owns_loss, torch.tensor(float(owns_loss), device=local.device)])
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def _agree_on_overflow(scaler: torch.amp.GradScaler, optimizer) -> None:
    """fp16 with sharded weights: each rank checks only its own gradient shards for
    inf/NaN, so one rank could skip a step the others take. Make them agree.
    GradScaler has no public hook for this; found_inf_per_device is what step() reads."""
    scaler.unscale_(optimizer)
    for found in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
        dist.all_reduce(found, op=dist.ReduceOp.MAX)


def score(strategy, model: nn.Module, new_model: Callable[[], nn.Module], scoring: dict[str, Any], rank: int,
          world: int, *, weights: dict[str, torch.Tensor] | None = None,
          spread: bool = False) -> dict[str, float] | None:
    """The validation scores of the model as trained so far: on every rank, or on rank 0
    alone (None elsewhere) where the model is split. No rank of a split model can score
    it, so a whole one is built from the gathered `weights` (gathered here when not given).
    Rank 0 alone scores it at the end, when the others are done; with `spread`, during
    training, every rank scores its share from broadcast weights, since the others would
    otherwise wait for rank 0 in the next step's collective, which failure.collective_timeout_s
    cuts short."""
    if not strategy.shards_parameters:
        return evaluate(model, rank=rank, world=world, **scoring)
    if weights is None:
        scoring["watchdog"].beat("gathering the weights to validate", on_peers=True)
        weights = strategy.full_state_dict(model)  # a collective
    if spread:
        scoring["watchdog"].beat("sharing the weights to validate", on_peers=True)
        weights = _broadcast(weights, world)
    elif rank != 0:
        return None
    whole = new_model()
    whole.load_state_dict(weights)
    return evaluate(whole, rank=rank if spread else 0, world=world if spread else 1, **scoring)


def validate_now(strategy, model: nn.Module, new_model: Callable[[], nn.Module], scoring: dict[str, Any],
                 rank: int, world: int) -> dict[str, float] | None:
    """`score` in the middle of training (evaluation.every_steps), on every rank since it is
    a collective. Exact resume needs the training RNG streams as they were: building a whole
    model draws initial weights, and a task's loss or metrics may draw too, so every stream a
    checkpoint restores is put back afterwards. The data order is the sampler's, untouched."""
    saved = rng_state()
    try:
        return score(strategy, model, new_model, scoring, rank, world, spread=True)
    finally:
        set_rng_state(saved)


def val_fields(scores: dict[str, float] | None) -> dict[str, Any]:
    """A metrics line's validation keys (a web page reads these names): val_loss,
    val_accuracy where the task measures accuracy, and val_metrics, every metric but the loss."""
    if scores is None:
        return {}
    metrics = {name: value for name, value in scores.items() if name != "loss"}
    fields: dict[str, Any] = {"val_loss": scores.get("loss"), "val_metrics": metrics}
    if "accuracy" in metrics:
        fields["val_accuracy"] = metrics["accuracy"]
    return fields


def evaluate(model: nn.Module, *, task, dataset, rank: int, world: int, device, batch_size: int,
             watchdog: Watchdog | None = None, workers: int = 0) -> dict[str, float]:
    """The task's loss and metrics on the validation split, each averaged over its
    samples; each rank scores a strided share."""
    model.eval()
    indices = torch.arange(rank, len(dataset), world)
    sums: dict[str, float] = {"samples": 0.0, "loss": 0.0}
    metrics = getattr(task, "metrics", None)
    with torch.no_grad():
        for x, y in read(dataset, list(indices.split(batch_size)), workers=workers):
            if watchdog is not None:
                watchdog.beat("evaluating on the validation split")
            output, y = model(x.to(device)), y.to(device)
            n = len(y)
            sums["samples"] += n
            sums["loss"] += float(task.loss(output, y)) * n
            for name, value in (metrics(output, y) if callable(metrics) else {}).items():
                sums[name] = sums.get(name, 0.0) + float(value) * n
    model.train()
    if world > 1:
        if watchdog is not None:
            watchdog.beat("sharing the validation results", on_peers=True)
        parts: list[dict[str, float]] = [{}] * world
        dist.all_gather_object(parts, sums)
        sums = {}
        for part in parts:
            for name, value in part.items():
                sums[name] = sums.get(name, 0.0) + value
    samples = sums.pop("samples")
    return {name: value / max(1.0, samples) for name, value in sums.items()}
