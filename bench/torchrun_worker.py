"""One torchrun worker for bench/vs_torchrun.py: the same training loop Ray Train runs.

    torchrun --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --local-addr 127.0.0.1 \
        --nnodes 1 --nproc-per-node 2 --max-restarts 1 bench/torchrun_worker.py SPEC.json

torchrun's agent gives RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. After a
worker dies the agent restarts the whole group (up to --max-restarts); the loop resumes
from the newest committed checkpoint in the run directory, as it does under Ray Train.
The bench, not this script, creates the run directory (spec.json) before torchrun starts.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # torchrun puts bench/ first on sys.path, not the repository root
    sys.path.insert(0, ROOT)


def _loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except (OSError, ValueError):
        return False


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: torchrun ... bench/torchrun_worker.py SPEC.json", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from workers.loop import WorkerEnv, train
    from workers.process_clock import process_started
    from workers.spec import JobSpec

    with open(argv[0]) as f:
        spec = JobSpec.model_validate_json(f.read())
    rank, world, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    master = os.environ.get("MASTER_ADDR", "")
    if not _loopback(master):
        print(f"[bench-worker] rank {rank}: MASTER_ADDR {master!r} is not a loopback address; refusing to bind",
              file=sys.stderr, flush=True)
        return 3
    if rank == 0:
        print(f"[bench-worker] rank 0: master {master}:{os.environ.get('MASTER_PORT')} (loopback), "
              f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}, pid {os.getpid()}", flush=True)

    # Same backend and collective timeout as workers.run gives Ray Train (TorchConfig).
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=spec.failure.collective_timeout_s))
    try:
        train(spec, WorkerEnv(rank, world, local_rank, process_started=process_started(), ready=time.time()))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # About one worker exit in twelve aborts in C++ teardown on this CPU host ("terminate
    # called without an active exception", SIGABRT) after the worker has written its last
    # event, with or without torch.profiler, and torchrun counts that as a failed run.
    # Everything is written by now: leave without the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
