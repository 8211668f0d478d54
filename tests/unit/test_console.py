"""What workers.run prints, from the run directory: each fact once, failures short."""

from __future__ import annotations

import io

from workers import console, events


def _reporter(run_dir):
    out = io.StringIO()
    return console.Reporter(run_dir, out=out, started=0.0), out


def test_a_crash_and_its_recovery_print_as_a_few_lines(tmp_path, monkeypatch):
    run_dir = str(tmp_path)
    events.emit(run_dir, "job_started")  # an earlier driver's: not this reporter's to print
    reporter, out = _reporter(run_dir)
    events.emit(run_dir, "attempt_started", attempt=1, world_size=2, from_step=0)
    events.emit(run_dir, "training_started", attempt=1, total_steps=100, from_step=0)
    for step in range(1, 41):
        events.log_metrics(run_dir, step=step, epoch=0, loss=1.0 / step, samples_per_s=500.0, attempt=1)
    reporter.poll()
    events.emit(run_dir, "fault_injected", kind="crash", rank=1, step=41, phase="step")
    events.emit(run_dir, "worker_failed", rank=0, classification="infrastructure", step=41,
                error="[gloo/pair.cc:545] Connection reset by peer", traceback="Traceback\n  gloo\nRuntimeError: reset")
    events.emit(run_dir, "worker_failed", rank=1, classification="infrastructure", error="worker process died",
                process_died=True)
    reporter.poll()
    events.emit(run_dir, "attempt_started", attempt=2, world_size=2, from_step=30)
    events.emit(run_dir, "resumed", failed_rank=1, cause="crash", from_step=30, lost_steps=10, recovery_s=12.5)
    events.log_metrics(run_dir, step=100, epoch=2, loss=0.01, samples_per_s=500.0, attempt=2)
    events.emit(run_dir, "finished", final_step=100, loss=0.01, val_accuracy=0.9)
    reporter.stop()
    lines = out.getvalue().splitlines()
    assert lines == [
        "[train] attempt 1: 2 worker(s), starting",
        lines[1],  # progress lines: their clocks vary
        "[train] fault injected: crash on rank 1 at step 41 (step)",
        "[train] attempt 2: 2 worker(s), resuming from step 30",
        "[train] recovered: rank 1 failed (crash), resumed from step 30, recomputed 10 step(s), 12.5s to this step",
        lines[5],
        lines[6],
    ], lines
    assert lines[1].startswith("[train] step 40/100 epoch 0 loss 0.0250 500 samples/s, elapsed") and "ETA" in lines[1]
    assert lines[5].startswith("[train] step 100/100 epoch 2 loss 0.0100")
    assert lines[6].startswith("[train] finished: step 100, loss 0.0100, validation accuracy 0.9000")
    assert not any("Connection reset" in line for line in lines)  # a peer's echo, not the cause


def test_a_deterministic_failure_shows_the_cause_and_the_traceback_tail(tmp_path):
    run_dir = str(tmp_path)
    reporter, out = _reporter(run_dir)
    tb = "Traceback (most recent call last):\n" + "".join(f'  File "x.py", line {i}, in f\n' for i in range(20)) \
        + "ValueError: shape bug"
    events.emit(run_dir, "worker_failed", rank=0, step=1, classification="deterministic",
                error="shape bug", traceback=tb)
    events.emit(run_dir, "failed", error="ValueError: shape bug (while training step 1; step 1, rank 0)")
    reporter.stop()
    lines = out.getvalue().splitlines()
    assert lines[0] == "[train] rank 0 failed at step 1: shape bug (deterministic)"
    assert len(lines) == 1 + console.TRACEBACK_LINES + 1
    assert lines[-2] == "    ValueError: shape bug"
    assert lines[-1].startswith("[train] failed: ValueError: shape bug")


def test_progress_comes_at_least_every_ten_seconds(tmp_path, monkeypatch):
    run_dir = str(tmp_path)
    clock = [1000.0]
    monkeypatch.setattr(console.time, "time", lambda: clock[0])
    reporter, out = _reporter(run_dir)
    events.emit(run_dir, "training_started", attempt=1, total_steps=1000, from_step=0)
    for step in range(1, 200):
        events.log_metrics(run_dir, step=step, epoch=0, loss=1.0, samples_per_s=10.0, attempt=1)
        clock[0] += 0.5
        reporter.poll()
    progress = [line for line in out.getvalue().splitlines() if "/1000" in line]
    assert 9 <= len(progress) <= 11, progress  # ~100 s of training


def test_quiet_ray_drops_only_ray_notices(tmp_path):
    sink = io.StringIO()
    quiet = console.QuietRay(sink)
    print("\x1b[33m(raylet)\x1b[0m A worker died or was killed while executing a task", file=quiet)
    print("[train] attempt 2: 2 worker(s), resuming from step 150", file=quiet)
    assert sink.getvalue() == "[train] attempt 2: 2 worker(s), resuming from step 150\n"


def test_a_new_driver_skips_what_earlier_drivers_wrote(tmp_path):
    run_dir = str(tmp_path)
    events.emit(run_dir, "attempt_started", attempt=1, world_size=2, from_step=0)
    with open(tmp_path / events.EVENTS, "ab") as f:
        f.write(b'{"event": "attempt_sta')  # torn by a killed writer
    reporter, out = _reporter(run_dir)
    events.emit(run_dir, "attempt_started", attempt=2, world_size=2, from_step=10)
    reporter.stop()
    assert out.getvalue() == "[train] attempt 2: 2 worker(s), resuming from step 10\n"


def test_a_failed_attempts_last_steps_read_after_the_next_attempt_started_are_not_progress(tmp_path):
    # Seen in CI: one poll read attempt 2's attempt_started, then attempt 1's last metrics
    # line; it printed that step after "attempt 2 ...", and without an ETA.
    run_dir = str(tmp_path)
    reporter, out = _reporter(run_dir)
    events.emit(run_dir, "attempt_started", attempt=1, world_size=2, from_step=0)
    events.emit(run_dir, "training_started", attempt=1, total_steps=100, from_step=0)
    for step in range(1, 41):
        events.log_metrics(run_dir, step=step, epoch=0, loss=1.0 / step, samples_per_s=500.0, attempt=1, time=step)
    reporter.poll()
    events.log_metrics(run_dir, step=41, epoch=0, loss=0.02, samples_per_s=500.0, attempt=1, time=41)
    events.emit(run_dir, "attempt_started", attempt=2, world_size=2, from_step=30)
    reporter.printed_at = 0.0  # a progress line is due
    reporter.poll()
    assert not any("step 41/" in line for line in out.getvalue().splitlines()), out.getvalue()
    for step in range(31, 61):
        events.log_metrics(run_dir, step=step, epoch=0, loss=1.0 / step, samples_per_s=500.0, attempt=2,
                           time=100 + step)
    reporter.printed_at = 0.0
    reporter.poll()
    progress = [line for line in out.getvalue().splitlines() if " samples/s, elapsed " in line]
    assert progress[-1].startswith("[train] step 60/100") and "ETA" in progress[-1], progress


def test_no_progress_line_before_the_new_attempts_pace_is_known(tmp_path):
    # Seen in CI: the first poll after a restart held one line of the new attempt; a
    # progress line was due (10 s since the last) and came without an ETA.
    run_dir = str(tmp_path)
    reporter, out = _reporter(run_dir)
    events.emit(run_dir, "attempt_started", attempt=2, world_size=2, from_step=30)
    events.emit(run_dir, "training_started", attempt=2, total_steps=100, from_step=30)
    events.log_metrics(run_dir, step=31, epoch=0, loss=0.5, samples_per_s=500.0, attempt=2, time=10.0)
    reporter.printed_at = 0.0
    reporter.poll()
    assert " samples/s, elapsed " not in out.getvalue()
    events.log_metrics(run_dir, step=32, epoch=0, loss=0.4, samples_per_s=500.0, attempt=2, time=10.5)
    reporter.poll()
    (line,) = [line for line in out.getvalue().splitlines() if " samples/s, elapsed " in line]
    assert line.startswith("[train] step 32/100") and "ETA" in line
