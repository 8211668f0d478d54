"""Fault injection: crash, exception or hang at step S on rank R, each once per job.

A fault is recorded durably as `fault_injected` before it fires; every attempt reads
those records first, so a restarted worker replaying step S does not fire it again.
"""

from __future__ import annotations

import os
import signal
import time

from workers import events
from workers.spec import FaultSpec


class InjectedFault(RuntimeError):
    """Raised by an `exception` fault. Stands for a transient failure, so it is retried."""


def _key(fault: FaultSpec) -> tuple:
    return (fault.at_step, fault.rank, fault.kind, fault.phase)


class FaultInjector:
    def __init__(self, faults: list[FaultSpec], run_dir: str, rank: int):
        self.run_dir = run_dir
        self.rank = rank
        done = {tuple(e["fault"]) for e in events.events(run_dir, events.Kind.FAULT_INJECTED)}
        self.pending = [f for f in faults if f.rank == rank and _key(f) not in done]

    def maybe_fire(self, step: int, phase: str = "step") -> None:
        for fault in self.pending:
            if fault.at_step == step and fault.phase == phase:
                self.pending.remove(fault)
                self.fire(fault)
                return

    def fire(self, fault: FaultSpec) -> None:
        events.emit(self.run_dir, events.FaultInjected(
            fault=list(_key(fault)), kind=fault.kind, rank=self.rank, step=fault.at_step, phase=fault.phase,
            pid=os.getpid()))
        print(f"[fault] rank {self.rank}: injecting {fault.kind} at step {fault.at_step} ({fault.phase})", flush=True)
        if fault.kind == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "exception":
            raise InjectedFault(f"injected exception at step {fault.at_step} on rank {self.rank}")
        if fault.kind == "hang":
            # The other ranks block in their next collective until it times out.
            while True:
                time.sleep(3600)
