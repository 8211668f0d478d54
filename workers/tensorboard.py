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

On an object store (s3://...) TensorBoard's writer cannot append to an object, so it
writes a local spool and the spool's event files are copied whole to
<run_dir>/tensorboard/ (one PUT each, so a reader sees a file as it was at some copy),
at most every COPY_EVERY_S and when the driver ends; progress.json is written after the
files that hold its points. An event file is closed at ROLL_BYTES and the next begun, so
a copy rewrites at most that much. A driver resubmitted on another host reads the
progress from the bucket and goes on from there, as above. TensorBoard reads the bucket
itself (`tensorboard --logdir s3://...`, through boto3 or fsspec).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from typing import Any

from workers import events, storage
from workers.events import Kind

DIR = "tensorboard"
PROGRESS = "progress.json"
TRAIN_SCALARS = ("loss", "lr", "samples_per_s")
COPY_EVERY_S = 2.0
ROLL_BYTES = 1 << 20


def board_dir(run_dir: str) -> str:
    return os.path.join(run_dir, DIR)


class BoardWriter:
    """Turns the run directory's new records into TensorBoard points on each `poll()`."""

    def __init__(self, run_dir: str, spool: str | None = None):
        """`spool`: where the event files are written first when `run_dir` is on an object
        store (a fresh directory under it, removed by close())."""
        # `board` is where the files end up; `dir` where TensorBoard's writer writes them.
        self.board = board_dir(run_dir) if storage.is_local(run_dir) else storage.join(run_dir, DIR)
        self.remote = not storage.is_local(run_dir)
        self.dir = self.board
        if self.remote:
            os.makedirs(spool or tempfile.gettempdir(), exist_ok=True)
            self.dir = tempfile.mkdtemp(prefix="tensorboard-", dir=spool)
        self.copied: dict[str, int] = {}  # spool file: size copied to the store
        self.copied_at = 0.0
        self.unsaved = False  # points written that the saved progress does not count yet
        self.metrics = events.tail(run_dir, events.METRICS)
        self.events = events.tail(run_dir, events.EVENTS)
        self.last_step = self.last_val_step = 0
        # After an earlier driver: its points past the progress it saved are hidden.
        self.purge_step = self.last_step + 1 if self._load() else None
        self.writer = None  # opened on the first point: a new event file per driver

    def _load(self) -> bool:
        """An earlier driver's progress; False when there is none."""
        try:
            saved = json.loads(storage.read_bytes(storage.join(self.board, PROGRESS)))
        except (FileNotFoundError, ValueError):
            return False  # none yet (or unreadable): start from the beginning of the files
        self.metrics.position, self.events.position = saved["metrics_offset"], saved["events_offset"]
        self.last_step, self.last_val_step = saved["last_step"], saved["last_val_step"]
        return True

    def poll(self, final: bool = False) -> None:
        """Write what was appended since the last call; flush and record progress if any
        (on an object store: copy the files, then record, at most every COPY_EVERY_S)."""
        wrote = False
        for row in self.metrics.read():
            wrote |= self._row(row)
        for e in self.events.read():
            wrote |= self._event(e)
        if wrote:
            self.writer.flush()
            self.unsaved = True
        if self.unsaved and (not self.remote or final or time.time() - self.copied_at >= COPY_EVERY_S):
            try:
                self._copy()
                self._save()
            except Exception:
                if final or not self.remote:
                    raise
                self.copied_at = time.time()  # a storage blip: the next round copies the same files again
                return
            self.unsaved = False
            self._roll()

    def close(self) -> None:
        self.poll(final=True)
        if self.writer is not None:
            self.writer.close()
        if self.remote:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _open(self):
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(self.dir, purge_step=self.purge_step)
            self.purge_step = None  # hides an earlier driver's points once, never this one's
        return self.writer

    def _copy(self) -> None:
        """Each spool file that grew, whole, to the store (before the progress that counts it)."""
        if not self.remote:
            return
        for name in sorted(os.listdir(self.dir)):
            path = os.path.join(self.dir, name)
            if os.path.getsize(path) != self.copied.get(name):
                with open(path, "rb") as f:
                    data = f.read()
                storage.write_bytes(storage.join(self.board, name), data)
                self.copied[name] = len(data)
        self.copied_at = time.time()

    def _roll(self) -> None:
        """On an object store, a full event file is closed (it was just copied whole) and
        the next point begins another: each copy rewrites at most ROLL_BYTES."""
        if self.remote and self.writer is not None and max(self.copied.values(), default=0) >= ROLL_BYTES:
            self.writer.close()
            self.writer = None
            self._copy()  # whatever closing the file added
            for name in list(self.copied):
                os.remove(os.path.join(self.dir, name))  # copied whole; never written again
            self.copied.clear()

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
        """progress.json, replaced whole (locally fsync, then rename; on a store one PUT) so
        a driver that dies mid-write leaves the previous one, never a torn one."""
        storage.write_bytes(storage.join(self.board, PROGRESS), json.dumps({
            "last_step": self.last_step, "last_val_step": self.last_val_step,
            "metrics_offset": self.metrics.position, "events_offset": self.events.position}).encode())
