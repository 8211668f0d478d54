"""What the service reads from a job's run directory (the workers write it)."""

from __future__ import annotations

import json
import os
from typing import Any

from workers import checkpoint, events

_FAILURES = ("worker_failed", "fault_injected", "driver_lost")


def run_dir(runs_root: str, job_id: str) -> str:
    return os.path.join(runs_root, job_id)


def tail_records(path: str, limit: int = 1, chunk: int = 65536) -> list[dict[str, Any]]:
    """The last `limit` whole JSON lines, read from the end of the file: metrics grow
    one line a step, and status requests must not read them all."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chunk))
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    if size > chunk:
        lines = lines[1:]  # the first may be cut
    out = []
    for raw in reversed(lines):
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue
        if len(out) == limit:
            break
    return out[::-1]


def latest_metrics(rd: str) -> dict[str, Any] | None:
    rows = tail_records(os.path.join(rd, events.METRICS))
    return rows[0] if rows else None


def metrics_since(rd: str, since_step: int = 0, limit: int = 10_000) -> list[dict[str, Any]]:
    rows = [m for m in events.metrics(rd) if m.get("step", 0) > since_step]
    return rows[:limit]


def current_run(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events since the last driver started (a resubmission starts a new driver)."""
    starts = [i for i, e in enumerate(history) if e["event"] == "job_started"]
    return history[starts[-1]:] if starts else history


def phase(rd: str, history: list[dict[str, Any]] | None = None) -> str:
    """starting | running | recovering | finished | failed, from the events alone."""
    history = events.events(rd) if history is None else history
    run = current_run(history)
    kinds = {e["event"] for e in run}
    if "finished" in kinds:
        return "finished"
    if "failed" in kinds:
        return "failed"
    last_failure = max((e["time"] for e in history if e["event"] in _FAILURES), default=None)
    last_resumed = max((e["time"] for e in history if e["event"] == "resumed"), default=None)
    if last_failure is not None and (last_resumed is None or last_failure > last_resumed):
        return "recovering"
    return "running" if "attempt_started" in kinds else "starting"


def summary(rd: str) -> dict[str, Any]:
    """Progress, recovery counts, the newest checkpoint and the error, for a job's status."""
    history = events.events(rd)
    attempts = [e for e in history if e["event"] == "attempt_started"]
    resumed = [e for e in history if e["event"] == "resumed"]
    finished = next((e for e in reversed(history) if e["event"] == "finished"), None)
    latest = latest_metrics(rd)
    committed = [e for e in history if e["event"] == "checkpoint_committed"]
    out: dict[str, Any] = {
        "phase": phase(rd, history),
        "attempts": len(attempts),
        "restarts": max(0, len(attempts) - 1),
        "steps_recomputed": sum(r.get("lost_steps", 0) for r in resumed),
        "recovery_s": [r.get("recovery_s") for r in resumed],
        "last_resumed_at": resumed[-1]["time"] if resumed else None,
        "progress": {
            "step": (finished or {}).get("final_step") or (latest or {}).get("step", 0),
            "total_steps": attempts[-1].get("total_steps") if attempts else None,
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
    failed = next((e for e in reversed(current_run(history)) if e["event"] == "failed"), None)
    if failed is None:
        return None
    tb = next((e.get("traceback") for e in reversed(history) if e["event"] == "worker_failed" and e.get("traceback")), "")
    return {"message": failed.get("error", ""), "traceback": tb[-2000:]}


def checkpoints(rd: str) -> list[dict[str, Any]]:
    out = []
    for step in checkpoint.committed_steps(rd):
        path = os.path.join(checkpoint.root(rd), checkpoint.step_name(step))
        manifest = checkpoint.read_manifest(path, verify=False)
        if manifest is None:
            continue
        out.append({"step": step, "path": os.path.relpath(path, rd), "committed_at": manifest.get("committed_at"),
                    "bytes": sum(f["bytes"] for f in manifest["files"].values()),
                    "loss": manifest.get("loss"), "epoch": manifest.get("epoch")})
    return out


def worker_pid(rd: str, rank: int) -> dict[str, Any] | None:
    """Where rank `rank` of the newest attempt runs (pid, node id)."""
    started = events.events(rd, "worker_started")
    if not started:
        return None
    attempt = max(e["attempt"] for e in started)
    return next((e for e in reversed(started) if e["attempt"] == attempt and e["rank"] == rank), None)
