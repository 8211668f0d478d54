"""failure.mode live: the survivors of a failure keep training.

Every worker is its own replica group (Ray Train's TorchftConfig; its groups hold one
worker). torchft's Manager forms a quorum of the live groups (every QUORUM_EVERY steps,
and at once after a step a peer failed in) and averages the gradients over it, so a
dead group drops out after the lighthouse stops hearing from it and the others go on.
Ray Train replaces only the failed group; the newcomer's first quorum finds it behind
the others and it takes their current weights, optimizer and schedule from a live peer
over the process group (torchft's PGTransport), not from disk. Durable checkpoints are
written by the quorum's first group alone; a job whose every group died starts again
from the newest, as in exact mode.

What a live recovery changes, compared with exact mode: the data order is fixed per
(step, group) (group g reads the g-th share of step s's global batch, as in exact
mode), so no sample is trained twice; the shares of the groups missing from a step are
trained by no one. The step's gradient is then the mean over the groups present. The
leader records those skipped samples in the `live_recovered` event. A live run is
therefore not bit-identical to an undisturbed one; exact mode is.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch

from workers import checkpoint, events, metrics_read, recovery, storage, tasks
from workers.checkpointing import seed_everything
from workers.data.loader import read
from workers.data.sampler import ResumableDistributedSampler
from workers.events import Kind
from workers.faults import FaultInjector
from workers.loop import WorkerEnv, evaluate, make_schedule, state_sha256, task_optimizer, worker_device
from workers.spec import JobSpec
from workers.strategies.base import low_precision
from workers.watchdog import Watchdog

# The lighthouse drops a group it has not heard from for this long; the survivors' next
# quorum waits for that. torchft's default (5 s) is most of a live recovery's stall.
HEARTBEAT_TIMEOUT_MS = 2000

# The groups agree on a quorum every this many steps, not each one: a quorum is an RPC to
# the lighthouse plus a thread that wakes each step, and a per-step should_commit already
# tells every group that a peer failed (its all-reduce errors, nothing is applied and the
# next step asks for a quorum at once). Every 10 steps took live mode from 0.78-0.79x to
# 0.82-0.91x exact mode's samples/s on this 2-core machine (bench/live_recovery.py). The price: a
# replacement waits up to this many of the survivors' steps to be let in. All groups must
# ask at the same steps (step-based, never time-based), or a quorum waits for a group
# that is not asking.
QUORUM_EVERY = 10


# A group the lighthouse hears from but that has not asked for the quorum yet is waited
# for this long. Shorter than a step, three groups fell into two quorums of two taking
# turns (each step trained by two, one always healing); longer, the survivors wait that
# long for a replacement that heartbeats while it still sets up.
JOIN_TIMEOUT_MS = 2000


def lighthouse_kwargs() -> dict[str, Any]:
    """For Ray Train's TorchftConfig: one group is enough to go on."""
    return {"min_replicas": 1, "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS, "join_timeout_ms": JOIN_TIMEOUT_MS}


@dataclass
class Outage:
    """What the survivors see between the last step every group completed and the next."""

    failed_after_step: int
    failed_at: float
    first_step_at: float | None = None
    survivor_steps: int = 0
    samples_skipped: int = 0


@dataclass
class Tracker:
    """Each group follows the quorums, and a replacement takes the survivors' view with
    their state, so every group of a step knows the same: that step's leader reports."""

    run_dir: str
    groups: int
    share: int
    attempt: int
    last_full: tuple[int, float] | None = None  # (step, time) every group completed last
    outage: Outage | None = None
    leader: bool = False
    recovered: list[dict[str, Any]] = field(default_factory=list)

    def committed(self, step: int, participants: int, leader: bool, joined: bool) -> None:
        """`joined`: a replacement took part in this step for the first time (the survivors
        may have completed no step without it, when they were held up meanwhile)."""
        now = time.time()
        self.leader = leader
        if participants >= self.groups:
            if (self.outage is not None or joined) and leader and self.last_full is not None:
                self.outage = self.outage or Outage(failed_after_step=self.last_full[0], failed_at=self.last_full[1])
                self.report(step, now)
            self.outage, self.last_full = None, (step, now)
        elif self.last_full is not None:
            if self.outage is None:
                self.outage = Outage(failed_after_step=self.last_full[0], failed_at=self.last_full[1],
                                     first_step_at=now)
            self.outage.survivor_steps += 1
            self.outage.samples_skipped += self.share * (self.groups - participants)

    def report(self, step: int | None, now: float | None) -> None:
        out = self.outage
        assert out is not None
        # The replacements that joined, and the workers Ray Train saw fail: a replacement
        # may not have joined by the end of the job.
        since = [e for e in events.events(self.run_dir) if e["time"] >= out.failed_at and e.get("rank") is not None
                 and e["event"] in (Kind.LIVE_JOINED, Kind.WORKER_FAILED)]
        ranks = sorted({e["rank"] for e in since})
        self.recovered.append(events.emit(self.run_dir, events.LiveRecovered(
            attempt=self.attempt, failed_ranks=ranks, groups=ranks, failed_after_step=out.failed_after_step,
            rejoined_at_step=step, stall_s=round((out.first_step_at or now or time.time()) - out.failed_at, 3),
            rejoin_s=round(now - out.failed_at, 3) if now is not None else None,
            survivor_steps=out.survivor_steps, samples_skipped=out.samples_skipped, survivors_restarted=False)))

    def snapshot(self) -> dict[str, Any]:
        """What a replacement takes with the state, so it can report an outage it joined in."""
        return {"last_full": self.last_full, "outage": asdict(self.outage) if self.outage else None}

    def restore(self, saved: dict[str, Any]) -> None:
        self.last_full = tuple(saved["last_full"]) if saved["last_full"] else None
        self.outage = Outage(**saved["outage"]) if saved["outage"] else None

    def finish(self) -> None:
        if self.outage is not None and self.leader:  # the job ended before the missing groups came back
            self.report(None, None)


def quiet_torchft() -> None:
    """torchft logs three lines a step at INFO (should_commit, from its Rust side and its
    Python side): some 80 lines a second from each worker on this machine, which Ray's log
    monitor then read and published. Its Python side keeps every other line (a step that
    did not commit, a quorum change), its Rust side its warnings and errors; a RUST_LOG
    the worker already has wins."""
    os.environ.setdefault("RUST_LOG", "warn")  # read when torchft's first server starts
    logger = logging.getLogger("torchft.manager")
    if _per_step not in logger.filters:
        logger.addFilter(_per_step)


def _per_step(record: logging.LogRecord) -> bool:
    return "should_commit=True" not in record.getMessage()  # a step that did not commit is kept


def train(spec: JobSpec, env: WorkerEnv, watchdog: Watchdog) -> dict[str, Any] | None:
    quiet_torchft()
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
    from torchft.checkpointing.pg_transport import PGTransport

    run_dir, rank, groups, cfg = spec.run_dir, env.rank, env.world_size, spec.training
    device = worker_device(spec, env)
    # Every group builds the same initial model, so step 0 needs no transfer (init_sync off).
    seed_everything(cfg.seed)
    watchdog.beat(f"building the task ({spec.task or 'built-in'})")
    task = tasks.load(spec)
    train_set, val_set = task.datasets()
    sampler = ResumableDistributedSampler(len(train_set), cfg.global_batch_size, rank=rank, world_size=groups,
                                          seed=cfg.seed)
    total_steps = cfg.max_steps or cfg.epochs * sampler.steps_per_epoch
    model = task.model().to(device)
    optimizer = task_optimizer(task, cfg, model)
    schedule = make_schedule(cfg, optimizer, total_steps)
    # A replacement joins the start its survivors belong to and takes its state from one
    # of them: it reads no checkpoint. A full start resumes from the newest one.
    known = events.events(run_dir, Kind.ATTEMPT_STARTED)
    joining = bool(known and env.generation and known[-1].get("generation") == env.generation)
    sound = [] if joining else checkpoint.sound(run_dir)
    from_step = sound[0][0] if sound else 0
    attempt = {"number": len(known) if joining else len(known) + 1}
    tracker = Tracker(run_dir, groups, sampler.local_batch, attempt["number"])
    fetched: list[float] = []

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                "attempt": attempt["number"], "tracker": tracker.snapshot()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        attempt["number"] = tracker.attempt = state["attempt"]
        tracker.restore(state["tracker"])
        fetched.append(time.perf_counter())

    injector = FaultInjector(spec.faults, run_dir, rank)
    # The manager heartbeats from here on, and the lighthouse waits for a group it hears:
    # nothing slow may come between it and the first quorum.
    timeout = timedelta(seconds=spec.failure.collective_timeout_s)
    pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
    watchdog.beat("joining the replica groups' quorum")
    manager = Manager(
        pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
        # The quorum of a step forms while the step's forward and backward run (a sync
        # quorum costs each step a round trip to the lighthouse that waits for the slowest
        # group). A newcomer then heals during its first step: it computes that step on
        # its initial weights, torchft zeroes its gradient and counts it out of the step's
        # participants everywhere, and its share of that step is trained by no one.
        use_async_quorum=True, init_sync=False,
        # Zero-padded: torchft orders a quorum's groups by id, so the leader is the lowest live rank.
        replica_id=f"{spec.job_id}-{rank:05d}", rank=0, world_size=1,
        timeout=timeout, quorum_timeout=timedelta(seconds=max(60, spec.failure.collective_timeout_s)),
        checkpoint_transport=PGTransport(pg, timeout=timeout, device=device),
    )
    manager.load_state_dict({"step": from_step, "batches_committed": from_step * groups})
    if not joining and env.barrier is not None:
        # Every group of a full start is heard by the lighthouse before anyone asks for a
        # quorum, so the first one holds them all (it would otherwise start with the first
        # to arrive, and the others would join it a few steps late).
        watchdog.beat("waiting for every worker of this start")
        env.barrier()
    params = [p for p in model.parameters() if p.requires_grad]
    amp_dtype = low_precision(spec.precision)
    first, joined_in, announced, renew = True, False, False, False
    leader = False
    loss = torch.zeros(())
    epoch, perm, perm_epoch = -1, None, -1
    asked = time.perf_counter()
    try:
        while manager.current_step() < total_steps:
            watchdog.beat(f"waiting for the quorum of step {manager.current_step() + 1}")
            started = time.perf_counter()  # the quorum is part of a live step's time
            if first or renew or manager.current_step() % QUORUM_EVERY == 0:
                manager.start_quorum()
            if first:
                first = False
                manager.wait_quorum()
                if joining and not _wait_for_a_peer(spec, manager, watchdog, total_steps):
                    return None  # the survivors trained the last step while this replacement started
                _first_quorum(spec, env, manager, attempt, joining, sound, model, optimizer, schedule, total_steps,
                              groups)
                tracker.attempt = attempt["number"]
            index = manager.current_step()
            step = index + 1
            injector.maybe_fire(step)
            epoch = index // sampler.steps_per_epoch
            if epoch != perm_epoch:
                perm, perm_epoch = sampler.permutation(epoch), epoch
            base = (index % sampler.steps_per_epoch) * sampler.global_batch
            x, y = next(read(train_set, [perm[base + sampler.lo: base + sampler.hi]], seed=cfg.seed + index))
            x, y = x.to(device), y.to(device)
            watchdog.beat(f"training step {step}", step=index)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = task.loss(model(x), y)
            loss.backward()
            mean, newcomer = _average(manager, params, loss, new=bool(fetched) and not joined_in)
            renew = True  # a step that did not commit asks for a quorum at once
            if not manager.should_commit():
                continue  # a peer failed mid-step: nothing was applied, the step is retried
            if fetched and not joined_in and not announced:
                announced = True  # the peer's state was applied in should_commit
                events.emit(run_dir, events.LiveJoined(
                    attempt=attempt["number"], rank=rank, group=rank, pid=os.getpid(),
                    step=manager.current_step() - 1, fetch_s=round(fetched[-1] - asked, 3)))  # the peer's step
            joined_in = joined_in or manager.is_participating()
            optimizer.step()
            schedule.step()
            step_s = time.perf_counter() - started
            # A group that was behind healed in this step's quorum: the step it committed is
            # the quorum's, not the one it guessed when it read its data (whose gradient
            # torchft zeroed).
            step = manager.current_step()
            index, epoch = step - 1, (step - 1) // sampler.steps_per_epoch
            leader = manager.participating_rank() == 0
            participants = manager.num_participants()
            # A group healed in this quorum (the process group holds more than took part):
            # torchft leaves healing only at the next start_quorum, which every group of the
            # quorum must join, or the healed one applies a state it no longer has.
            renew = pg.size() > participants
            tracker.committed(step, participants, leader, joined=newcomer)
            if leader:
                events.log_metrics(run_dir, events.MetricsLine(
                    step=step, epoch=epoch, loss=float(mean), lr=schedule.get_last_lr()[0],
                    samples_per_s=sampler.local_batch * participants / step_s, step_s=step_s,
                    attempt=attempt["number"], groups=participants))
                if step % spec.checkpoint.every_steps == 0 or step == total_steps:
                    _save(spec, step, epoch, index + 1 - epoch * sampler.steps_per_epoch, float(mean), model,
                          optimizer, schedule, watchdog, groups)
    finally:
        manager.shutdown(wait=False)
    tracker.finish()
    if not leader:  # the leader of the last step reports the end
        return None
    weights = model.state_dict()
    scores = {}
    if val_set is not None:
        scores = evaluate(model, task=task, dataset=val_set, rank=0, world=1, device=device,
                          batch_size=cfg.eval_batch_size, watchdog=watchdog, workers=spec.dataset.loader_workers)
    checkpoint.write_shard(storage.join(run_dir, "final"), "model.pt", weights)
    return events.emit(run_dir, events.Finished(
        attempt=attempt["number"], final_step=manager.current_step(), loss=float(loss.detach()),
        val_loss=scores.pop("loss", None), val_accuracy=scores.get("accuracy"), val_metrics=scores,
        weights_sha256=state_sha256(weights), world_size=groups))


def _average(manager, params: list[torch.Tensor], loss: torch.Tensor, new: bool) -> tuple[torch.Tensor, bool]:
    """One all-reduce per step, over the groups in the quorum: the gradients, the loss
    and whether a newcomer took part. torchft's DistributedDataParallel would reduce the
    gradients in its comm hook (with find_unused_parameters on, a walk of the autograd
    graph every step) and the loss would need a second collective, each a rendezvous of
    every group. torchft zeroes a healing group's part and averages over the participants."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads]
                     + [loss.detach().float().reshape(1), torch.tensor([float(new)], device=loss.device)])
    manager.allreduce(flat).wait()
    for p, chunk in zip(params, torch.split(flat[:-2], [p.numel() for p in params])):
        p.grad = chunk.view_as(p).to(p.dtype)
    return flat[-2], bool(flat[-1] > 0)


def _wait_for_a_peer(spec: JobSpec, manager, watchdog: Watchdog, total_steps: int) -> bool:
    """A replacement must join the survivors, never start a run of its own. While they
    are held up (a collective on a dead peer waits out its timeout) two replacements
    may find each other first and form a quorum without them, at step 0: seen with two
    failures in a row. So it asks again until a peer at the job's step is in its quorum.
    False where the survivors trained the last step meanwhile (a failure near the end):
    nothing is left for this group, and Ray Train ends the run once it returns."""
    deadline = time.monotonic() + 3 * spec.failure.collective_timeout_s
    # A group that is not participating is healing from a peer ahead of it.
    while manager.is_participating():
        done = (metrics_read.latest(spec.run_dir) or {}).get("step") or 0
        if done >= total_steps:
            return False
        if manager.current_step() >= done:
            return True
        if time.monotonic() > deadline:
            raise RuntimeError("no live peer joined this replacement's quorum: the survivors are gone")
        watchdog.beat("waiting for a live peer to join this replacement's quorum")
        time.sleep(0.2)
        manager.start_quorum()
        manager.wait_quorum()
    return True


def _first_quorum(spec: JobSpec, env: WorkerEnv, manager, attempt: dict[str, int], joining: bool,
                  sound: list[tuple[int, str]], model, optimizer, schedule, total_steps: int, groups: int) -> None:
    """After this group's first quorum: a replacement is healing from a peer (torchft
    applies the peer's state before the step commits); a group of a full start loads the
    newest checkpoint (every group of it, the same one), and the leader records the attempt."""
    run_dir, rank = spec.run_dir, env.rank
    if sound and manager.is_participating():
        _, path = sound[0]
        saved = checkpoint.load_shard(path, "state.pt")
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
    if not joining and manager.participating_rank() == 0:
        begun, accounting = recovery.begin(run_dir, groups, env.generation)  # the attempt and what the one before lost
        attempt["number"] = begun.number
        if accounting.pending:
            accounting.record(run_dir)
        events.emit(run_dir, events.TrainingStarted(attempt=begun.number, world_size=groups, total_steps=total_steps,
                                                    from_step=manager.current_step(),
                                                    checkpoint=sound[0][1] if sound else None))
    events.emit(run_dir, events.WorkerStarted(attempt=attempt["number"], rank=rank, pid=os.getpid(),
                                              node_id=env.node_id, process_started=env.process_started,
                                              ready=env.ready), durable=False)


def _save(spec: JobSpec, step: int, epoch: int, next_batch: int, loss: float, model, optimizer, schedule,
          watchdog: Watchdog, groups: int) -> None:
    """The leader writes the checkpoint alone: every group holds the same state. Its files
    are exact mode's (state.pt), so either mode resumes from them."""
    run_dir = spec.run_dir
    watchdog.beat(f"writing the checkpoint of step {step}")
    started = time.perf_counter()
    tmp = checkpoint.tmp_dir(run_dir, step)
    checkpoint.write_shard(tmp, "state.pt", {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                             "schedule": schedule.state_dict(), "scaler": {}, "step": step,
                                             "epoch": epoch, "batch_index": next_batch})
    path = checkpoint.commit(run_dir, step, {"epoch": epoch, "batch_index": next_batch, "world_size": groups,
                                             "loss": loss})
    checkpoint.prune(run_dir, spec.checkpoint.keep)
    took = round(time.perf_counter() - started, 4)
    events.emit(run_dir, events.CheckpointCommitted(step=step, path=storage.relative(path, run_dir), save_s=took,
                                                    blocked_s=took, background=False))
