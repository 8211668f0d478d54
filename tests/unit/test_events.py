"""workers/events.py: append-only JSON lines that survive a torn last line."""

from __future__ import annotations

import json

import pytest

from workers import events


def test_append_read_round_trip(tmp_path):
    path = str(tmp_path / "log.jsonl")
    records = [{"a": 1}, {"b": [1, 2, {"c": None}]}, {"text": "line\nbreak é"}]
    for r in records:
        events.append(path, r)
    events.append(path, {"d": 2}, durable=True)
    assert list(events.read(path)) == records + [{"d": 2}]
    # One record a line.
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 4


def test_non_json_values_are_written_as_strings(tmp_path):
    path = str(tmp_path / "log.jsonl")
    events.append(path, {"path": tmp_path})
    assert list(events.read(path)) == [{"path": str(tmp_path)}]


def test_reading_a_missing_file_gives_nothing(tmp_path):
    assert list(events.read(str(tmp_path / "absent.jsonl"))) == []
    assert events.events(str(tmp_path)) == []
    assert events.metrics(str(tmp_path)) == []


def test_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "events.jsonl"
    events.emit(str(tmp_path), "attempt_started", attempt=1)
    events.emit(str(tmp_path), "checkpoint_committed", step=10)
    with open(path, "ab") as f:
        f.write(b'{"event":"checkpoint_committed","st')  # a writer killed mid-line
    got = events.events(str(tmp_path))
    assert [e["event"] for e in got] == ["attempt_started", "checkpoint_committed"]
    assert got[1]["step"] == 10


def test_a_record_after_a_torn_line_survives(tmp_path):
    events.emit(str(tmp_path), "attempt_started", attempt=1)
    with open(tmp_path / "events.jsonl", "ab") as f:
        f.write(b'{"event":"worker_fa')  # a writer killed mid-line
    events.emit(str(tmp_path), "fault_injected", fault=[5, 0, "crash", "step"])
    assert [e["event"] for e in events.events(str(tmp_path))] == ["attempt_started", "fault_injected"]


def test_emit_and_filter_by_kind(tmp_path):
    first = events.emit(str(tmp_path), "attempt_started", attempt=1)
    events.emit(str(tmp_path), "checkpoint_committed", step=10, durable=False)
    events.emit(str(tmp_path), "attempt_started", attempt=2)
    assert first["event"] == "attempt_started" and first["attempt"] == 1 and isinstance(first["time"], float)
    assert [e["attempt"] for e in events.events(str(tmp_path), "attempt_started")] == [1, 2]
    assert [e["step"] for e in events.events(str(tmp_path), "checkpoint_committed")] == [10]
    assert len(events.events(str(tmp_path))) == 3
    lines = (tmp_path / events.EVENTS).read_text().splitlines()
    assert json.loads(lines[0])["event"] == "attempt_started"


def test_metrics_round_trip(tmp_path):
    for step in (1, 2, 3):
        events.log_metrics(str(tmp_path), step=step, loss=1.0 / step)
    got = events.metrics(str(tmp_path))
    assert [m["step"] for m in got] == [1, 2, 3]
    assert got[2]["loss"] == pytest.approx(1 / 3)
    assert all("time" in m for m in got)
    assert events.events(str(tmp_path)) == []  # metrics go to their own file


def test_histories_parse_only_what_was_appended_and_match_a_full_read(tmp_path):
    rd = str(tmp_path / "run")
    histories = events.Histories()
    assert histories.of(rd) == []
    (tmp_path / "run").mkdir()
    for i in range(3):
        events.emit(rd, "tick", i=i)
    first = histories.of(rd)
    assert [e["i"] for e in first] == [0, 1, 2]
    # a writer killed mid-line, then more records: the same as a full read, torn line skipped
    with open(tmp_path / "run" / events.EVENTS, "ab") as f:
        f.write(b'{"event": "tick", "i"')
    assert [e["i"] for e in histories.of(rd)] == [0, 1, 2]
    events.emit(rd, "tick", i=3)
    assert histories.of(rd) == events.events(rd) and [e["i"] for e in histories.of(rd)] == [0, 1, 2, 3]

    # the run directory replaced (a deleted job's id used again): read afresh
    (tmp_path / "run" / events.EVENTS).unlink()
    events.emit(rd, "tick", i=9)
    assert [e["i"] for e in histories.of(rd)] == [9]

    histories.keep_only(set())
    assert histories._seen == {}
