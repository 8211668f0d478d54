"""A per-worker watchdog: a hang anywhere becomes a crash that recovery handles.

The collective timeout only catches a rank waiting on a peer inside a collective. It
misses the peer itself (stuck reading data, or rank 0 stuck sealing a checkpoint while
the others wait in a barrier) and a one-worker job, which has no collective at all.
Every stretch of the loop beats; a thread that sees no beat for `timeout_s` records
what the worker was doing (with the main thread's stack) and SIGKILLs the process,
so Ray Train sees a dead worker and restarts the group from the newest checkpoint.
torch's own watchdogs cover NCCL collectives only (TORCH_NCCL_*), not gloo or Python.

A rank stuck on its own stalls every peer waiting for it in a collective, and all their
watchdogs would expire within the same poll. A rank that is waiting on its peers
(`beat(..., on_peers=True)`) therefore gets half the timeout again as grace: the stuck
rank's own watchdog fires first and the record names the rank and the stretch that
really stopped, not an echo of it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

from workers import events


class Watchdog:
    def __init__(self, timeout_s: float, run_dir: str, rank: int, *, kill=None):
        self.timeout_s, self.run_dir, self.rank = timeout_s, run_dir, rank
        self.activity, self.step, self.attempt = "starting", 0, None
        self._last = time.monotonic()
        self._grace = 0.0
        self._watched = threading.get_ident()  # the training thread (not the main one under Ray Train)
        self._stop = threading.Event()
        self._kill = kill or (lambda: os.kill(os.getpid(), signal.SIGKILL))
        self._thread = threading.Thread(target=self._watch, name="etrain-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def beat(self, activity: str | None = None, step: int | None = None, *, on_peers: bool = False) -> None:
        self._last = time.monotonic()
        if activity is not None:
            self.activity = activity
            self._grace = self.timeout_s / 2 if on_peers else 0.0
        if step is not None:
            self.step = step

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s + self._grace:
                self._fire(idle)
                return

    def _fire(self, idle: float) -> None:
        frame = sys._current_frames().get(self._watched)
        stack = "".join(traceback.format_stack(frame)[-12:]) if frame else ""
        events.emit(self.run_dir, events.WorkerFailed(
            rank=self.rank, step=self.step + 1, attempt=self.attempt, classification="infrastructure", hung=True,
            activity=self.activity, traceback=stack[-4000:],
            error=f"hung: no progress for {idle:.0f}s while {self.activity} (failure.hang_timeout_s = {self.timeout_s:g})"))
        self._kill()
