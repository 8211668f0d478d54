"""workers/tensorboard.py on a hand-written run directory, read back the way TensorBoard
reads it: one point per step whatever the records repeat, and none again from a
driver started anew on the same directory."""

from __future__ import annotations

import io
import json
import os

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from workers import events
from workers.console import Reporter
from workers.tensorboard import PROGRESS, BoardWriter, board_dir


def board(run_dir: str) -> EventAccumulator:
    acc = EventAccumulator(board_dir(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def points(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(s.step, round(s.value, 6)) for s in acc.Scalars(tag)]


def row(run_dir: str, step: int, **extra) -> None:
    events.log_metrics(run_dir, step=step, epoch=0, loss=1.0 / step, lr=0.01, samples_per_s=100.0 + step,
                       attempt=1, **extra)


def test_one_point_per_step_across_restarts_and_drivers(tmp_path):
    run_dir = str(tmp_path)
    for step in range(1, 7):
        row(run_dir, step, **({"val_loss": 0.5, "val_accuracy": 0.8, "val_metrics": {"accuracy": 0.8}}
                               if step == 5 else {}))
    first = BoardWriter(run_dir)
    first.poll()
    # A worker failed after step 6; the attempt resumed from the checkpoint of step 4 and
    # logs steps 5 and 6 again (the same step, another time) before going on.
    events.emit(run_dir, "resumed", failed_rank=1, cause="worker process died", from_step=4, lost_steps=2,
                recovery_s=3.25)
    for step in range(5, 9):
        row(run_dir, step)
    with open(os.path.join(run_dir, events.METRICS), "a") as f:
        f.write('{"step": 9, "loss": 0.1')  # torn: its writer is still writing it
    first.close()

    # The service starts the driver again on the same run directory: it reads the files anew.
    second = BoardWriter(run_dir)
    with open(os.path.join(run_dir, events.METRICS), "a") as f:
        f.write(', "lr": 0.01, "samples_per_s": 109.0}\n')
    row(run_dir, 10, val_loss=0.25, val_metrics={"accuracy": 0.9, "top5": 1.0}, val_accuracy=0.9)
    events.emit(run_dir, "finished", final_step=10, loss=0.1, val_loss=0.25, val_accuracy=0.9,
                val_metrics={"accuracy": 0.9, "top5": 1.0})
    second.close()
    BoardWriter(run_dir).close()  # nothing new: nothing written, nothing repeated

    acc = board(run_dir)
    assert [step for step, _ in points(acc, "loss")] == list(range(1, 11))
    assert points(acc, "loss")[4] == (5, 0.2)  # the first record of step 5 won
    assert [step for step, _ in points(acc, "lr")] == list(range(1, 11))
    assert points(acc, "samples_per_s")[-2] == (9, 109.0)
    assert points(acc, "val/loss") == [(5, 0.5), (10, 0.25)]
    assert points(acc, "val/accuracy") == [(5, 0.8), (10, 0.9)]
    assert points(acc, "val/top5") == [(10, 1.0)]
    assert points(acc, "recovery_s") == [(4, 3.25)]
    (text,) = acc.Tensors("recoveries/text_summary")
    said = text.tensor_proto.string_val[0].decode()
    assert text.step == 4
    assert "rank 1" in said and "worker process died" in said and "2 step(s)" in said and "3.2s" in said
    progress = json.load(open(os.path.join(board_dir(run_dir), PROGRESS)))
    assert progress["last_step"] == 10 and progress["metrics_offset"] == os.path.getsize(
        os.path.join(run_dir, events.METRICS))


def test_points_a_dead_driver_wrote_past_its_saved_progress_are_not_shown_twice(tmp_path, monkeypatch):
    run_dir = str(tmp_path)
    for step in range(1, 4):
        row(run_dir, step)
    first = BoardWriter(run_dir)
    first.poll()  # steps 1-3, progress saved
    for step in range(4, 7):
        row(run_dir, step)
    # Killed after the event file was flushed and before progress.json was replaced.
    monkeypatch.setattr(first, "_save", lambda: None)
    first.poll()
    first.writer.close()

    second = BoardWriter(run_dir)  # reads steps 4-6 again
    row(run_dir, 7)
    second.close()
    assert [step for step, _ in points(board(run_dir), "loss")] == list(range(1, 8))


def test_the_finished_scores_are_a_point_when_no_line_had_them(tmp_path):
    run_dir = str(tmp_path)
    for step in (1, 2, 3):
        row(run_dir, step)
    events.emit(run_dir, "finished", final_step=3, loss=0.3, val_loss=0.7, val_accuracy=0.6,
                val_metrics={"accuracy": 0.6})
    reporter = Reporter(run_dir, out=io.StringIO(), started=0.0, views=[BoardWriter(run_dir)])
    reporter.stop()  # the driver's last poll closes the board
    acc = board(run_dir)
    assert points(acc, "val/loss") == [(3, 0.7)] and points(acc, "val/accuracy") == [(3, 0.6)]
    assert len(points(acc, "loss")) == 3


def test_a_board_that_fails_is_said_once_and_the_console_goes_on(tmp_path):
    class Broken:
        STOPPED = BoardWriter.STOPPED

        def poll(self):
            raise OSError("disk full")

    out = io.StringIO()
    reporter = Reporter(str(tmp_path), out=out, started=0.0, views=[Broken()])
    reporter.poll()
    reporter.poll()
    reporter.stop()
    assert out.getvalue().count("TensorBoard files are no longer written: OSError: disk full") == 1


def board_on(uri: str) -> EventAccumulator:
    """Read the way `tensorboard --logdir s3://...` reads: TensorBoard's own S3 reader."""
    acc = EventAccumulator(uri, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_on_object_storage_the_spool_is_copied_whole_and_a_driver_on_another_host_goes_on(
        s3_bucket, tmp_path, monkeypatch):
    import workers.tensorboard as tb
    from workers import segments, storage

    run_dir = f"{s3_bucket}/job-tb"
    monkeypatch.setattr(tb, "ROLL_BYTES", 600)  # a few points a file, so files roll here
    for step in range(1, 6):
        row(run_dir, step)
    segments.flush()  # metrics reach the store every 2 s; now, here
    first = BoardWriter(run_dir, spool=str(tmp_path / "host-a"))
    first.poll()  # the first points are copied at once; the next ones wait COPY_EVERY_S
    remote = f"{run_dir}/tensorboard"
    assert [s for s, _ in points(board_on(remote), "loss")] == [1, 2, 3, 4, 5]
    for step in range(6, 9):
        row(run_dir, step)
    segments.flush()
    first.poll()  # within COPY_EVERY_S of the last read: not read yet
    assert [s for s, _ in points(board_on(remote), "loss")] == [1, 2, 3, 4, 5]
    events.emit(run_dir, "resumed", failed_rank=0, cause="worker process died", from_step=5, lost_steps=3,
                recovery_s=2.0)
    for step in range(6, 12):  # steps 6-8 again, then on
        row(run_dir, step)
    segments.flush()
    first.close()
    assert not os.path.exists(first.dir)  # the spool is removed once copied
    files = [n for n in storage.listdir(remote) if n.startswith("events.out.tfevents.")]
    assert len(files) >= 2  # rolled at ROLL_BYTES: no copy rewrites a growing file forever

    # The service resubmits the driver, on another host: no spool there, the bucket's progress.
    second = BoardWriter(run_dir, spool=str(tmp_path / "host-b"))
    assert second.last_step == 11
    for step in range(12, 15):
        row(run_dir, step)
    segments.flush()
    second.close()
    acc = board_on(remote)
    assert [s for s, _ in points(acc, "loss")] == list(range(1, 15))
    assert points(acc, "loss")[5] == (6, round(1 / 6, 6))
    assert points(acc, "recovery_s") == [(5, 2.0)]
    saved = json.loads(storage.read_bytes(f"{remote}/{PROGRESS}"))
    assert saved["last_step"] == 14 and isinstance(saved["metrics_offset"], dict)


def test_a_storage_blip_is_copied_again_at_the_next_round(s3_bucket, tmp_path, monkeypatch):
    import workers.tensorboard as tb
    from workers import segments, storage

    run_dir = f"{s3_bucket}/job-blip"
    monkeypatch.setattr(tb, "COPY_EVERY_S", 0.0)
    for step in range(1, 4):
        row(run_dir, step)
    segments.flush()
    real, calls = storage.write_bytes, []

    def flaky(uri, data):
        calls.append(uri)
        if len(calls) == 1:
            raise OSError("503 Slow Down")
        real(uri, data)

    monkeypatch.setattr(storage, "write_bytes", flaky)
    writer = BoardWriter(run_dir, spool=str(tmp_path))
    writer.poll()  # the copy fails: nothing recorded, nothing raised
    assert writer.unsaved and not storage.exists(f"{run_dir}/tensorboard/{PROGRESS}")
    writer.poll()  # no new record; the same file copied again, then the progress
    assert not writer.unsaved and storage.exists(f"{run_dir}/tensorboard/{PROGRESS}")
    writer.close()
    assert [s for s, _ in points(board_on(f"{run_dir}/tensorboard"), "loss")] == [1, 2, 3]


def test_a_live_recovery_is_a_stall_point_and_a_line_where_the_survivors_went_on(tmp_path):
    run_dir = str(tmp_path)
    for step in range(1, 13):
        row(run_dir, step)
    events.emit(run_dir, events.LiveRecovered(
        attempt=1, failed_ranks=[2], groups=[0, 1, 2], failed_after_step=7, rejoined_at_step=11, stall_s=1.5,
        rejoin_s=6.25, survivor_steps=3, samples_skipped=48, survivors_restarted=False))
    BoardWriter(run_dir).close()
    acc = board(run_dir)
    assert points(acc, "live/stall_s") == [(7, 1.5)] and points(acc, "live/rejoin_s") == [(7, 6.25)]
    (text,) = acc.Tensors("recoveries/text_summary")
    said = text.tensor_proto.string_val[0].decode()
    assert text.step == 7
    assert "rank 2 failed after step 7 (live)" in said and "3 step(s) without it" in said
    assert "rejoined at step 11 after 6.2s" in said
