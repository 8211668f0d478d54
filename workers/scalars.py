"""The points a run's curves are drawn from, read from its run record as it grows: what
the driver hands to TensorBoard (workers/tensorboard.py) and to MLflow
(workers/mlflow_logger.py).

The records are not a clean series: steps recomputed after a worker restart are logged
again, and a driver the service starts again on the same run directory reads
everything again. So a step gives points only past the last step given, and that
progress (`state()`, with where each stream was read up to) is what a view saves beside
its own output, so that the next driver goes on from it (`restore()`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from workers import events
from workers.events import Kind

TRAIN_SCALARS = ("loss", "lr", "samples_per_s")


@dataclass(frozen=True)
class Point:
    """A scalar at a step (`value`), or a line of text there (`text`)."""

    tag: str
    step: int
    value: float | None = None
    text: str | None = None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def recovery_text(e: dict[str, Any]) -> str:
    """One line for a `resumed` event."""
    who = f"rank {e['failed_rank']}" if e.get("failed_rank") is not None else "the driver"
    recovery_s = e.get("recovery_s")
    took = f"{recovery_s:.1f}s" if _number(recovery_s) and math.isfinite(recovery_s) else "?"
    return (f"{who} failed ({e.get('cause')}): resumed from step {e.get('from_step') or 0}, "
            f"{e.get('lost_steps')} step(s) recomputed, {took} to recover")


def live_recovery_text(e: dict[str, Any]) -> str:
    """One line for a `live_recovered` event: the survivors kept training."""
    ranks = ", ".join(str(r) for r in e.get("failed_ranks") or []) or "?"
    rejoin_s = e.get("rejoin_s")
    rejoined = (f"rejoined at step {e.get('rejoined_at_step')} after {rejoin_s:.1f}s" if _number(rejoin_s)
                else "did not rejoin before the end")
    return (f"rank {ranks} failed after step {e.get('failed_after_step')} (live): the others trained "
            f"{e.get('survivor_steps')} step(s) without it, stalled {e.get('stall_s', 0):.1f}s; its replacement "
            f"{rejoined}")


class Feed:
    """The run directory's new points at each `read()`, each step once."""

    def __init__(self, run_dir: str):
        self.metrics = events.tail(run_dir, events.METRICS)
        self.events = events.tail(run_dir, events.EVENTS)
        self.last_step = self.last_val_step = 0
        self.ended: str | None = None  # the record's verdict: Kind.FINISHED or Kind.FAILED

    def state(self) -> dict[str, Any]:
        """JSON-serialisable; the keys progress.json has always had."""
        return {"last_step": self.last_step, "last_val_step": self.last_val_step,
                "metrics_offset": self.metrics.position, "events_offset": self.events.position}

    def restore(self, saved: dict[str, Any]) -> None:
        self.metrics.position, self.events.position = saved["metrics_offset"], saved["events_offset"]
        self.last_step, self.last_val_step = saved["last_step"], saved["last_val_step"]

    def read(self) -> list[Point]:
        points: list[Point] = []
        for row in self.metrics.read():
            points += self._row(row)
        for e in self.events.read():
            points += self._event(e)
        return points

    def _row(self, row: dict[str, Any]) -> list[Point]:
        step = row.get("step")
        if not isinstance(step, int) or step <= self.last_step:
            return []  # recomputed after a restart, or given to an earlier driver
        self.last_step = step
        points = [Point(name, step, row[name]) for name in TRAIN_SCALARS if _number(row.get(name))]
        if "val_loss" in row:
            points += self._val(row, step)
        return points

    def _val(self, record: dict[str, Any], step: int) -> list[Point]:
        if step <= self.last_val_step:
            return []  # the finished event repeats the last metrics line's scores
        self.last_val_step = step
        metrics = dict(record.get("val_metrics") or {})
        if record.get("val_accuracy") is not None:
            metrics.setdefault("accuracy", record["val_accuracy"])
        scores = [("val/loss", record.get("val_loss"))] + [(f"val/{k}", v) for k, v in sorted(metrics.items())]
        return [Point(tag, step, value) for tag, value in scores if _number(value)]

    def _event(self, e: dict[str, Any]) -> list[Point]:
        kind = e.get("event")
        if kind in events.VERDICTS:
            self.ended = kind
        if kind == Kind.FINISHED:
            return self._val(e, e["final_step"]) if isinstance(e.get("final_step"), int) else []
        if kind == Kind.RESUMED:
            step = e.get("from_step") or 0
            points = [Point("recovery_s", step, e["recovery_s"])] if _number(e.get("recovery_s")) else []
            return points + [Point("recoveries", step, text=recovery_text(e))]
        if kind == Kind.LIVE_RECOVERED and isinstance(e.get("failed_after_step"), int):
            step = e["failed_after_step"]
            points = [Point(f"live/{k}", step, e[k]) for k in ("stall_s", "rejoin_s") if _number(e.get(k))]
            return points + [Point("recoveries", step, text=live_recovery_text(e))]
        return []
