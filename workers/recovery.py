"""What a new attempt starts from and what the previous one lost (rank 0's accounting)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from workers import checkpoint, events, failures, metrics_read
from workers.events import Kind


class Recovery:
    """What the previous attempt lost, worked out from the run directory."""

    def __init__(self, run_dir: str, from_step: int, world_size: int | None = None):
        history = events.events(run_dir)
        attempts = [e for e in history if e["event"] == Kind.ATTEMPT_STARTED]
        self.attempt, self.from_step = len(attempts) + 1, from_step
        self.pending = self.attempt > 1
        if not self.pending:
            return
        # A live recovery (failure.mode live) ended no attempt: count only what came after it.
        since = max([attempts[-1]["time"]] + [e["time"] for e in history if e["event"] == Kind.LIVE_RECOVERED])
        recent = [e for e in history if e["time"] >= since]
        failed = [e for e in recent if e["event"] in events.FAILURES]
        culprit = failures.culprit(failed) or {}
        self.failed_rank = culprit.get("rank")
        self.cause = culprit.get("kind") or culprit.get("error") or "unknown"
        # Metrics are sorted by (attempt, step) (metrics_read), so the newest line says how
        # far the previous attempt got, if it is that attempt's.
        last = metrics_read.latest(run_dir)
        if last is not None and last.get("attempt") != attempts[-1].get("attempt"):
            last = None  # the previous attempt completed no step
        self.reached_step = last["step"] if last else from_step
        self.failure_time = min((e["time"] for e in failed), default=time.time())
        if world_size is not None and world_size > attempts[-1].get("world_size", world_size):
            # An elastic job grown by Ray: it kills the old workers (their errors are only
            # echoes of that), so their last step is when that attempt ended.
            self.cause, self.failed_rank = "resize", None
            self.failure_time = last["time"] if last else attempts[-1]["time"]
        self.from_step = from_step

    def record(self, run_dir: str) -> dict[str, Any]:
        self.pending = False
        return events.emit(run_dir, events.Resumed(
            attempt=self.attempt, failed_rank=self.failed_rank, cause=self.cause, from_step=self.from_step,
            reached_step=self.reached_step, lost_steps=max(0, self.reached_step - self.from_step),
            recovery_s=round(time.time() - self.failure_time, 3)))


@dataclass
class Attempt:
    """What every rank must agree on before an attempt sets up: rank 0 decides it."""

    number: int
    candidates: list[tuple[int, str]]  # checkpoints to try, newest first
    delay_s: float  # back-off before set-up


def begin(run_dir: str, world: int, generation: str | None = None) -> tuple[Attempt, Recovery]:
    """Rank 0: clear what a failed attempt half-wrote, list the checkpoints to try, and
    record the attempt before anything that may fail, so an attempt that dies in set-up
    still counts (restarts, back-off); training_started follows once it can train."""
    candidates = checkpoint.sound(run_dir)  # steps without a manifest, or half-written locally, are not in it
    checkpoint.clear_partial(run_dir, candidates)
    recovery = Recovery(run_dir, from_step=candidates[0][0] if candidates else 0, world_size=world)
    delay = failures.backoff_s(run_dir, recovery.attempt)
    if delay:
        events.emit(run_dir, events.Backoff(attempt=recovery.attempt, delay_s=delay,
                                            reason="the previous attempts failed at the same step"))
    note_resize(run_dir, recovery.attempt, world, recovery.from_step)
    events.emit(run_dir, events.AttemptStarted(attempt=recovery.attempt, world_size=world, from_step=recovery.from_step,
                                               checkpoint=candidates[0][1] if candidates else None,
                                               **({"generation": generation} if generation else {})))
    return Attempt(recovery.attempt, candidates, delay), recovery


def note_resize(run_dir: str, attempt: int, world: int, from_step: int) -> None:
    """An attempt that runs with a different worker count than the one before is a resize."""
    before = events.events(run_dir, Kind.ATTEMPT_STARTED)
    if before and before[-1].get("world_size") != world:
        events.emit(run_dir, events.Resized(attempt=attempt, old_size=before[-1]["world_size"], new_size=world,
                                            from_step=from_step))
