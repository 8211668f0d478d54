"""Processes and ports as /proc shows them: what `etrain serve` needs to know that a
recorded Ray head is still the process it started, and to stop all of it. By hand: the
standard library has no process table, and psutil is not a dependency of ours."""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str
    start_time: int
    uid: int = field(default=-1)


def proc_stat(pid: int) -> ProcStat | None:
    """A live process's /proc/<pid>/stat; None when it is gone or a zombie (dead, not yet
    reaped: an init that reaps nothing, as in some containers, leaves those for good)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
    try:
        rest = text.rsplit(")", 1)[1].split()
        stat = ProcStat(pid, int(rest[1]), int(rest[2]), int(rest[3]), rest[0], int(rest[19]), uid)
    except (IndexError, ValueError):
        return None
    return None if stat.state in ("Z", "X", "x") else stat


def proc_cmdline(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]] if raw else None


def boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def all_procs() -> dict[int, ProcStat]:
    out = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if entry.isdigit():
            stat = proc_stat(int(entry))
            if stat is not None:
                out[stat.pid] = stat
    return out


def with_descendants(roots: list[ProcStat], procs: dict[int, ProcStat]) -> dict[int, int]:
    children: dict[int, list[ProcStat]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p)
    out, todo = {}, list(roots)
    while todo:
        p = todo.pop()
        if p.pid not in out and p.pid != os.getpid():
            out[p.pid] = p.start_time
            todo.extend(children.get(p.pid, []))
    return out


def session_tree(leader: int, floor: int | None) -> dict[int, int]:
    """pid: start time of every live process of the session `leader` leads (started no
    earlier than it) and of their descendants, whatever their group or session."""
    procs = all_procs()
    roots = [p for p in procs.values() if (p.sid == leader or p.pgid == leader) and p.uid == os.getuid()
             and (floor is None or p.start_time >= floor)]
    return with_descendants(roots, procs)


def same_process(pid: int, start_time: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat.start_time == start_time


def kill_all(procs: dict[int, int], grace_s: float) -> None:
    """SIGTERM, then after `grace_s` SIGKILL, to each pid that is still the process seen."""
    for sig, wait in [*([(signal.SIGTERM, grace_s)] if grace_s > 0 else []), (signal.SIGKILL, 5)]:
        live = [pid for pid, start in procs.items() if same_process(pid, start)]
        for pid in live:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.time() + wait
        while time.time() < deadline and any(same_process(pid, start) for pid, start in procs.items()):
            time.sleep(0.2)


def group_alive(pgid: int) -> bool:
    """Whether any live (not zombie) process is in the group."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.isdir("/proc/self"):
        return True
    return any(p.pgid == pgid for p in all_procs().values())


def listeners(port: int) -> list[int]:
    """The pids of the processes listening on TCP `port` (any address), as far as /proc
    shows them (another user's processes stay hidden)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{cols[9]}]")
    if not inodes:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") in inodes:
                    pids.append(int(entry))
                    break
            except OSError:
                continue
    return sorted(pids)


def describe(pid: int) -> str:
    """A process in a few words: `gcs_server`, `python3 dashboard.py`, `python -m pytest`."""
    argv = proc_cmdline(pid) or []
    if not argv:
        return "?"
    words = [os.path.basename(argv[0])]
    if re.fullmatch(r"python[\d.]*", words[0]) and len(argv) > 1:
        words += ["-m", argv[2]] if argv[1] == "-m" and len(argv) > 2 else [os.path.basename(argv[1])]
    return " ".join(words)[:80]
