"""TensorBoard scalars for a run, written by the job driver from its run directory.

The driver already tails metrics.jsonl and events.jsonl (workers/console.py), so it
writes <run_dir>/tensorboard/ too: the workers stay free of it, and the files hold every
fact (`tensorboard --logdir <storage>` shows every job). Each step is written once
(workers/scalars.py), and that progress (with where the records were read up to) lives
in progress.json beside the event files, replaced atomically after the event file is
flushed. A driver that died between the two had written points past
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
import os
import shutil
import tempfile
import time

from workers import storage
from workers.scalars import Feed

DIR = "tensorboard"
PROGRESS = "progress.json"
COPY_EVERY_S = 2.0
ROLL_BYTES = 1 << 20


def board_dir(run_dir: str) -> str:
    return storage.join(run_dir, DIR)


class BoardWriter:
    """Turns the run directory's new records into TensorBoard points on each `poll()`."""

    STOPPED = "TensorBoard files are no longer written"  # the driver's line when poll() fails

    def __init__(self, run_dir: str, spool: str | None = None):
        """`spool`: where the event files are written first when `run_dir` is on an object
        store (a fresh directory under it, removed by close())."""
        # `board` is where the files end up; `dir` where TensorBoard's writer writes them.
        self.board = board_dir(run_dir)
        self.remote = not storage.is_local(run_dir)
        self.dir = self.board
        if self.remote:
            if spool:
                os.makedirs(spool, exist_ok=True)
            self.dir = tempfile.mkdtemp(prefix="tensorboard-", dir=spool)
        self.copied: dict[str, int] = {}  # spool file: size copied to the store
        self.read_at = 0.0
        self.unsaved = False  # points written that the saved progress does not count yet
        self.feed = Feed(run_dir)
        # After an earlier driver: its points past the progress it saved are hidden.
        self.purge_step = self.feed.last_step + 1 if self._load() else None
        self.writer = None  # opened on the first point: a new event file per driver

    @property
    def last_step(self) -> int:
        return self.feed.last_step

    def _load(self) -> bool:
        """An earlier driver's progress; False when there is none."""
        try:
            saved = json.loads(storage.read_bytes(storage.join(self.board, PROGRESS)))
        except (FileNotFoundError, ValueError):
            return False  # none yet (or unreadable): start from the beginning of the files
        self.feed.restore(saved)
        return True

    def poll(self, final: bool = False) -> None:
        """Write what was appended since the last call; flush and record progress if any
        (on an object store: read, copy the files, then record, at most every COPY_EVERY_S:
        each read there lists the record's streams)."""
        if self.remote and not final and time.time() - self.read_at < COPY_EVERY_S:
            return
        self.read_at = time.time()
        points = self.feed.read()
        for p in points:
            if p.text is None:
                self._open().add_scalar(p.tag, p.value, p.step)
            else:
                self._open().add_text(p.tag, p.text, p.step)
        if points:
            self.writer.flush()
            self.unsaved = True
        if self.unsaved:
            try:
                self._copy()
                self._save()
            except Exception:
                if final or not self.remote:
                    raise
                return  # a storage blip: the next round copies the same files again
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

    def _save(self) -> None:
        """progress.json, replaced whole (locally fsync, then rename; on a store one PUT) so
        a driver that dies mid-write leaves the previous one, never a torn one."""
        storage.write_bytes(storage.join(self.board, PROGRESS), json.dumps(self.feed.state()).encode())
