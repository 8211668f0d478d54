"""The run record's events, metrics and checkpoint manifests: every event kind and its
fields, typed, the append-only events.jsonl and metrics.jsonl they are written to and read
from, and the manifest that seals a checkpoint (written and checked by workers.checkpoint).

Every producer writes an event as one of the models below (`emit(run_dir, WorkerFailed(...))`)
and every consumer names a kind as `Kind.X`: an event's name appears nowhere else as a string,
so renaming or adding a field is one change, seen by every reader.

Several processes (workers of one attempt, the Ray Train controller) append to the
same file. Each record is one `write()` on an O_APPEND descriptor, which POSIX keeps
whole for a local file; readers skip a torn last line rather than fail.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from enum import StrEnum
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from workers import segments, storage

EVENTS = "events.jsonl"
METRICS = "metrics.jsonl"
EVENTS_DIR, METRICS_DIR = "events", "metrics"  # on an object store: segment objects (workers.segments)
DRIVER_LOGS = "logs"  # each driver's whole output, one file per driver (workers.run.tee_output)


class Kind(StrEnum):
    """An event's `event` field. A StrEnum: equal to the string a record read back holds."""

    JOB_STARTED = "job_started"            # a driver started (one per Ray submission)
    WORKERS_CHANGED = "workers_changed"    # run again with another worker count than spec.json's
    DRIVER_LOST = "driver_lost"            # written by the next driver: the one before died without a verdict
    ATTEMPT_STARTED = "attempt_started"    # rank 0 of a worker group, before it sets up
    BACKOFF = "backoff"                    # the attempt waits first: earlier ones failed at one step
    RESIZED = "resized"                    # the attempt runs with another worker count than the one before
    WORKER_STARTED = "worker_started"      # each rank, where it runs
    TRAINING_STARTED = "training_started"  # rank 0, state loaded, about to step
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"  # unloadable on resume; an older one is tried
    FAULT_INJECTED = "fault_injected"      # spec.faults fired
    WORKER_FAILED = "worker_failed"
    RESUMED = "resumed"                    # rank 0's first step after a failure: what it cost
    LIVE_JOINED = "live_joined"            # failure.mode live: a replacement took the state from a live peer
    LIVE_RECOVERED = "live_recovered"      # failure.mode live: every replica group trains again; what it cost
    WORKER_FINISHED = "worker_finished"    # each rank's peak memory and communication time
    FINISHED = "finished"                  # the verdict: trained to the end
    FAILED = "failed"                      # the verdict: the job failed


# What a live recovery (failure.mode live) reports, in the summary and the job's status.
LIVE_RECOVERY_KEYS = ("failed_ranks", "failed_after_step", "rejoined_at_step", "stall_s", "rejoin_s", "survivor_steps",
                      "samples_skipped", "survivors_restarted")
FAILURES = frozenset({Kind.WORKER_FAILED, Kind.FAULT_INJECTED, Kind.DRIVER_LOST})  # what ends an attempt
VERDICTS = frozenset({Kind.FINISHED, Kind.FAILED})


class Event(BaseModel):
    """One event. Only the fields a producer sets are written (exclude_unset), as before
    the models: readers tell "not said" from "said None"."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    EVENT: ClassVar[Kind]
    time: float = Field(default_factory=time.time)

    def record(self) -> dict[str, Any]:
        return {"event": self.EVENT.value, "time": self.time,
                **self.model_dump(exclude_unset=True, exclude={"time"})}


class JobStarted(Event):
    EVENT = Kind.JOB_STARTED
    pid: int
    ray_address: str | None = None
    launcher: str | None = None  # set when not Ray Train (bench/vs_torchrun.py's torchrun)


class WorkersChanged(Event):
    EVENT = Kind.WORKERS_CHANGED
    old: Any
    new: Any


class DriverLost(Event):
    EVENT = Kind.DRIVER_LOST
    noticed_at: float  # `time` is when the lost driver was last heard of
    error: str
    pid: int | None = None


class AttemptStarted(Event):
    EVENT = Kind.ATTEMPT_STARTED
    attempt: int
    world_size: int
    from_step: int
    checkpoint: str | None = None
    total_steps: int | None = None
    generation: str | None = None  # failure.mode live: the worker group start it belongs to


class Backoff(Event):
    EVENT = Kind.BACKOFF
    attempt: int
    delay_s: float
    reason: str


class Resized(Event):
    EVENT = Kind.RESIZED
    attempt: int
    old_size: int
    new_size: int
    from_step: int


class WorkerStarted(Event):
    EVENT = Kind.WORKER_STARTED
    attempt: int
    rank: int
    pid: int
    node_id: str | None = None
    process_started: float | None = None  # when the worker's process began
    ready: float | None = None  # when the training code got control, the process group up


class TrainingStarted(Event):
    EVENT = Kind.TRAINING_STARTED
    attempt: int
    world_size: int
    total_steps: int
    from_step: int
    checkpoint: str | None = None


class CheckpointCommitted(Event):
    EVENT = Kind.CHECKPOINT_COMMITTED
    step: int
    path: str  # relative to the run directory
    save_s: float | None = None
    blocked_s: float | None = None
    background: bool | None = None
    report_s: float | None = None


class CheckpointSkipped(Event):
    EVENT = Kind.CHECKPOINT_SKIPPED
    step: int
    rank: int
    error: str


class FaultInjected(Event):
    EVENT = Kind.FAULT_INJECTED
    fault: list[Any]
    kind: str
    rank: int
    step: int | None = None
    phase: str | None = None
    pid: int | None = None


class WorkerFailed(Event):
    EVENT = Kind.WORKER_FAILED
    rank: int | None = None
    step: int | None = None
    attempt: int | None = None
    classification: str
    error: str
    signature: str | None = None
    activity: str | None = None
    traceback: str | None = None
    hung: bool | None = None          # the watchdog saw no progress
    process_died: bool | None = None  # Ray saw the worker's process end
    detail: str | None = None


class Resumed(Event):
    EVENT = Kind.RESUMED
    attempt: int
    failed_rank: int | None = None
    cause: str | None = None
    from_step: int
    reached_step: int
    lost_steps: int
    recovery_s: float


class LiveJoined(Event):
    """A replacement worker (failure.mode live) took the weights and optimizer state of
    `step` from a live peer, over the network."""

    EVENT = Kind.LIVE_JOINED
    attempt: int
    rank: int
    group: int
    pid: int
    step: int
    fetch_s: float  # from asking for a quorum to holding the peer's state


class LiveRecovered(Event):
    """Written by the survivors' leader (failure.mode live) at the first step every replica
    group completed again, or at the end if none did. Times are measured from the end of
    the last step every group completed, so they are upper bounds."""

    EVENT = Kind.LIVE_RECOVERED
    attempt: int
    failed_ranks: list[int]  # the ranks that failed or whose replacements joined meanwhile (one group per worker)
    groups: list[int]
    failed_after_step: int  # the last step every group completed
    rejoined_at_step: int | None  # the first step every group completed again
    stall_s: float  # how long the survivors went without a completed step
    rejoin_s: float | None  # to the end of the replacement's first step
    survivor_steps: int  # steps the survivors completed without the missing groups
    samples_skipped: int  # the missing groups' shares of those steps: trained by no one
    survivors_restarted: bool  # always false: said, so a reader need not know the default


class WorkerFinished(Event):
    EVENT = Kind.WORKER_FINISHED
    rank: int
    world_size: int
    peak_rss_mb: float | None = None
    cuda_peak_mb: float | None = None
    profiled_steps: int | None = None
    profiled_wall_s: float | None = None
    comm_s: float | None = None


class Finished(Event):
    EVENT = Kind.FINISHED
    attempt: int
    final_step: int
    loss: float | None = None
    val_loss: float | None = None
    val_accuracy: float | None = None
    val_metrics: dict[str, Any] = Field(default_factory=dict)
    weights_sha256: str
    world_size: int


class Failed(Event):
    EVENT = Kind.FAILED
    error: str
    rank: int | None = None
    classification: str | None = None


MODELS: dict[Kind, type[Event]] = {m.EVENT: m for m in Event.__subclasses__()}


class MetricsLine(BaseModel):
    """One line of metrics.jsonl: rank 0's, after each step of the one live attempt, so
    the lines are sorted by (attempt, step) (workers.metrics_read seeks on that). The
    validation keys appear on the steps that validated; a web page reads these names."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    time: float = Field(default_factory=time.time)
    step: int
    epoch: int
    loss: float
    lr: float | None = None
    samples_per_s: float | None = None
    step_s: float | None = None
    attempt: int
    val_loss: float | None = None
    val_accuracy: float | None = None
    val_metrics: dict[str, float] | None = None
    groups: int | None = None  # failure.mode live: the replica groups that took part in the step

    def record(self) -> dict[str, Any]:
        return {"time": self.time, **self.model_dump(exclude_unset=True, exclude={"time"})}


class ManifestFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    bytes: int
    sha256: str


class Manifest(BaseModel):
    """checkpoints/step-N/manifest.json, a checkpoint's seal (workers.checkpoint): written
    after every shard, naming each with its size and SHA-256; a checkpoint is loaded only
    when its files match it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    step: int
    committed_at: float = Field(default_factory=time.time)
    files: dict[str, ManifestFile]
    epoch: int | None = None
    batch_index: int | None = None
    world_size: int | None = None
    loss: float | None = None

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())


def parse(record: dict[str, Any]) -> Event | None:
    """A record read back as its typed event; None for a kind this code does not know
    (written by a newer version) or fields that do not fit it."""
    try:
        model = MODELS[Kind(record.get("event"))]
        return model.model_validate({k: v for k, v in record.items() if k != "event"})
    except ValueError:
        return None


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


def emit(run_dir: str, event: Event | str, *, durable: bool = True, **fields: Any) -> dict[str, Any]:
    """Write one event; durable by default since recovery decisions read them back.
    Producers pass a typed event; a name and loose fields are for tests that write a
    record by hand as a worker would."""
    if isinstance(event, Event):
        if fields:
            raise TypeError(f"emit({type(event).__name__}(...)) takes its fields in the model, not {sorted(fields)}")
        record = event.record()
    else:
        record = {"event": str(event), "time": time.time(), **fields}
    if storage.is_local(run_dir):
        append(os.path.join(run_dir, EVENTS), record, durable=durable)
    else:  # every event is flushed at once (recovery decisions read them back), metrics before it
        segments.flush_run(run_dir)
        segments.writer(run_dir, EVENTS_DIR, segments.events_key).add(record, flush=True)
    return record


def events(run_dir: str, kind: Kind | None = None) -> list[dict[str, Any]]:
    history = (read(os.path.join(run_dir, EVENTS)) if storage.is_local(run_dir)
               else segments.read_events(storage.join(run_dir, EVENTS_DIR)))
    return [e for e in history if kind is None or e.get("event") == kind]


def log_metrics(run_dir: str, line: MetricsLine | None = None, **fields: Any) -> None:
    """Write one metrics line. The loop passes a typed line; loose fields are for tests
    that write one by hand as rank 0 would."""
    if line is not None:
        if fields:
            raise TypeError(f"log_metrics(MetricsLine(...)) takes its fields in the line, not {sorted(fields)}")
        record = line.record()
    else:
        record = {"time": time.time(), **fields}
    if storage.is_local(run_dir):
        append(os.path.join(run_dir, METRICS), record)
    else:
        segments.writer(run_dir, METRICS_DIR, segments.metrics_key).add(record, flush=False)


def metrics(run_dir: str) -> list[dict[str, Any]]:
    if storage.is_local(run_dir):
        return list(read(os.path.join(run_dir, METRICS)))
    return segments.metrics_after(storage.join(run_dir, METRICS_DIR), -1, 2**62)


def tail(run_dir: str, stream: str) -> Tail | SegmentTail:
    """A reader of the new records of `stream` (EVENTS or METRICS) at each call."""
    if storage.is_local(run_dir):
        return Tail(os.path.join(run_dir, stream))
    return SegmentTail(storage.join(run_dir, EVENTS_DIR if stream == EVENTS else METRICS_DIR),
                       by_time=stream == EVENTS)


class Tail:
    """New whole JSON lines of a file since the last call (a torn last line waits)."""

    def __init__(self, path: str):
        self.path, self.offset = path, 0

    @property
    def position(self) -> int:
        """Where the next read starts (JSON-serialisable, for a reader that resumes)."""
        return self.offset

    @position.setter
    def position(self, value: int) -> None:
        self.offset = value

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


class SegmentTail:
    """Tail's counterpart on an object store: the records of each segment not returned yet
    (a segment grows between flushes), merged by time for events, in key order for metrics."""

    def __init__(self, directory: str, *, by_time: bool):
        self.cache, self.by_time = segments.SegmentCache(directory), by_time
        self.returned: dict[str, int] = {}

    @property
    def position(self) -> dict[str, int]:
        """{segment: records returned}: Tail.position's counterpart."""
        return dict(self.returned)

    @position.setter
    def position(self, value: dict[str, int]) -> None:
        self.returned = dict(value)

    def skip_to_end(self) -> None:
        self.returned = {name: len(records) for name, records in self.cache.records().items()}

    def read(self) -> list[dict[str, Any]]:
        out = []
        for name, records in self.cache.records().items():
            out.extend(records[self.returned.get(name, 0):])
            self.returned[name] = len(records)
        if self.by_time:
            out.sort(key=lambda r: r.get("time", 0))
        return out


# On an object store, an answer by offset holds only events older than this: a writer's
# PUT lands within moments of its record's time, so the events before the cut are all
# there and in their final order, and `offset` (a count in time order) stays valid.
SETTLE_S = 5.0


def events_from(run_dir: str, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The events written after byte `offset` (a previous answer's end), and where the next
    read starts: the end of the last whole line (a line still being written waits). On an
    object store the offset counts events in time order, up to SETTLE_S ago."""
    if not storage.is_local(run_dir):
        cut = time.time() - SETTLE_S
        settled = [e for e in segments.read_events(storage.join(run_dir, EVENTS_DIR)) if e.get("time", 0) <= cut]
        offset = min(offset, len(settled))
        return settled[offset:], len(settled)
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
        self._seen: dict[str, Any] = {}  # local: (inode, Tail, events); object store: a SegmentCache

    def of(self, run_dir: str) -> list[dict[str, Any]]:
        if not storage.is_local(run_dir):
            directory = storage.join(run_dir, EVENTS_DIR)
            cache = self._seen.get(directory)
            if cache is None:
                cache = self._seen[directory] = segments.SegmentCache(directory)
            return segments.read_events(directory, cache)
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
        keep = {os.path.join(rd, EVENTS) if storage.is_local(rd) else storage.join(rd, EVENTS_DIR)
                for rd in run_dirs}
        for path in set(self._seen) - keep:
            del self._seen[path]


def driver_logs(rd: str) -> list[str]:
    """The run record's driver output files, oldest first (their names start with the UTC
    time the driver started)."""
    folder = storage.join(rd, DRIVER_LOGS)
    if not storage.is_local(rd):
        return [storage.join(folder, n) for n in sorted(storage.listdir(folder)) if n.endswith(".log")]
    try:
        return [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.endswith(".log")]
    except FileNotFoundError:
        return []
