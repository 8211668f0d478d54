"""workers/events.py: append-only JSON lines that survive a torn last line."""

from __future__ import annotations

import json
import os
import re

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


# One example of every kind, with the fields its producer sets.
EXAMPLES = [
    events.JobStarted(pid=1, ray_address="127.0.0.1:6379"),
    events.WorkersChanged(old=2, new={"min": 1, "max": 3}),
    events.DriverLost(time=5.0, noticed_at=9.0, error="driver process lost", pid=1),
    events.AttemptStarted(attempt=2, world_size=2, from_step=10, checkpoint="checkpoints/step-000010"),
    events.Backoff(attempt=3, delay_s=2.0, reason="the previous attempts failed at the same step"),
    events.Resized(attempt=2, old_size=3, new_size=2, from_step=10),
    events.WorkerStarted(attempt=1, rank=0, pid=2, node_id="n"),
    events.TrainingStarted(attempt=1, world_size=2, total_steps=20, from_step=0, checkpoint=None),
    events.CheckpointCommitted(step=10, path="checkpoints/step-000010", save_s=0.1, blocked_s=0.01, background=True,
                               report_s=0.02),
    events.CheckpointSkipped(step=10, rank=1, error="RuntimeError: torn"),
    events.FaultInjected(fault=[3, 1, "crash", "step"], kind="crash", rank=1, step=3, phase="step", pid=7),
    events.WorkerFailed(rank=1, step=4, attempt=1, classification="infrastructure", error="hung", hung=True),
    events.Resumed(attempt=2, failed_rank=1, cause="crash", from_step=0, reached_step=3, lost_steps=3, recovery_s=4.2),
    events.LiveJoined(attempt=1, rank=1, group=1, pid=7, step=40, fetch_s=0.4),
    events.LiveRecovered(attempt=1, failed_ranks=[1], groups=[0, 1, 2], failed_after_step=40, rejoined_at_step=44,
                         stall_s=2.1, rejoin_s=5.3, survivor_steps=3, samples_skipped=63, survivors_restarted=False),
    events.WorkerFinished(rank=0, world_size=2, peak_rss_mb=300.5, comm_s=0.3),
    events.Finished(attempt=1, final_step=20, loss=0.5, val_metrics={}, weights_sha256="ab" * 32, world_size=2),
    events.Failed(error="boom", rank=0, classification="deterministic"),
]


def test_every_kind_has_a_model_and_an_example():
    assert set(events.MODELS) == set(events.Kind)
    assert {type(e).EVENT for e in EXAMPLES} == set(events.Kind)


@pytest.mark.parametrize("event", EXAMPLES, ids=lambda e: e.EVENT.value)
def test_a_typed_event_is_written_and_read_back_as_itself(tmp_path, event):
    written = events.emit(str(tmp_path), event)
    (read,) = events.events(str(tmp_path))
    assert read == written and read["event"] == event.EVENT
    assert events.parse(read) == event
    # Only what the producer set is written: a reader tells "not said" from "said None".
    assert set(read) == {"event", "time"} | event.model_fields_set - {"time"}


def test_a_producer_that_gets_a_field_wrong_is_told_at_once(tmp_path):
    with pytest.raises(ValueError, match="rank"):
        events.WorkerFailed(rank="first", classification="infrastructure", error="x")
    with pytest.raises(ValueError, match="extra"):
        events.JobStarted(pid=1, pidd=2)
    with pytest.raises(TypeError, match="in the model"):
        events.emit(str(tmp_path), events.JobStarted(pid=1), pid=2)
    assert events.events(str(tmp_path)) == []


def test_a_record_of_an_unknown_kind_or_shape_parses_to_none():
    assert events.parse({"event": "from_a_newer_version", "time": 1.0}) is None
    assert events.parse({"event": events.Kind.JOB_STARTED.value, "time": 1.0}) is None  # pid missing


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# "failed" and "finished" are also plain words: a run's status and a job's phase.
NOT_EVENT_NAMES = ('status = "succeeded" if finished and not error else "failed"', 'if status == "failed":',
                   'if summary["status"] == "failed"', '"starting", "training", "recovering", "finished", "failed"',
                   'culprit.get("error") or "failed"', '{**row, "status": "failed"}', '"failed": failed,')


def test_no_event_name_is_a_string_literal_outside_the_run_record_module():
    """Every producer and consumer names a kind through workers.events (the page through
    /kinds.js, made from it): grep finds the names nowhere else but in the tests."""
    names = "|".join(k.value for k in events.Kind)
    # Backticks quote in JS (template literals); in Python they mark names in prose.
    quoted = {".py": re.compile(r"""["'](%s)["']""" % names), ".js": re.compile(r"""["'`](%s)["'`]""" % names)}
    quoted[".html"] = quoted[".js"]
    found = []
    for top in ("workers", "service", "api", "bench"):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d not in ("vendor", "__pycache__")]
            for name in files:
                path = os.path.join(folder, name)
                if not name.endswith((".py", ".js", ".html")) or path == events.__file__:
                    continue
                with open(path, encoding="utf-8") as f:
                    for n, line in enumerate(f, 1):
                        if quoted[os.path.splitext(name)[1]].search(line) and not any(ok in line for ok in NOT_EVENT_NAMES):
                            found.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_a_typed_metrics_line_is_written_as_rank_0_wrote_it_before(tmp_path):
    line = events.MetricsLine(step=3, epoch=0, loss=0.25, lr=0.1, samples_per_s=100.0, step_s=0.01, attempt=1,
                              val_loss=0.5, val_accuracy=0.9, val_metrics={"accuracy": 0.9})
    events.log_metrics(str(tmp_path), line)
    (read,) = events.metrics(str(tmp_path))
    assert read == line.record() and events.MetricsLine.model_validate(read) == line
    assert list(read)[:2] == ["time", "step"]
    with pytest.raises(ValueError, match="extra"):
        events.MetricsLine(step=1, epoch=0, loss=1.0, attempt=1, acc=0.5)
    with pytest.raises(TypeError, match="in the line"):
        events.log_metrics(str(tmp_path), line, step=4)
