"""Where a worker's step time goes, for bench/: with ETRAIN_PROFILE_STEPS=FIRST:LAST set,
those steps run under torch.profiler and the worker records how much of their wall time
its communication threads spent in collectives (gloo:* / nccl:* ranges), plus its peak
memory. Off by default: profiling slows steps down."""

from __future__ import annotations

import os
import resource
import time

import torch

from workers import events

ENV = "ETRAIN_PROFILE_STEPS"
COMM_PREFIXES = ("gloo:", "nccl:")


class StepProfiler:
    def __init__(self) -> None:
        first, _, last = os.environ.get(ENV, "").partition(":")
        self.first, self.last = (int(first), int(last)) if first and last else (0, -1)
        self.profile = None
        self.started = 0.0
        self.wall_s = 0.0

    def before(self, step: int) -> None:
        """`step`: the 1-based step about to run."""
        if step == self.first:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.profile = profile(activities=activities)
            self.profile.__enter__()
            self.started = time.perf_counter()

    def after(self, step: int) -> None:
        if self.profile is not None and step == self.last:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.wall_s = time.perf_counter() - self.started
            self.profile.__exit__(None, None, None)

    def record(self, run_dir: str, rank: int, world: int) -> None:
        """Every rank notes its peak memory; profiled ranks their communication time too."""
        fields = {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        if torch.cuda.is_available():
            fields["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        if self.profile is not None and self.wall_s:
            spans = [(e.time_range.start, e.time_range.end) for e in self.profile.events()
                     if e.name.startswith(COMM_PREFIXES) or (e.device_type.name == "CUDA" and "nccl" in e.name.lower())]
            comm_us = covered(spans)
            fields.update(profiled_steps=self.last - self.first + 1, profiled_wall_s=round(self.wall_s, 4),
                          comm_s=round(comm_us / 1e6, 4))
        events.emit(run_dir, events.WorkerFinished(rank=rank, world_size=world, **fields), durable=False)


def covered(spans: list[tuple[float, float]]) -> float:
    """Time covered by at least one span: a send and a receive in flight together (or a
    collective on two threads) are one stretch of communication, not two."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(spans):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total
