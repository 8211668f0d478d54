"""SIGKILL one Ray worker process on this node: the entrypoint of the tiny Ray job the
service submits (pinned to the worker's node) when a fault is injected through the API.

    python -m workers.kill_worker --pid N [--title ray::RayTrainWorker]

The service checked through Ray's state API that `N` is a live actor's process; this
checks again on the node itself, at the moment of the signal: a pid is reused once its
process ends, so only a busy Ray worker (its title `ray::<actor or task>`, not
`ray::IDLE`) is killed, never what took the pid of one that ended. Where there is no
/proc to ask (macOS) the pid is trusted.

Exit code: 0 killed; 3 nothing live to kill (not a busy Ray worker, or already gone);
2 bad arguments. The last line printed says the same for a reader of the job's logs.
Nothing here imports Ray (or service/): it starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

KILLED, NOT_LIVE = 0, 3


def title_of(pid: int) -> bytes | None:
    """The process's command line as Ray titles it (`ray::...`); None when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def live_ray_worker(pid: int, title: str | None = None) -> bool:
    """Whether `pid` is a busy Ray worker (and, given `title`, one whose title starts so)."""
    if pid <= 1 or pid == os.getpid():
        return False
    if not os.path.isdir("/proc/self"):
        return True  # no /proc (macOS): trusted, as Ray's state API vouched for it
    seen = title_of(pid)
    if seen is None or not seen.startswith(b"ray::") or seen.startswith(b"ray::IDLE"):
        return False
    return title is None or seen.startswith(title.encode())


def kill(pid: int, title: str | None = None) -> bool:
    """SIGKILL `pid` if it is a busy Ray worker; whether it was killed."""
    if not live_ray_worker(pid, title):
        return False
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.kill_worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pid", type=int, required=True, help="the worker process to SIGKILL")
    parser.add_argument("--title", default=None,
                        help="what its title must start with (e.g. ray::RayTrainWorker), besides ray::")
    args = parser.parse_args(argv)
    if kill(args.pid, args.title):
        print(f"etrain-kill-worker: killed {args.pid}", flush=True)
        return KILLED
    print(f"etrain-kill-worker: no live Ray worker with pid {args.pid} here", flush=True)
    return NOT_LIVE


if __name__ == "__main__":
    sys.exit(main())
