"""The run record's append-only streams (events, metrics) on an object store, which has
no append: each process writes its own segment objects, and readers merge them.

Layout, under the run directory (s3://bucket/prefix/<job_id>/):

    events/<sort key>-<writer>-<seq>.jsonl    every process that emits (driver, each rank)
    metrics/<sort key>-<writer>-<seq>.jsonl   rank 0 of the live attempt

- <writer> is unique per process (start time in ms, host, pid), so no two processes
  ever write one object; <seq> counts a writer's segments.
- <sort key> orders segments for readers: for events the time (ms) of the segment's
  first record (`t0001764900000000`); for metrics its first (attempt, step)
  (`a00002-s000000120`), the order metrics.jsonl keeps locally, so a reader after step N
  opens only the segments that can hold later steps.
- A writer keeps its open segment in memory and PUTs it whole: at once for a record that
  matters (every event is one: recovery decisions read them back), and otherwise every
  FLUSH_S seconds from a background thread and when the process ends its work (flush()).
  A PUT is atomic, so a reader sees a segment as it was at some flush, never torn. A
  segment is closed at ROLL_BYTES and the next one begun, so a flush rewrites at most
  that much. What a killed process had not flushed is lost: up to FLUSH_S seconds of
  metrics (those steps are recomputed after the restart anyway), never an event.
- Readers list the stream's objects (one LIST), fetch the segments they have not seen or
  that grew since (SegmentCache keeps the rest), and merge: events by time, metrics in
  key order.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from typing import Any

from workers import storage

FLUSH_S = 2.0
ROLL_BYTES = 1 << 20


def _writer_id() -> str:
    host = "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:40]
    return f"{int(time.time() * 1000):013d}_{host}_{os.getpid()}"


def events_key(record: dict[str, Any]) -> str:
    return f"t{int(record.get('time', 0) * 1000):016d}"


def metrics_key(record: dict[str, Any]) -> str:
    return f"a{int(record.get('attempt', 0)):05d}-s{int(record.get('step', 0)):09d}"


class SegmentWriter:
    """One process's segments of one stream."""

    def __init__(self, directory: str, sort_key):
        self.directory, self.sort_key = directory, sort_key
        self.writer, self.seq = _writer_id(), 0
        self.name: str | None = None
        self.buffer = bytearray()
        self.dirty = False
        self.lock = threading.Lock()

    def add(self, record: dict[str, Any], *, flush: bool) -> None:
        line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
        with self.lock:
            if self.name is None:
                self.name = f"{self.sort_key(record)}-{self.writer}-{self.seq:05d}.jsonl"
            self.buffer += line
            self.dirty = True
            if flush or len(self.buffer) >= ROLL_BYTES:
                self._flush()
            if len(self.buffer) >= ROLL_BYTES:
                self.name, self.buffer, self.seq = None, bytearray(), self.seq + 1

    def flush(self) -> None:
        with self.lock:
            self._flush()

    def _flush(self) -> None:
        if self.dirty and self.name is not None:
            storage.write_bytes(storage.join(self.directory, self.name), bytes(self.buffer))
            self.dirty = False


_writers: dict[tuple[str, str], SegmentWriter] = {}
_writers_lock = threading.Lock()
_flusher: threading.Thread | None = None


def writer(run_dir: str, stream: str, sort_key) -> SegmentWriter:
    """This process's writer of `stream` in `run_dir` (one per process and stream)."""
    with _writers_lock:
        key = (run_dir, stream)
        if key not in _writers:
            _writers[key] = SegmentWriter(storage.join(run_dir, stream), sort_key)
        _start_flusher()
        return _writers[key]


def flush_run(run_dir: str) -> None:
    """Write this process's open segments of one run now (before an event: a reader that
    sees the event sees the metrics lines that came before it)."""
    with _writers_lock:
        writers = [w for (rd, _), w in _writers.items() if rd == run_dir]
    for w in writers:
        w.flush()


def _start_flusher() -> None:
    """Called holding _writers_lock."""
    global _flusher
    if _flusher is None:
        _flusher = threading.Thread(target=_flush_periodically, name="etrain-record-flush", daemon=True)
        _flusher.start()
        atexit.register(_flush_at_exit)


class Mirror:
    """A local file copied whole to `uri` whenever it grew: the driver's output, which `tee`
    (a process of its own, so it outlives the driver's last lines) appends to a local
    spool, as the object store cannot be appended to."""

    def __init__(self, path: str, uri: str):
        self.path, self.uri, self.copied = path, uri, -1
        self.lock = threading.Lock()

    def flush(self) -> None:
        with self.lock:
            try:
                size = os.path.getsize(self.path)
            except FileNotFoundError:
                return
            if size != self.copied:
                with open(self.path, "rb") as f:
                    data = f.read()
                storage.write_bytes(self.uri, data)
                self.copied = len(data)


def mirror(path: str, uri: str) -> Mirror:
    """Copy the local file `path` to `uri` with every flush."""
    m = Mirror(path, uri)
    with _writers_lock:
        _mirrors.append(m)
        _start_flusher()
    return m


_mirrors: list[Mirror] = []


def _flush_periodically() -> None:
    while True:
        time.sleep(FLUSH_S)
        try:
            flush()
        except Exception:  # a storage blip: the next round writes the same segment again
            pass


def _flush_at_exit() -> None:
    try:
        flush()
    except Exception as e:  # the store is gone: say so in one line, not a traceback at exit
        print(f"[train] the run record's last records could not be written: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)


def flush() -> None:
    """Write every open segment of this process now (a process must call this before it
    exits with os._exit, or ends its part of a job)."""
    with _writers_lock:
        writers = list(_writers.values()) + list(_mirrors)
    for w in writers:
        w.flush()


def _parse(data: bytes) -> list[dict[str, Any]]:
    out = []
    for raw in data.splitlines():
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


class SegmentCache:
    """The segments of one stream read so far: a segment is fetched again only when its
    size changed (its writer flushed more), closed ones never."""

    def __init__(self, directory: str):
        self.directory = directory
        self.seen: dict[str, tuple[int, list[dict[str, Any]]]] = {}

    def records(self) -> dict[str, list[dict[str, Any]]]:
        """Each segment's records (in name order), from one LIST, fetching only what changed."""
        sizes = storage.sizes(self.directory)
        out = {}
        for name in sorted(sizes):
            cached = self.seen.get(name)
            if cached is None or cached[0] != sizes[name]:
                data = storage.read_bytes(storage.join(self.directory, name))
                cached = (len(data), _parse(data))
                self.seen[name] = cached
            out[name] = cached[1]
        for gone in set(self.seen) - set(sizes):
            del self.seen[gone]
        return out


def read_events(directory: str, cache: SegmentCache | None = None) -> list[dict[str, Any]]:
    """Every event, merged across writers by time (stable: one writer's order is kept)."""
    cache = cache or SegmentCache(directory)
    merged = [r for records in cache.records().values() for r in records]
    merged.sort(key=lambda r: r.get("time", 0))
    return merged


def _key_of(name: str) -> tuple[int, int] | None:
    try:
        attempt, step = name.split("-", 2)[:2]
        return int(attempt[1:]), int(step[1:])
    except (ValueError, IndexError):
        return None


def metrics_segments(directory: str) -> list[tuple[str, tuple[int, int]]]:
    """(name, first (attempt, step)) of each metrics segment, in (attempt, step) order."""
    keyed = [(name, _key_of(name)) for name in storage.sizes(directory)]
    return sorted(((n, k) for n, k in keyed if k is not None), key=lambda nk: (nk[1], nk[0]))


# The last step of each metrics segment that no longer changes (read once per process):
# lets a reader skip an attempt's last segment without fetching it again.
_final_last_step: dict[str, int] = {}


def _writer_of(name: str) -> str:
    return name.rsplit("-", 1)[0].split("-", 2)[2]


def metrics_after(directory: str, since_step: int, limit: int) -> list[dict[str, Any]]:
    """Every attempt's lines with step > since_step, in (attempt, step) order, at most
    `limit`. A segment is opened only if it can hold such a step: not when the next
    segment of its attempt starts at or before since_step + 1, nor when it is final (its
    writer began another, or a later attempt began) and known to end at or before it."""
    listed = metrics_segments(directory)
    newest_attempt = listed[-1][1][0] if listed else 0
    out: list[dict[str, Any]] = []
    for i, (name, (attempt, _)) in enumerate(listed):
        following = listed[i + 1][1] if i + 1 < len(listed) else None
        if following is not None and following[0] == attempt and following[1] <= since_step + 1:
            continue
        uri = storage.join(directory, name)
        if _final_last_step.get(uri, since_step + 1) <= since_step:
            continue
        records = _parse(storage.read_bytes(uri))
        final = attempt < newest_attempt or any(_writer_of(n) == _writer_of(name) for n, _ in listed[i + 1:])
        if final and records:
            _final_last_step[uri] = max(r.get("step", 0) for r in records)
        for record in records:
            if record.get("step", 0) > since_step:
                out.append(record)
                if len(out) == limit:
                    return out
    return out


def metrics_reached(directory: str) -> dict[int, int]:
    """{attempt: its last step}: only each attempt's last segment is opened."""
    last: dict[int, str] = {}
    for name, (attempt, _) in metrics_segments(directory):
        last[attempt] = name
    out = {}
    for attempt, name in last.items():
        records = _parse(storage.read_bytes(storage.join(directory, name)))
        if records:
            out[attempt] = max(r.get("step", 0) for r in records)
    return out


def metrics_tail(directory: str, limit: int) -> list[dict[str, Any]]:
    """The last `limit` lines, newest first, reading segments from the newest back."""
    out: list[dict[str, Any]] = []
    for name, _ in reversed(metrics_segments(directory)):
        out.extend(reversed(_parse(storage.read_bytes(storage.join(directory, name)))))
        if len(out) >= limit:
            break
    return out[:limit]
