"""What `python -m workers.run` prints while a job runs: read from the run directory.

The driver prints and the workers do not: a worker's print reaches the driver through
Ray's log forwarding, which Ray Train's print patch doubles and which carries every
Ray-internal line too. The run directory already holds every fact worth a line
(events and metrics), so the driver tails it and says each thing once: attempts,
progress at least every 10 s (step, loss, samples/s, elapsed, ETA), failures as one
short block (the whole traceback stays in events.jsonl), recoveries and the end.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

from workers import events, failures
from workers.events import Kind

PROGRESS_EVERY_S = 9.5  # polled every 0.5 s: a line at least every 10 s
TRACEBACK_LINES = 3


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Reporter:
    def __init__(self, run_dir: str, out: TextIO = sys.stdout, started: float | None = None,
                 views: list | None = None):
        self.events = events.tail(run_dir, events.EVENTS)
        self.metrics = events.tail(run_dir, events.METRICS)
        self.out, self.started = out, started or time.time()
        self.total: int | None = None
        self.last: dict[str, Any] | None = None  # newest metrics line
        self.printed_at = 0.0
        self.printed_step = -1
        self.rate: tuple[float, int] | None = None  # (time, step) where the current pace is measured from
        self.attempt: int | None = None  # the newest attempt_started's
        self.failures: list[dict[str, Any]] = []  # failure events of the attempt that is failing
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        # Polled along: workers.tensorboard.BoardWriter, workers.mlflow_logger.MlflowLogger.
        self.views = list(views or [])
        # Records written before this driver started belong to an earlier run of the job.
        self.events.skip_to_end()
        self.metrics.skip_to_end()

    def say(self, text: str) -> None:
        self.out.write(f"[train] {text}\n")
        self.out.flush()

    def poll(self) -> None:
        for e in self.events.read():
            self.on_event(e)
        rows = self._current(self.metrics.read())
        if rows:
            self.last = rows[-1]
            if self.rate is None:
                self.rate = (rows[0]["time"], rows[0]["step"] - 1)
        now = time.time()
        # A line is due every PROGRESS_EVERY_S once the attempt's pace is known (two of its
        # steps apart: the first poll after a restart can hold one), and at the last step.
        if self.last and self.last["step"] != self.printed_step and (
                (now - self.printed_at >= PROGRESS_EVERY_S and self._pace() is not None)
                or self.last["step"] == self.total):
            self.progress(now)
        self.tend_views(close=False)

    def tend_views(self, close: bool) -> None:
        # TensorBoard and MLflow are views: a failure there is said once, and training goes on.
        for view in list(self.views):
            try:
                view.close() if close else view.poll()
            except Exception as e:
                self.views.remove(view)
                self.say(f"{view.STOPPED}: {type(e).__name__}: {e}")

    def _pace(self) -> float | None:
        """Seconds a step in the current attempt, from where its pace is measured."""
        m = self.last
        if m and self.rate and m["time"] > self.rate[0] and m["step"] > self.rate[1]:
            return (m["time"] - self.rate[0]) / (m["step"] - self.rate[1])
        return None

    def progress(self, now: float) -> None:
        m, pace = self.last, self._pace()
        eta = ""
        if self.total and pace is not None:
            eta = f", ETA {_clock(pace * (self.total - m['step']))}"
        self.say(f"step {m['step']}/{self.total or '?'} epoch {m.get('epoch')} loss {m['loss']:.4f} "
                 f"{m.get('samples_per_s', 0):.0f} samples/s, elapsed {_clock(now - self.started)}{eta}")
        self.printed_at, self.printed_step = now, m["step"]

    def on_event(self, e: dict[str, Any]) -> None:
        kind = e["event"]
        if kind in events.FAILURES:
            self.failures.append(e)
            if e.get("classification") == failures.DETERMINISTIC:
                self.failure_block()
        elif kind == Kind.ATTEMPT_STARTED:
            self.failure_block()
            self.rate, self.attempt = None, e.get("attempt")
            planned = e.get("from_step") or 0
            self.say(f"attempt {e['attempt']}: {e['world_size']} worker(s), "
                     + (f"resuming from step {planned}" if planned else "starting"))
        elif kind == Kind.TRAINING_STARTED:
            self.total = e.get("total_steps")
        elif kind == Kind.BACKOFF:
            self.say(f"waiting {e['delay_s']:g}s before attempt {e['attempt']}: {e.get('reason')}")
        elif kind == Kind.CHECKPOINT_SKIPPED:
            self.say(f"checkpoint of step {e['step']} cannot be loaded on rank {e.get('rank')} "
                     f"({e.get('error')}); trying the one before")
        elif kind == Kind.RESIZED:
            self.say(f"resized: {e['old_size']} -> {e['new_size']} worker(s) at step {e['from_step']}")
        elif kind == Kind.RESUMED:
            who = f"rank {e['failed_rank']} failed" if e.get("failed_rank") is not None else "the driver was lost"
            self.say(f"recovered: {who} ({e.get('cause')}), resumed from step "
                     f"{e['from_step']}, recomputed {e['lost_steps']} step(s), {e['recovery_s']:.1f}s to this step")
        elif kind == Kind.LIVE_RECOVERED:
            self.failure_block()
            ranks = ", ".join(map(str, e["failed_ranks"])) or "?"
            back = f"rejoined {e['rejoin_s']:.1f}s after" if e.get("rejoin_s") is not None else "not rejoined by the end"
            self.say(f"recovered live: rank {ranks} replaced while the others trained {e['survivor_steps']} step(s) "
                     f"(stall {e['stall_s']:.1f}s, {back}); no worker restarted")
        elif kind == Kind.FINISHED:
            self.flush_progress()
            scores = {"loss": e.get("val_loss"), **(e.get("val_metrics") or {})}
            if e.get("val_accuracy") is not None:
                scores["accuracy"] = e["val_accuracy"]
            shown = ", ".join(f"{name} {value:.4f}" for name, value in scores.items() if value is not None)
            self.say(f"finished: step {e['final_step']}, loss {e['loss']:.4f}"
                     + (f", validation {shown}" if shown else "")
                     + f", {_clock(time.time() - self.started)} in all")
        elif kind == Kind.FAILED:
            self.failure_block()
            self.say(f"failed: {e.get('error')}")

    def _current(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The rows of the newest attempt. A poll reads the events first: the last steps of
        a failed attempt can come after the next attempt_started, and are old news then
        (printed after "attempt 2 ...", and no base for the new attempt's pace)."""
        if self.attempt is None:
            return rows
        return [r for r in rows if r.get("attempt", self.attempt) >= self.attempt]

    def flush_progress(self) -> None:
        for row in self._current(self.metrics.read()):
            self.last = row
        if self.last and self.last["step"] != self.printed_step:
            self.progress(time.time())

    def failure_block(self) -> None:
        """One block for what failed first-hand; its peers' echoes are left out."""
        if not self.failures:
            return
        first, self.failures = failures.culprit(self.failures), []
        if first["event"] == Kind.FAULT_INJECTED:
            self.say(f"fault injected: {first['kind']} on rank {first['rank']} at step {first['step']} "
                     f"({first.get('phase', 'step')})")
            return
        where = f"rank {first.get('rank')}" if first.get("rank") is not None else "the driver"
        at = f" at step {first['step']}" if first.get("step") else ""
        cause = first.get("error") or "unknown"
        self.say(f"{where} failed{at}: {cause.splitlines()[0][:300]} ({first.get('classification', 'infrastructure')})")
        tb = [line for line in (first.get("traceback") or "").splitlines() if line.strip()]
        for line in tb[-TRACEBACK_LINES:]:
            self.out.write(f"    {line.strip()[:200]}\n")
        self.out.flush()

    def start(self) -> Reporter:
        def loop():
            while not self.stop_event.wait(0.5):
                self.poll()

        self.thread = threading.Thread(target=loop, name="etrain-reporter", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread:
            self.thread.join()
        self.poll()
        self.failure_block()
        self.tend_views(close=True)


class QuietRay:
    """sys.stdout minus the notices Ray's driver prints with no switch to turn them off:
    its error-listener thread writes every worker death (already in our failure block)
    straight to sys.stdout as a "(raylet) ..." line, whatever log_to_driver says."""

    def __init__(self, stream: TextIO):
        self.stream, self.dropped = stream, False

    def write(self, text: str) -> int:
        plain = text.replace("\x1b[33m", "").replace("\x1b[0m", "").lstrip()
        # print() writes the line and its end separately: drop the end of a dropped line too.
        drop = plain.startswith("(raylet)") or (self.dropped and text == "\n")
        self.dropped = drop and text != "\n"
        return len(text) if drop else self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)
