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
DRIVER_LOGS = "logs"  # each driver's whole output, one file per driver (workers.run.tee_output)


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


class Tail:
    """New whole JSON lines of a file since the last call (a torn last line waits)."""

    def __init__(self, path: str):
        self.path, self.offset = path, 0

    def skip_to_end(self) -> None:
        """Start after what the file holds now (its last line, if torn, is skipped too)."""
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - 65536))  # a record is far shorter than this
                tail = f.read()
        except FileNotFoundError:
            return
        self.offset = size - len(tail) + tail.rfind(b"\n") + 1

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for raw in data[:end].splitlines():
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue
        return out


def events_from(run_dir: str, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The events written after byte `offset` (a previous answer's end), and where the next
    read starts: the end of the last whole line (a line still being written waits)."""
    tail = Tail(os.path.join(run_dir, EVENTS))
    try:
        size = os.path.getsize(tail.path)
    except FileNotFoundError:
        return [], 0
    tail.offset = min(offset, size)
    return tail.read(), tail.offset


class Histories:
    """Each run directory's events, parsed once: events.jsonl only grows (O_APPEND), so a
    reader that keeps what it parsed needs only what was appended since. The reconciler
    reads every active job's history each tick; a long job's would be parsed whole each time.
    A file that shrank or was replaced (a deleted job's id used again) is read afresh."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, Tail, list[dict[str, Any]]]] = {}

    def of(self, run_dir: str) -> list[dict[str, Any]]:
        path = os.path.join(run_dir, EVENTS)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._seen.pop(path, None)
            return []
        kept = self._seen.get(path)
        if kept is None or kept[0] != st.st_ino or st.st_size < kept[1].offset:
            kept = self._seen[path] = (st.st_ino, Tail(path), [])
        kept[2].extend(kept[1].read())
        return kept[2]

    def keep_only(self, run_dirs: set[str]) -> None:
        """Forget the run directories not named (jobs no longer active)."""
        keep = {os.path.join(rd, EVENTS) for rd in run_dirs}
        for path in set(self._seen) - keep:
            del self._seen[path]


def driver_logs(rd: str) -> list[str]:
    """The run record's driver output files, oldest first (their names start with the UTC
    time the driver started)."""
    folder = os.path.join(rd, DRIVER_LOGS)
    try:
        return [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.endswith(".log")]
    except FileNotFoundError:
        return []
