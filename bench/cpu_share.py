"""Whose CPU a bench run used: the training workers, or everything else it started.

On a machine whose cores the workers fill, every tick Ray's daemons, the controller
and the driver spend (or torchrun's agent) is a tick the workers wait for. The sampler
reads /proc for the run's process tree every half second (by hand: psutil is not among
the dependencies, and the bench needs only utime+stime and the command line), so the
report can say how much of the machine went to the run's background during the steady
state, next to the samples/s ratio it explains.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
# The processes that train. The rest of the tree (raylet, GCS, dashboard, Ray Train's
# controller, the driver, torchrun's agent) is the run's background.
WORKER_MARKS = ("ray::RayTrainWorker", "torchrun_worker.py")


def _stats() -> dict[int, tuple[int, float]]:
    """Every process's parent and CPU seconds (utime + stime), from one read of its stat."""
    out: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) * TICK_S)
        except (OSError, IndexError, ValueError):
            continue
    return out


def _kind(pid: int) -> tuple[bool, str]:
    """Whether the process trains, and a short name for the report (Ray's process title,
    or the program and its first argument)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a for a in f.read().decode(errors="replace").split("\0") if a]
    except OSError:
        return False, "?"
    if len(argv) == 1:  # a process title set over argv (setproctitle) is one string
        argv = argv[0].split()
    if not argv:
        return False, "?"
    cmd = " ".join(argv)
    # torchrun's agent names the worker script among its own arguments.
    worker = any(mark in cmd for mark in WORKER_MARKS) and "torch.distributed.run" not in cmd
    if cmd.startswith("ray::"):
        return worker, cmd.split()[0]
    if len(argv) > 1 and argv[1] in ("-c", "-m"):  # `python -c CODE` would name itself by its code
        return worker, f"{os.path.basename(argv[0])} {argv[1]} {argv[2] if argv[1] == '-m' else ''}".strip()
    words = [os.path.basename(a) for a in argv[:3] if a and not a.startswith("-")]
    return worker, " ".join(words[:2]) or "?"


@dataclass
class CpuSampler:
    interval_s: float = 0.5
    # (wall time, {pid: (is_worker, name, cpu seconds so far)})
    samples: list[tuple[float, dict[int, tuple[bool, str, float]]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self, root: int) -> None:
        known: dict[int, tuple[bool, str]] = {}

        def sample() -> None:
            stats, todo, seen = _stats(), [root], {}
            tree: dict[int, list[int]] = {}
            for pid, (ppid, _) in stats.items():
                tree.setdefault(ppid, []).append(pid)
            while todo:
                pid = todo.pop()
                if pid not in stats:
                    continue
                cpu = stats[pid][1]
                # Read each time: a Ray worker takes its actor's name some time after it
                # starts. A process that has exited (a zombie) has no command line left.
                kind = _kind(pid)
                if kind[1] == "?" and pid in known:
                    kind = known[pid]
                known[pid] = kind
                seen[pid] = (*kind, cpu)
                todo.extend(tree.get(pid, ()))
            self.samples.append((time.time(), seen))

        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                sample()

        self._thread = threading.Thread(target=loop, name="bench-cpu-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def share(self, start: float, end: float, cores: int) -> dict | None:
        """Fractions of the machine (all cores) the workers and the background used between
        two wall times, from the samples that bracket them most tightly inside, and the
        background's largest users by name."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return None
        (t0, a), (t1, _) = inside[0], inside[-1]
        machine = (t1 - t0) * cores
        last: dict[int, tuple[bool, str, float]] = {}
        for _, seen in inside:  # a process that ended inside keeps what it last showed
            last.update(seen)
        used = {True: 0.0, False: 0.0}
        by_name: dict[str, float] = {}
        for pid, (worker, name, cpu) in last.items():
            spent = cpu - (a[pid][2] if pid in a else 0.0)  # a process born inside counts from zero
            used[worker] += spent
            if not worker:
                by_name[name] = by_name.get(name, 0.0) + spent / machine
        top = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:5])
        return {"workers": used[True] / machine, "background": used[False] / machine, "window_s": t1 - t0,
                "background_top": top}

    def last_busy(self, name: str, after: float, min_s: float = 0.05) -> float | None:
        """The last sample time after `after` at which processes named `name` had used more
        than `min_s` CPU seconds since the sample before: when they went quiet (None: never
        busy after `after`)."""
        busy, before = None, None
        for t, seen in self.samples:
            now = {pid: cpu for pid, (_, n, cpu) in seen.items() if n == name}
            if before is not None and t > after and \
                    sum(cpu - before.get(pid, 0.0) for pid, cpu in now.items()) > min_s:
                busy = t
            before = now
        return busy

    def since_start(self, end: float, top: int = 8) -> dict[str, float] | None:
        """CPU seconds each kind of process spent from the run's start (every process in the
        tree was born after it) to the last sample before `end`, largest first: where a
        launch's CPU went, on a machine whose cores it fills."""
        inside = [seen for t, seen in self.samples if t <= end]
        if not inside:
            return None
        last: dict[int, tuple[bool, str, float]] = {}
        for seen in inside:
            last.update(seen)
        by_name: dict[str, float] = {}
        for worker, name, cpu in last.values():
            by_name[name] = by_name.get(name, 0.0) + cpu
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1])
        return {"total": sum(by_name.values()), **dict(ranked[:top])}
