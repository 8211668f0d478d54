"""workers/metrics_read.py: metrics after a step, found by seeking, equal to a full scan."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from workers import events, metrics_read


def scan(path, since_step, limit):
    """What GET /metrics returned before: every line parsed, filtered, cut."""
    return [m for m in events.read(str(path)) if m.get("step", 0) > since_step][:limit]


def write_run(path, attempts, *, torn_at=(), partial_tail=False):
    """One metrics file, as rank 0 writes it: each attempt resumes from a step at or before
    where the previous one reached, and steps on."""
    with open(path, "wb") as f:
        n = 0
        for number, (start, stop) in enumerate(attempts, 1):
            for step in range(start + 1, stop + 1):
                line = json.dumps({"time": 1.0 + n, "step": step, "attempt": number, "loss": 1 / step}).encode()
                f.write(line[: len(line) // 2] + b"\n" if n in torn_at else line + b"\n")
                n += 1
        if partial_tail:
            f.write(b'{"time": 9.0, "step": 99999, "att')


runs = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 60)), min_size=1, max_size=5).map(
    lambda pairs: [(min(a, b), max(a, b)) for a, b in pairs])


@settings(max_examples=300, deadline=None)
@given(attempts=runs, since=st.integers(0, 70), limit=st.integers(1, 80), torn=st.sets(st.integers(0, 150)),
       partial=st.booleans())
def test_a_read_after_a_step_equals_the_full_scan(tmp_path_factory, attempts, since, limit, torn, partial):
    path = tmp_path_factory.mktemp("m") / events.METRICS
    write_run(path, attempts, torn_at=torn, partial_tail=partial)
    assert metrics_read.metrics_after(str(path), since, limit) == scan(path, since, limit)


@settings(max_examples=200, deadline=None)
@given(attempts=runs, torn=st.sets(st.integers(0, 150)), partial=st.booleans())
def test_each_attempts_last_step_equals_the_full_scan(tmp_path_factory, attempts, torn, partial):
    path = tmp_path_factory.mktemp("m") / events.METRICS
    write_run(path, attempts, torn_at=torn, partial_tail=partial)
    expected: dict[int, int] = {}
    for m in events.read(str(path)):
        expected[m["attempt"]] = max(expected.get(m["attempt"], 0), m["step"])
    assert metrics_read.reached(str(path.parent)) == expected


def test_lines_without_an_attempt_read_as_one_attempt(tmp_path):
    rd = tmp_path
    for step in range(1, 2001):
        events.log_metrics(str(rd), step=step, loss=1.0 / step)
    path = str(rd / events.METRICS)
    assert [m["step"] for m in metrics_read.metrics_after(path, 1990)] == list(range(1991, 2001))
    assert metrics_read.reached(str(rd)) == {0: 2000}


def test_the_read_starts_near_the_answer_not_at_the_top(tmp_path):
    # 300,000 lines in three attempts; the second redid steps after its checkpoint.
    path = tmp_path / events.METRICS
    write_run(path, [(0, 120_000), (100_000, 250_000), (240_000, 320_000)])
    size = path.stat().st_size
    with open(path, "rb") as raw:
        f = metrics_read.MetricsFile(raw)
        rows = metrics_read.after_step(f, 319_990, 100)
    assert [r["step"] for r in rows] == list(range(319_991, 320_001))
    # every attempt is searched, each in a few dozen probes of about a line
    assert f.bytes_read < 300_000 < size // 50, (f.bytes_read, size)

    with open(path, "rb") as raw:
        f = metrics_read.MetricsFile(raw)
        rows = metrics_read.after_step(f, 245_000, 10)
    assert [(r["attempt"], r["step"]) for r in rows] == [(2, s) for s in range(245_001, 245_011)]
    assert f.bytes_read < 300_000

    with open(path, "rb") as raw:
        f = metrics_read.MetricsFile(raw)
        assert metrics_read.last_steps(f) == {1: 120_000, 2: 250_000, 3: 320_000}
    assert f.bytes_read < 300_000


def test_an_absent_or_empty_file_has_no_metrics(tmp_path):
    assert metrics_read.metrics_after(str(tmp_path / "none.jsonl")) == []
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert metrics_read.metrics_after(str(tmp_path / "empty.jsonl")) == []
    assert metrics_read.tail(str(tmp_path / "none.jsonl")) == []


def test_tail_reads_the_last_whole_lines(tmp_path):
    path = tmp_path / events.METRICS
    write_run(path, [(0, 5000)], partial_tail=True)
    assert [r["step"] for r in metrics_read.tail(str(path), 3)] == [4998, 4999, 5000]
