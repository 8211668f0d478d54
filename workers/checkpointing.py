"""When a rank saves, seals and loads checkpoints: the cadence, background writes, and
the choice of the newest checkpoint every rank can read. The files themselves are
checkpoint.py's; what a strategy saves of the model is the strategy's."""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from workers import checkpoint, events, failures, storage
from workers.faults import FaultInjector
from workers.watchdog import Watchdog


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def agree(flag: bool, world: int, device: torch.device) -> bool:
    """True on every rank only if it is true on every rank."""
    if world == 1:
        return flag
    t = torch.tensor([int(flag)], device=device)  # on the default group's device: NCCL takes no CPU tensors
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


class CheckpointManager:
    """One rank's checkpoints for one attempt. Every rank writes its shards, then rank 0
    seals the checkpoint once all are in; a background save is sealed later, when every
    rank's writer is done."""

    def __init__(self, spec, env, strategy, state, device: torch.device, watchdog: Watchdog,
                 injector: FaultInjector | None = None):
        self.spec, self.env, self.strategy, self.state = spec, env, strategy, state
        self.device, self.watchdog, self.injector = device, watchdog, injector
        self.pending: dict[str, Any] | None = None  # a checkpoint still being written in the background

    def load_newest(self, candidates: list[tuple[int, str]]) -> dict[str, Any] | None:
        """Load the newest checkpoint every rank can read. One that a rank cannot load (a
        shard torch cannot read, state that does not fit the model) is moved aside with a
        `checkpoint_skipped` event and the previous one is tried. Loading overwrites all
        of the state it touches, so a half-loaded bad one leaves nothing behind."""
        spec, rank, world, s = self.spec, self.env.rank, self.env.world_size, self.state
        for i, (step, path) in enumerate(candidates):
            self.watchdog.beat(f"loading the checkpoint of step {step}", on_peers=True)
            error = None
            try:
                if i > 0 and not checkpoint.verified(path):  # the first was verified when listed
                    raise ValueError(f"the files of the checkpoint of step {step} do not match its manifest")
                saved = checkpoint.load_shard(path, "state.pt")
                self.strategy.load_state(path, s.model, s.optimizer, saved)
                s.schedule.load_state_dict(saved["schedule"])
                if saved.get("scaler"):
                    s.scaler.load_state_dict(saved["scaler"])
                rng = f"rng-rank{rank}.pt"
                rng_saved = checkpoint.load_shard(path, rng) if storage.exists(storage.join(path, rng)) else None
            except Exception as e:
                if failures.is_communication_error(e):
                    raise
                error = e
            if agree(error is None, world, self.device):
                if rng_saved is not None:
                    set_rng_state(rng_saved)
                else:  # a rank the checkpoint's world did not have: a fresh stream of its own
                    seed_everything(spec.training.seed + 1000 * rank + saved["step"])
                # The loss of the checkpoint's step, so a run resumed at its last step
                # still reports one.
                manifest = checkpoint.read_manifest(path, verify=False)
                loss = manifest.loss if manifest else None
                return {"step": saved["step"], "epoch": saved["epoch"], "batch_index": saved["batch_index"],
                        "path": path, "loss": loss}
            if error is not None:
                events.emit(spec.run_dir, events.CheckpointSkipped(step=step, rank=rank,
                                                                   error=failures.signature(error)[:1000]))
            if world > 1:
                dist.barrier()
            if rank == 0:
                checkpoint.set_aside(spec.run_dir, step)
        if candidates:
            # The model and optimizer may hold part of a bad checkpoint: start again, from scratch.
            raise RuntimeError(f"no checkpoint of {spec.job_id} could be loaded; they were set aside, the next "
                               "attempt starts from step 0")
        return None

    def seal_written(self) -> None:
        """Seal a background checkpoint once every rank's writer is done (a collective)."""
        if self.pending and agree(self.strategy.wait_saved(block=False), self.env.world_size, self.device):
            self._commit(self.pending)
            self.pending = None

    def save_on_cadence(self, step: int, epoch: int, next_batch: int, loss: float, total_steps: int) -> None:
        if step % self.spec.checkpoint.every_steps and step != total_steps:
            return
        if self.pending:  # the previous background write must be sealed first
            waited = time.perf_counter()
            self.watchdog.beat(f"waiting for the background checkpoint of step {self.pending['step']}", on_peers=True)
            self.strategy.wait_saved(block=True)
            self.pending["blocked_s"] += time.perf_counter() - waited
            self._commit(self.pending)
        self.watchdog.beat(f"writing the checkpoint of step {step}")
        # The last one in the foreground: the job ends when it is sealed.
        background = (self.spec.parallel.async_checkpoint and self.strategy.shards_parameters
                      and step < total_steps)
        self.pending = self._save(step, epoch, next_batch, loss, background)

    def _save(self, step: int, epoch: int, next_batch: int, loss: float, background: bool) -> dict[str, Any] | None:
        started = time.perf_counter()
        run_dir, rank, s = self.spec.run_dir, self.env.rank, self.state
        tmp = checkpoint.tmp_dir(run_dir, step)
        weights = self.strategy.save_state(tmp, s.model, s.optimizer, background=background)
        if rank == 0:
            checkpoint.write_shard(tmp, "state.pt", {
                **weights, "schedule": s.schedule.state_dict(), "scaler": s.scaler.state_dict(),
                "step": step, "epoch": epoch, "batch_index": next_batch,
            })
        checkpoint.write_shard(tmp, f"rng-rank{rank}.pt", rng_state())
        if self.injector is not None:
            self.injector.maybe_fire(step, phase="checkpoint")
        pending = {"step": step, "epoch": epoch, "next_batch": next_batch, "loss": loss, "started": started,
                   "blocked_s": time.perf_counter() - started, "background": background}
        if background:
            return pending
        self._commit(pending)
        return None

    def _commit(self, pending: dict[str, Any]) -> None:
        env, run_dir, step, path = self.env, self.spec.run_dir, pending["step"], None
        self.watchdog.beat(f"waiting for every rank's shards of step {step}", on_peers=True)
        if env.world_size > 1:
            dist.barrier()
        committed = time.perf_counter()
        if env.rank == 0:
            self.watchdog.beat(f"sealing the checkpoint of step {step}")
            if self.injector is not None:
                self.injector.maybe_fire(step, phase="commit")
            path = checkpoint.commit(run_dir, step, {"epoch": pending["epoch"], "batch_index": pending["next_batch"],
                                                     "world_size": env.world_size, "loss": pending["loss"]})
            checkpoint.prune(run_dir, self.spec.checkpoint.keep)
        saved = time.perf_counter()
        self.watchdog.beat(f"reporting the checkpoint of step {step} to Ray Train", on_peers=True)  # a barrier of Ray's
        env.on_checkpoint({"step": step, "loss": pending["loss"]}, path)
        if env.rank == 0:
            # blocked_s: how long training waited for this checkpoint; save_s: until it was sealed.
            blocked = pending["blocked_s"] + (saved - committed)
            events.emit(run_dir, events.CheckpointCommitted(
                step=step, path=storage.relative(path, run_dir), save_s=round(saved - pending["started"], 4),
                blocked_s=round(blocked, 4), background=pending["background"],
                report_s=round(time.perf_counter() - saved, 4)))
