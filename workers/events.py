"""Append-only events.jsonl and metrics.jsonl in the run directory.

Several processes (workers of one attempt, the Ray Train controller) append to the
same file. Each record is one `write()` on an O_APPEND descriptor, which POSIX keeps
whole for a local file; readers skip a torn last line rather than fail.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator

EVENTS = "events.jsonl"
METRICS = "metrics.jsonl"


def append(path: str, record: dict[str, Any], *, durable: bool = False) -> None:
    line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # a writer was killed mid-line: do not glue this record to it
        os.write(fd, line)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def read(path: str) -> Iterator[dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    yield json.loads(raw)
                except ValueError:
                    continue  # a line torn by a killed writer
    except FileNotFoundError:
        return


def emit(run_dir: str, event: str, *, durable: bool = True, **fields: Any) -> dict[str, Any]:
    """Write one event; durable by default since recovery decisions read them back."""
    record = {"event": event, "time": time.time(), **fields}
    append(os.path.join(run_dir, EVENTS), record, durable=durable)
    return record


def events(run_dir: str, kind: str | None = None) -> list[dict[str, Any]]:
    return [e for e in read(os.path.join(run_dir, EVENTS)) if kind is None or e.get("event") == kind]


def log_metrics(run_dir: str, **fields: Any) -> None:
    append(os.path.join(run_dir, METRICS), {"time": time.time(), **fields})


def metrics(run_dir: str) -> list[dict[str, Any]]:
    return list(read(os.path.join(run_dir, METRICS)))
