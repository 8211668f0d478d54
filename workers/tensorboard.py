"""TensorBoard scalars for a run, written by the job driver from its run directory.

The driver already tails metrics.jsonl and events.jsonl (workers/console.py), so it
writes <run_dir>/tensorboard/ too: the workers stay free of it, and the files hold every
fact (`tensorboard --logdir <storage>` shows every job). The records are not a clean
series: steps recomputed after a worker restart are logged again, and a driver the
service starts again on the same run directory would read everything again. So a step
is written only past the last one written, and that progress (with the byte offsets
read up to) lives in progress.json beside the event files, replaced atomically after
the event file is flushed. A driver that died between the two had written points past
the progress it saved; the next driver opens its event file with `purge_step` just past
that progress, and TensorBoard hides what the earlier files hold from there on.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from workers import events
from workers.events import Kind

DIR = "tensorboard"
PROGRESS = "progress.json"
TRAIN_SCALARS = ("loss", "lr", "samples_per_s")


def board_dir(run_dir: str) -> str:
    return os.path.join(run_dir, DIR)


class BoardWriter:
    """Turns the run directory's new records into TensorBoard points on each `poll()`."""

    def __init__(self, run_dir: str):
        self.dir = board_dir(run_dir)
        self.metrics = events.tail(run_dir, events.METRICS)
        self.events = events.tail(run_dir, events.EVENTS)
        self.last_step = self.last_val_step = 0
        # After an earlier driver: its points past the progress it saved are hidden.
        self.purge_step = self.last_step + 1 if self._load() else None
        self.writer = None  # opened on the first point: a new event file per driver

    def _load(self) -> bool:
        """An earlier driver's progress; False when there is none."""
        try:
            with open(os.path.join(self.dir, PROGRESS)) as f:
                saved = json.load(f)
        except (FileNotFoundError, ValueError):
            return False  # none yet (or unreadable): start from the beginning of the files
        self.metrics.offset, self.events.offset = saved["metrics_offset"], saved["events_offset"]
        self.last_step, self.last_val_step = saved["last_step"], saved["last_val_step"]
        return True

    def poll(self) -> None:
        """Write what was appended since the last call; flush and record progress if any."""
        wrote = False
        for row in self.metrics.read():
            wrote |= self._row(row)
        for e in self.events.read():
            wrote |= self._event(e)
        if wrote:
            self.writer.flush()
            self._save()

    def close(self) -> None:
        self.poll()
        if self.writer is not None:
            self.writer.close()

    def _open(self):
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(self.dir, purge_step=self.purge_step)
        return self.writer

    def _scalar(self, tag: str, value: Any, step: int) -> bool:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False  # a key the record lacks (None), not a number to plot
        self._open().add_scalar(tag, value, step)
        return True

    def _row(self, row: dict[str, Any]) -> bool:
        step = row.get("step")
        if not isinstance(step, int) or step <= self.last_step:
            return False  # recomputed after a restart, or written by an earlier driver
        self.last_step = step
        wrote = False
        for name in TRAIN_SCALARS:
            wrote |= self._scalar(name, row.get(name), step)
        if "val_loss" in row:
            wrote |= self._val(row, step)
        return wrote

    def _val(self, record: dict[str, Any], step: int) -> bool:
        if step <= self.last_val_step:
            return False  # the finished event repeats the last metrics line's scores
        self.last_val_step = step
        metrics = dict(record.get("val_metrics") or {})
        if record.get("val_accuracy") is not None:
            metrics.setdefault("accuracy", record["val_accuracy"])
        wrote = self._scalar("val/loss", record.get("val_loss"), step)
        for name, value in sorted(metrics.items()):
            wrote |= self._scalar(f"val/{name}", value, step)
        return wrote

    def _event(self, e: dict[str, Any]) -> bool:
        if e.get("event") == Kind.FINISHED and isinstance(e.get("final_step"), int):
            return self._val(e, e["final_step"])
        if e.get("event") == Kind.RESUMED:
            step = e.get("from_step") or 0
            self._scalar("recovery_s", e.get("recovery_s"), step)
            who = f"rank {e['failed_rank']}" if e.get("failed_rank") is not None else "the driver"
            recovery_s = e.get("recovery_s")
            took = f"{recovery_s:.1f}s" if isinstance(recovery_s, (int, float)) and math.isfinite(recovery_s) else "?"
            text = (f"{who} failed ({e.get('cause')}): resumed from step {step}, "
                    f"{e.get('lost_steps')} step(s) recomputed, {took} to recover")
            self._open().add_text("recoveries", text, step)
            return True
        return False

    def _save(self) -> None:
        """progress.json, replaced whole (fsync, then rename) so a driver that dies
        mid-write leaves the previous one, never a torn one."""
        path = os.path.join(self.dir, PROGRESS)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"last_step": self.last_step, "last_val_step": self.last_val_step,
                       "metrics_offset": self.metrics.offset, "events_offset": self.events.offset}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
