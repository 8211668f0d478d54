"""When this process started, in epoch seconds: where a restart's seconds go.

The standard library has no process start time and psutil is not a dependency of
ours; Linux keeps it in /proc/self/stat, in clock ticks since boot."""

from __future__ import annotations

import os
import time


def process_started(pid: int | str = "self") -> float | None:
    """None where /proc is not Linux's, or the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        # Field 22 (starttime); the command name (field 2) may hold spaces, so count from its ")".
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None
