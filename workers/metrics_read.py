"""Reading metrics.jsonl from where the answer starts, not from its first line.

A job's metrics grow one line a step (300,000 lines is a long run, not a big one), and
the API, the web page and a resuming rank 0 each want a small part of them: the newest
line, or the lines after a step. Parsing the whole file for that took seconds.

What makes a seek possible: only rank 0 of the one live attempt writes metrics, attempts
are numbered in the order they start (recovery.begin), and an attempt's steps increase.
So the lines are sorted by (attempt, step), and a binary search over byte offsets finds
the first line past any key. Steps do repeat across attempts (a resumed attempt redoes
the steps after its checkpoint); a read "after step N" therefore looks in every attempt
that still holds such steps, one search each, which is a handful of reads for any file.

Nothing in the ecosystem does this: pandas and pyarrow read JSON lines from the start.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any

from workers import events, segments, storage

Key = tuple[int, int]  # (attempt, step)
_PROBE = 512  # a metrics line is a few hundred bytes; a probe reads about one
_TAIL = 65536


def _key(record: dict[str, Any]) -> Key | None:
    # A line without an attempt (written by hand, or by a tool of the user's) counts as
    # attempt 0: such a file is sorted when its steps are.
    attempt, step = record.get("attempt", 0), record.get("step")
    if isinstance(attempt, int) and isinstance(step, int):
        return attempt, step
    return None


class MetricsFile:
    """One open metrics file, read by offset. `bytes_read` counts what it read, so a test
    and the bench can show that a read did not start at the top."""

    def __init__(self, f: IO[bytes]):
        self.f = f
        self.size = f.seek(0, os.SEEK_END)
        self.bytes_read = 0

    def _read(self, offset: int, n: int) -> bytes:
        self.f.seek(offset)
        data = self.f.read(n)
        self.bytes_read += len(data)
        return data

    def _newline_from(self, offset: int) -> int:
        """The offset just past the first newline at or after `offset`; -1 when none."""
        while True:
            block = self._read(offset, _PROBE)
            cut = block.find(b"\n")
            if cut >= 0:
                return offset + cut + 1
            if not block:
                return -1
            offset += len(block)

    def line_at(self, offset: int, end: int) -> tuple[int, int, dict[str, Any] | None]:
        """The first whole line that starts at or after `offset` and before `end`: (its
        start, its end, its record or None when torn); (end, end, None) when none does."""
        start = offset
        if start > 0 and self._read(start - 1, 1) != b"\n":
            start = self._newline_from(start)  # inside a line: the next one starts after it
        if start < 0 or start >= end:
            return end, end, None
        stop = self._newline_from(start)
        if stop < 0:
            return end, end, None  # a last line still being written
        self.f.seek(start)
        raw = self.f.read(stop - start)
        self.bytes_read += len(raw)
        try:
            record = json.loads(raw)
        except ValueError:
            record = None  # torn by a killed writer
        return start, stop, record if isinstance(record, dict) else None

    def key_at(self, offset: int, end: int) -> tuple[int, int, Key | None]:
        """The first line at or after `offset` (and before `end`) that has a key: its
        start, its end and its key; (end, end, None) when there is none."""
        while offset < end:
            start, stop, record = self.line_at(offset, end)
            if start >= end:
                break
            key = _key(record) if record is not None else None
            if key is not None:
                return start, stop, key
            offset = stop
        return end, end, None

    def first_at_least(self, target: Key, lo: int, hi: int) -> int:
        """The start of the first keyed line starting in [lo, hi) whose key >= target; hi
        when none. `lo` must be a line start. Bisection over bytes: a probe at any offset
        reads the line that starts next."""
        best = hi
        while lo < hi:
            mid = (lo + hi) // 2
            start, stop, key = self.key_at(mid, hi)
            if key is not None and key < target:
                lo = stop  # this line and every one before it are below target
            else:
                if key is not None:
                    best = start  # qualifies; an earlier one may too
                hi = mid  # nothing keyed in [mid, start) qualifies
        return best

    def key_before(self, pos: int, lo: int) -> Key | None:
        """The key of the last keyed line that ends at or before `pos` (a line start) and
        starts at or after `lo`."""
        end = pos
        while end > lo:
            start = max(lo, end - _TAIL)
            block = self._read(start, end - start)
            lines = block.split(b"\n")[:-1]  # what follows the last newline is not whole here
            if start > lo:
                lines = lines[1:]  # may begin mid-line; it is read with the block before
            for raw in reversed(lines):
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue
                key = _key(record) if isinstance(record, dict) else None
                if key is not None:
                    return key
            if start == lo:
                break
            end = start + block.find(b"\n") + 1
        return None

    def records(self, offset: int, end: int | None = None):
        """Whole lines from `offset` (a line start) on, as (start, record); torn ones skipped."""
        end = self.size if end is None else end
        self.f.seek(offset)
        pos = offset
        for raw in self.f:
            if pos >= end or not raw.endswith(b"\n"):
                return
            self.bytes_read += len(raw)
            start, pos = pos, pos + len(raw)
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield start, record


def after_step(f: MetricsFile, since_step: int, limit: int) -> list[dict[str, Any]]:
    """The lines whose step > since_step, in file order, at most `limit`."""
    out: list[dict[str, Any]] = []
    _, _, first = f.key_at(0, f.size)
    if first is None:
        return out
    attempt, pos = first[0], 0
    while len(out) < limit and pos < f.size:
        pos = f.first_at_least((attempt, since_step + 1), pos, f.size)
        if pos >= f.size:
            break
        for start, record in f.records(pos):
            key = _key(record)
            if key is None:
                continue
            if key[0] != attempt and key[1] <= since_step:
                attempt, pos = key[0], start  # a later attempt, redoing steps: search in it
                break
            attempt = key[0]
            out.append(record)
            if len(out) == limit:
                break
        else:
            break
    return out


def last_steps(f: MetricsFile) -> dict[int, int]:
    """Each attempt's last step: where it stopped. A search per attempt, not a scan."""
    out: dict[int, int] = {}
    pos, stop, key = f.key_at(0, f.size)
    while key is not None:
        attempt = key[0]
        end = f.first_at_least((attempt + 1, -1), pos, f.size)
        last = f.key_before(end, pos)
        if last is not None:
            out[attempt] = last[1]
        pos, stop, key = f.key_at(end, f.size)
    return out


def reached(run_dir: str) -> dict[int, int]:
    """last_steps of a run directory's metrics: {attempt: the last step it completed}."""
    if not storage.is_local(run_dir):
        return segments.metrics_reached(storage.join(run_dir, events.METRICS_DIR))
    try:
        with open(os.path.join(run_dir, events.METRICS), "rb") as raw:
            return last_steps(MetricsFile(raw))
    except FileNotFoundError:
        return {}


def metrics_after(path: str, since_step: int = 0, limit: int = 10_000) -> list[dict[str, Any]]:
    """metrics.jsonl's lines after `since_step` (every attempt's), read from where they start."""
    try:
        with open(path, "rb") as raw:
            return after_step(MetricsFile(raw), since_step, limit)
    except FileNotFoundError:
        return []


def tail(path: str, limit: int = 1, chunk: int = _TAIL) -> list[dict[str, Any]]:
    """The last `limit` whole JSON lines, read from the end of the file."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - chunk))
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    if size > chunk:
        lines = lines[1:]  # the first may be cut
    out = []
    for raw in reversed(lines):
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        out.append(record)
        if len(out) == limit:
            break
    return out[::-1]


def after(run_dir: str, since_step: int = 0, limit: int = 10_000) -> list[dict[str, Any]]:
    """A run directory's metrics lines after `since_step` (every attempt's), read from where
    they start (locally a seek into metrics.jsonl; on an object store the segments that can
    hold them)."""
    if not storage.is_local(run_dir):
        return segments.metrics_after(storage.join(run_dir, events.METRICS_DIR), since_step, limit)
    return metrics_after(os.path.join(run_dir, events.METRICS), since_step, limit)


def latest(run_dir: str) -> dict[str, Any] | None:
    """A run directory's newest metrics line (the newest attempt's newest step)."""
    if not storage.is_local(run_dir):
        rows = segments.metrics_tail(storage.join(run_dir, events.METRICS_DIR), 1)
        return rows[0] if rows else None
    rows = tail(os.path.join(run_dir, events.METRICS))
    return rows[0] if rows else None
