"""The run record on an object store (a real S3-compatible server, moto's server mode):
events and metrics as segment objects per process (workers/segments.py), read back merged
and incrementally, and the training loop resuming exactly from such a run directory."""

from __future__ import annotations

import os
import time

import pytest

from workers import checkpoint, events, metrics_read, segments, storage
from workers.events import Kind
from workers.faults import InjectedFault
from workers.loop import WorkerEnv, train
from workers.spec import JobSpec, write_spec_json


@pytest.fixture
def run_dir(s3_bucket, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    yield f"{s3_bucket}/runs/job-1"
    assert os.listdir(tmp_path) == [], "nothing of an object-store run may be written to the local disk"


def fresh_writers(monkeypatch):
    """A new process's writers and readers (each process has its own segments)."""
    monkeypatch.setattr(segments, "_writers", {})
    monkeypatch.setattr(segments, "_final_last_step", {})


def test_events_of_several_processes_are_merged_by_time_each_in_its_own_segments(run_dir, monkeypatch):
    events.emit(run_dir, events.JobStarted(pid=1, time=100.0))
    fresh_writers(monkeypatch)  # another process
    events.emit(run_dir, events.AttemptStarted(attempt=1, world_size=2, from_step=0, time=101.0))
    events.emit(run_dir, events.WorkerStarted(rank=0, pid=2, attempt=1, time=103.0))
    fresh_writers(monkeypatch)
    events.emit(run_dir, events.WorkerStarted(rank=1, pid=3, attempt=1, time=102.0))

    names = storage.listdir(f"{run_dir}/events")
    assert len(names) == 3 and all(n.endswith(".jsonl") for n in names)
    assert [e["event"] for e in events.events(run_dir)] == [Kind.JOB_STARTED, Kind.ATTEMPT_STARTED,
                                                           Kind.WORKER_STARTED, Kind.WORKER_STARTED]
    assert [e["pid"] for e in events.events(run_dir, Kind.WORKER_STARTED)] == [3, 2]


def test_a_tail_returns_each_record_once_as_segments_grow(run_dir):
    tail = events.tail(run_dir, events.EVENTS)
    assert tail.read() == []
    events.emit(run_dir, events.JobStarted(pid=1))
    assert [e["pid"] for e in tail.read()] == [1]
    events.emit(run_dir, events.JobStarted(pid=2))  # the same segment, rewritten longer
    assert [e["pid"] for e in tail.read()] == [2]
    assert tail.read() == []
    later = events.tail(run_dir, events.EVENTS)
    later.skip_to_end()
    events.emit(run_dir, events.JobStarted(pid=3))
    assert [e["pid"] for e in later.read()] == [3]


def test_events_by_offset_hold_only_settled_events(run_dir, monkeypatch):
    monkeypatch.setattr(events, "SETTLE_S", 0.5)
    events.emit(run_dir, events.JobStarted(pid=1))
    assert events.events_from(run_dir, 0) == ([], 0)  # too new to be in its final place
    time.sleep(0.6)
    rows, offset = events.events_from(run_dir, 0)
    assert [e["pid"] for e in rows] == [1] and offset == 1
    events.emit(run_dir, events.JobStarted(pid=2))
    time.sleep(0.6)
    rows, offset = events.events_from(run_dir, offset)
    assert [e["pid"] for e in rows] == [2] and offset == 2


def test_metrics_are_buffered_and_flushed_and_a_read_after_a_step_opens_only_the_segments_that_can_hold_it(
        run_dir, monkeypatch):
    monkeypatch.setattr(segments, "ROLL_BYTES", 2000)  # small segments: about 20 lines each
    for attempt, steps in ((1, range(1, 101)), (2, range(91, 201))):
        fresh_writers(monkeypatch)
        for step in steps:
            events.log_metrics(run_dir, events.MetricsLine(step=step, epoch=0, loss=1.0 / step, attempt=attempt))
        segments.flush()
    names = segments.metrics_segments(f"{run_dir}/metrics")
    assert len(names) > 8

    assert [m["step"] for m in events.metrics(run_dir)] == list(range(1, 101)) + list(range(91, 201))
    assert metrics_read.reached(run_dir) == {1: 100, 2: 200}
    assert metrics_read.latest(run_dir)["step"] == 200

    fetched = []
    real = storage.read_bytes
    monkeypatch.setattr(storage, "read_bytes", lambda uri: fetched.append(uri) or real(uri))
    rows = metrics_read.after(run_dir, since_step=190, limit=100)
    assert [(m["attempt"], m["step"]) for m in rows] == [(2, s) for s in range(191, 201)]
    # One segment holds steps 191-200; attempt 1's last one is opened at most once per
    # process to learn where it ends (here the reads above already did).
    assert len(fetched) <= 2, fetched
    fetched.clear()
    assert len(metrics_read.after(run_dir, since_step=190, limit=100)) == 10
    assert len(fetched) == 1, f"one segment holds steps 191-200; opened {fetched}"
    fetched.clear()
    rows = metrics_read.after(run_dir, since_step=95, limit=100)
    assert [m["step"] for m in rows] == list(range(96, 101)) + list(range(96, 191))
    assert len(fetched) < len(names)


def test_metrics_not_yet_flushed_are_written_by_the_background_flush(run_dir, monkeypatch):
    monkeypatch.setattr(segments, "FLUSH_S", 0.2)
    monkeypatch.setattr(segments, "_flusher", None)
    fresh_writers(monkeypatch)
    events.log_metrics(run_dir, events.MetricsLine(step=1, epoch=0, loss=1.0, attempt=1))
    deadline = time.monotonic() + 10
    while not events.metrics(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [m["step"] for m in events.metrics(run_dir)] == [1]


def job(storage_root, job_id, **overrides) -> JobSpec:
    spec = JobSpec.model_validate({
        "job_id": job_id, "model": "simple_cnn", "dataset": {"name": "synthetic", "size": 384, "noise": 2.0},
        "workers": 1, "training": {"max_steps": 30, "global_batch_size": 32, "seed": 7},
        "checkpoint": {"every_steps": 10, "keep": 2}, "storage": storage_root, **overrides})
    write_spec_json(spec)
    return spec


def test_a_run_on_the_object_store_resumes_exactly_and_keeps_nothing_locally(s3_bucket, tmp_path, monkeypatch):
    twin = train(job(str(tmp_path / "local"), "twin"), WorkerEnv(0, 1, 0))["weights_sha256"]
    monkeypatch.chdir(tmp_path / "local")  # nothing may land here, or anywhere else local
    before = set(os.listdir(tmp_path / "local"))

    spec = job(f"{s3_bucket}/runs", "on-s3", faults=[{"at_step": 17, "rank": 0, "kind": "exception"}])
    assert spec.run_dir == f"{s3_bucket}/runs/on-s3"
    with pytest.raises(InjectedFault):
        train(spec, WorkerEnv(0, 1, 0))
    assert checkpoint.latest(spec.run_dir)[0] == 10
    assert max(m["step"] for m in events.metrics(spec.run_dir)) == 16  # flushed as the attempt failed
    fresh_writers(monkeypatch)  # the next attempt is another process
    resumed = train(spec, WorkerEnv(0, 1, 0))
    assert resumed["weights_sha256"] == twin

    (r,) = events.events(spec.run_dir, Kind.RESUMED)
    assert r["from_step"] == 10 and r["reached_step"] == 16 and r["lost_steps"] == 6
    assert storage.exists(f"{spec.run_dir}/final/model.pt")
    assert checkpoint.committed_steps(spec.run_dir) == [30, 20]
    assert set(os.listdir(tmp_path / "local")) == before
