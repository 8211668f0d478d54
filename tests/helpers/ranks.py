"""Run workers.loop.train on N local processes over gloo, without Ray: for unit tests
of the strategies, where Ray's worker startup would be most of the time."""

from __future__ import annotations

import os
import traceback

import torch.multiprocessing as mp

from workers.spec import JobSpec


def _rank_main(rank: int, world: int, store: str, spec_json: str, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    from workers.loop import WorkerEnv, train

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        out = train(JobSpec.model_validate_json(spec_json), WorkerEnv(rank, world, 0))
        results.put((rank, "ok", out))
    except BaseException as e:  # report, don't hang the parent
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def run_ranks(spec: JobSpec, world: int, store: str, timeout: float = 240) -> dict:
    """Rank 0's return value; raises RuntimeError with the first rank's error."""
    os.makedirs(spec.run_dir, exist_ok=True)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, store, spec.model_dump_json(), results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        outs = [results.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [o for o in outs if o[1] == "error"]
    if errors:
        raise RuntimeError(f"rank {errors[0][0]}: {errors[0][2]}")
    return next(o[2] for o in outs if o[0] == 0)
