"""What the service reads from a job's run directory (the workers write it)."""

from __future__ import annotations

import os
import re
from typing import Any

from workers import checkpoint, events, failures, metrics_read, storage
from workers.events import Kind


def run_dir(runs_root: str, job_id: str) -> str:
    return storage.join(runs_root, job_id)


def metrics_since(rd: str, since_step: int = 0, limit: int = 10_000) -> list[dict[str, Any]]:
    """Every attempt's metrics lines after `since_step`, read from where they start."""
    return metrics_read.after(rd, since_step, limit)


def current_run(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events since the last driver started (a resubmission starts a new driver)."""
    starts = [i for i, e in enumerate(history) if e["event"] == Kind.JOB_STARTED]
    return history[starts[-1]:] if starts else history


# What a job is doing, from its run record (JobPublic.progress.phase adds the ledger's view).
STARTING, TRAINING, RECOVERING, FINISHED, FAILED = "starting", "training", "recovering", "finished", "failed"
FINISHING = "finishing"  # the service's view: the workers are done; Ray has not ended the job yet


def last_step_at(history: list[dict[str, Any]], latest: dict[str, Any] | None) -> float | None:
    """When a worker last completed a step: the newest metrics line, or a `resumed`."""
    times = [e["time"] for e in history if e["event"] == Kind.RESUMED] + ([latest["time"]] if latest else [])
    return max(times, default=None)


def last_failure(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((e for e in reversed(history) if e["event"] in events.FAILURES), None)


def phase(history: list[dict[str, Any]], latest: dict[str, Any] | None) -> str:
    """starting: no worker of the newest attempt has completed a step (Ray starting the
    workers, loading data, building the model, loading a checkpoint); training; recovering:
    a worker or the driver failed after the newest step; finished / failed: the current
    driver's verdict."""
    run = current_run(history)
    kinds = {e["event"] for e in run}
    if Kind.FINISHED in kinds:
        return FINISHED
    if Kind.FAILED in kinds:
        return FAILED
    stepped = last_step_at(history, latest)
    failure = last_failure(history)
    # >=: a lost driver is dated by its last sign of life, which may be its last step.
    if failure is not None and (stepped is None or failure["time"] >= stepped):
        return RECOVERING
    attempts = [e for e in run if e["event"] == Kind.ATTEMPT_STARTED]
    if not attempts or stepped is None or stepped < attempts[-1]["time"]:
        return STARTING
    newest = attempts[-1].get("attempt")
    resumed_since = any(e["event"] == Kind.RESUMED and e["time"] >= attempts[-1]["time"] for e in run)
    if not resumed_since and latest and latest.get("attempt") not in (None, newest):
        return STARTING  # the newest line is an older attempt's
    return TRAINING


def recovery_note(history: list[dict[str, Any]], latest: dict[str, Any] | None) -> str:
    """What a recovering job is doing, for people: which failure, and any back-off."""
    stepped = last_step_at(history, latest) or 0.0
    culprit = failures.culprit([e for e in history if e["event"] in events.FAILURES and e["time"] >= stepped]) \
        or last_failure(history)
    if culprit is None:
        return "its workers are being restarted"
    if culprit["event"] == Kind.DRIVER_LOST:
        what = "the loss of its driver; the driver is being started again"
    else:
        why = "hung" if culprit.get("hung") else culprit.get("kind") or culprit.get("error") or "failed"
        what = f"a failure of rank {culprit.get('rank', '?')} ({_one_line(why)}); its workers are being restarted"
    backoff = next((e for e in reversed(history) if e["event"] == Kind.BACKOFF and e["time"] >= culprit["time"]), None)
    if backoff is not None:
        what += f", after a back-off of {backoff.get('delay_s', 0):g}s (repeated failures at one step)"
    return what


def _one_line(text: str, limit: int = 120) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def summary(rd: str, history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Progress, recovery counts, the newest checkpoint and the error, for a job's status.
    `history`: the run directory's events when the caller keeps them (events.Histories)."""
    history = events.events(rd) if history is None else history
    attempts = [e for e in history if e["event"] == Kind.ATTEMPT_STARTED]
    resumed = [e for e in history if e["event"] == Kind.RESUMED]
    finished = next((e for e in reversed(history) if e["event"] == Kind.FINISHED), None)
    latest = metrics_read.latest(rd)
    committed = [e for e in history if e["event"] == Kind.CHECKPOINT_COMMITTED]
    out: dict[str, Any] = {
        "phase": phase(history, latest),
        "last_step_at": last_step_at(history, latest),
        "attempts": len(attempts),
        "restarts": max(0, len(attempts) - 1),
        "steps_recomputed": sum(r.get("lost_steps", 0) for r in resumed),
        "recovery_s": [r.get("recovery_s") for r in resumed],
        "live_recoveries": [{k: e.get(k) for k in events.LIVE_RECOVERY_KEYS}
                            for e in history if e["event"] == Kind.LIVE_RECOVERED],
        "last_resumed_at": resumed[-1]["time"] if resumed else None,
        "progress": {
            "step": (finished or {}).get("final_step") or (latest or {}).get("step", 0),
            # training_started (once set-up is done) knows it; older run records had it in attempt_started.
            "total_steps": next((e["total_steps"] for e in reversed(history)
                                 if e["event"] in (Kind.TRAINING_STARTED, Kind.ATTEMPT_STARTED) and e.get("total_steps")),
                                None),
            "epoch": (latest or {}).get("epoch"),
        },
        "latest_metrics": latest,
        "latest_checkpoint": committed[-1] if committed else None,
        "result": finished,
    }
    failure = error(history)
    if failure:
        out["error"] = failure
    return out


def error(history: list[dict[str, Any]]) -> dict[str, str] | None:
    failed = next((e for e in reversed(current_run(history)) if e["event"] == Kind.FAILED), None)
    if failed is None:
        return None
    tb = next((e.get("traceback") for e in reversed(history) if e["event"] == Kind.WORKER_FAILED and e.get("traceback")), "")
    return {"message": failed.get("error", ""), "traceback": tb[-2000:]}


def checkpoints(rd: str) -> list[dict[str, Any]]:
    out = []
    for step in checkpoint.committed_steps(rd):
        path = checkpoint.path_of(rd, step)
        manifest = checkpoint.read_manifest(path, verify=False)
        if manifest is None:
            continue
        out.append({"step": step, "path": storage.relative(path, rd), "committed_at": manifest.committed_at,
                    "bytes": manifest.bytes, "loss": manifest.loss, "epoch": manifest.epoch})
    return out


def worker(history: list[dict[str, Any]], rank: int) -> dict[str, Any] | None:
    """Where rank `rank` of the newest attempt of the current driver runs (pid, node id).
    Never an older attempt's or driver's: that process has ended and its pid may be reused."""
    started = [e for e in current_run(history) if e["event"] == Kind.WORKER_STARTED]
    if not started:
        return None
    attempt = max(e.get("attempt", 0) for e in started)
    return next((e for e in reversed(started) if e.get("attempt", 0) == attempt and e["rank"] == rank), None)


def live_ranks(history: list[dict[str, Any]]) -> list[int]:
    started = [e for e in current_run(history) if e["event"] == Kind.WORKER_STARTED]
    attempt = max((e.get("attempt", 0) for e in started), default=None)
    return sorted({e["rank"] for e in started if e.get("attempt", 0) == attempt})


def _header(i: int, n: int, path: str) -> str:
    return f"===== driver {i} of {n} ({storage.name(path)}) =====\n"


def driver_output(rd: str, tail: int | None = None) -> str | None:
    """Every driver's output, oldest first, each under a header line; None when the run
    record holds none (a run from before drivers kept theirs). With `tail`, only the last
    `tail` lines of that, read from the ends of the newest files (a long job's output is
    large, and the web page asks for its last lines every few seconds)."""
    files = events.driver_logs(rd)
    if not files:
        return None
    if tail is not None:
        return _driver_output_tail(files, tail)
    parts = []
    for i, path in enumerate(files, 1):
        # As written (bytes, decoded whole): a progress bar's \r stays.
        parts.append(_header(i, len(files), path) + storage.read_bytes(path).decode(errors="replace"))
    return "".join(p if p.endswith("\n") else p + "\n" for p in parts)


_LOG_BLOCK = 65536


def split_lines(text: str) -> list[str]:
    """Lines with their newlines, split at newlines only (str.splitlines also splits at
    the carriage returns a progress bar writes)."""
    return re.findall(r"[^\n]*\n|[^\n]+$", text)


def _last_lines(path: str, n: int) -> tuple[list[str], bool]:
    """A file's last `n` lines, split at newlines only (a progress bar's carriage returns
    stay in its line; the last line gets a newline if it lacked one), and whether they
    are all the file holds."""
    if not storage.is_local(path):  # a copy replaced whole every few seconds: one GET, not ranged reads
        data, pos = storage.read_bytes(path), 0
    else:
        with open(path, "rb") as f:
            pos = f.seek(0, os.SEEK_END)
            data = b""
            while pos > 0 and data.count(b"\n") <= n:
                step = min(_LOG_BLOCK, pos)
                pos -= step
                f.seek(pos)
                data = f.read(step) + data
    parts = data.split(b"\n")
    raw = [p + b"\n" for p in parts[:-1]] + ([parts[-1] + b"\n"] if parts[-1] else [])
    whole = pos == 0 and len(raw) <= n
    # Decoded line by line: a block boundary inside a character only touches a line not kept.
    return [line.decode(errors="replace") for line in raw[-n:]] if n else [], whole


def _driver_output_tail(files: list[str], n: int) -> str:
    out: list[str] = []
    for i in range(len(files), 0, -1):
        if len(out) >= n:
            break
        lines, whole = _last_lines(files[i - 1], n - len(out))
        out[:0] = ([_header(i, len(files), files[i - 1])] if whole else []) + lines
    return "".join(out[-n:] if n else [])
