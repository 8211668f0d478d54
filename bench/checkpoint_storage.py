"""Checkpoint save and resume time, and training steps/s, on the local disk and on an
S3-compatible server, side by side in one run, through the code a job uses.

    python bench/checkpoint_storage.py [--model resnet18] [--repeats 5] [--steps 60]

Part 1, training: the same job (resnet18 on synthetic 3x32x32 images, one worker, batch
32, a checkpoint every 10 steps) run by workers.loop.train in this process on each
storage, a fault injected at step 45 and the next attempt resumed from the storage, as a
Ray Train worker would. Reported: steps/s (median step of the first attempt, metrics
lines), a checkpoint's save_s and blocked_s (checkpoint_committed events, median),
resume_s (the failure to the resumed attempt's first completed step, the `resumed`
event), steps/s with the checkpoints' stalls (steps over wall time), and whether both runs end with the same weights_sha256.

The state is a torchvision model's weights and its AdamW state after one step (resnet18:
11.7M parameters, about 140 MB with the optimizer's moments), plus one rank's RNG state, as
rank 0 of a DDP job writes them. Part 2, per storage, --repeats times:
  save    write_shard(state.pt), write_shard(rng-rank0.pt), commit (manifest with SHA-256
          of each file, then LATEST), prune to 2 kept: what training waits for at a checkpoint
  resume  latest() (lists, reads LATEST and the manifest, verifies the SHA-256 of the newest)
          then load_shard(state.pt) with weights_only, as the next attempt's rank 0 does
The S3 server is moto's server mode on 127.0.0.1 (tests/helpers/s3.py), its own process,
spoken to over HTTP by s3fs: a stand-in for the network path's overheads (requests,
multipart uploads, hashing what was written), not for a real network's bandwidth.

Timings are reported, never asserted. The table goes to bench/results/checkpoint_storage.txt,
the same figures as JSON next to it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime

from common import host, write_json, write_results  # bench/ is sys.path[0] when run as a script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

RESULTS = os.path.join(ROOT, "bench", "results", "checkpoint_storage.txt")


def the_state(model_name: str) -> dict:
    import torch
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)(num_classes=10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 0, "epoch": 0,
            "batch_index": 0}


def measure(run_dir: str, state: dict, repeats: int) -> dict:
    from workers import checkpoint
    from workers.checkpointing import rng_state

    saves, commits, resumes, verifies = [], [], [], []
    for i in range(repeats):
        step = 10 * (i + 1)
        state["step"] = step
        t0 = time.perf_counter()
        tmp = checkpoint.tmp_dir(run_dir, step)
        checkpoint.write_shard(tmp, "state.pt", state)
        checkpoint.write_shard(tmp, "rng-rank0.pt", rng_state())
        t1 = time.perf_counter()
        checkpoint.commit(run_dir, step, {"epoch": 0, "batch_index": 0, "world_size": 1})
        checkpoint.prune(run_dir, keep=2)
        t2 = time.perf_counter()
        newest = checkpoint.latest(run_dir)
        t3 = time.perf_counter()
        loaded = checkpoint.load_shard(newest[1], "state.pt")
        t4 = time.perf_counter()
        assert newest[0] == step and loaded["step"] == step
        saves.append(t2 - t0)
        commits.append(t2 - t1)
        verifies.append(t3 - t2)
        resumes.append(t4 - t2)
    manifest = checkpoint.read_manifest(checkpoint.latest(run_dir)[1], verify=False)
    return {"bytes": manifest.bytes, "save_s": saves, "commit_s": commits, "resume_s": resumes, "verify_s": verifies}


def train_on(storage_root: str, steps: int) -> dict:
    """Part 1: one job with a fault at step 45, resumed; its figures from its run record."""
    from workers import events, segments
    from workers.events import Kind
    from workers.faults import InjectedFault
    from workers.loop import WorkerEnv, train
    from workers.spec import JobSpec, write_spec_json

    spec = JobSpec.model_validate({
        "job_id": "bench", "model": "resnet18", "workers": 1, "storage": storage_root,
        "dataset": {"name": "synthetic", "size": 4096, "channels": 3, "image_size": 32, "noise": 2.0},
        "training": {"max_steps": steps, "global_batch_size": 32, "seed": 7},
        "checkpoint": {"every_steps": 10, "keep": 2},
        "faults": [{"at_step": 45, "rank": 0, "kind": "exception"}]})
    write_spec_json(spec)
    try:
        train(spec, WorkerEnv(0, 1, 0))
    except InjectedFault:
        pass
    segments._writers.clear()  # the next attempt is a new process, with writers of its own
    result = train(spec, WorkerEnv(0, 1, 0))
    rd = spec.run_dir
    first = [m for m in events.metrics(rd) if m.get("attempt") == 1]
    step_s = [m["step_s"] for m in first if m.get("step_s")][5:]
    committed = events.events(rd, Kind.CHECKPOINT_COMMITTED)
    (resumed,) = events.events(rd, Kind.RESUMED)
    return {"steps_per_s": 1 / statistics.median(step_s),
            # with the checkpoints' stalls: steps 6 to the fault over the time they took
            "effective_steps_per_s": (first[-1]["step"] - first[5]["step"]) / (first[-1]["time"] - first[5]["time"]),
            "save_s": statistics.median(c["save_s"] for c in committed),
            "blocked_s": statistics.median(c["blocked_s"] for c in committed),
            "resume_s": resumed["recovery_s"], "lost_steps": resumed["lost_steps"],
            "weights_sha256": result["weights_sha256"]}


def training_table(rows: dict[str, dict]) -> str:
    lines = ["training (resnet18, 1 worker, checkpoint every 10 steps, fault at step 45, resumed):",
             f"{'storage':<8} {'steps/s':>8} {'with ckpts':>11} {'ckpt save s':>12} {'blocked s':>10} "
             f"{'resume s':>9} {'lost':>5}"]
    for name, r in rows.items():
        lines.append(f"{name:<8} {r['steps_per_s']:>8.2f} {r['effective_steps_per_s']:>11.2f} {r['save_s']:>12.3f} {r['blocked_s']:>10.3f} "
                     f"{r['resume_s']:>9.2f} {r['lost_steps']:>5}")
    local, s3 = rows.get("local"), rows.get("s3")
    if local and s3:
        lines.append(f"s3 / local: steps/s {s3['steps_per_s'] / local['steps_per_s']:.2f}x (with checkpoints "
                     f"{s3['effective_steps_per_s'] / local['effective_steps_per_s']:.2f}x), checkpoint save "
                     f"{s3['save_s'] / local['save_s']:.2f}x, resume {s3['resume_s'] / local['resume_s']:.2f}x; "
                     f"same weights: {'yes' if s3['weights_sha256'] == local['weights_sha256'] else 'NO'}")
    return "\n".join(lines) + "\n\n"


def table(rows: dict[str, dict], model: str) -> str:
    lines = [f"checkpoint files alone (part 2; {model} weights and AdamW state):",
             f"{'storage':<8} {'MB':>7} {'save s':>8} {'of it commit':>13} {'save MB/s':>10} "
             f"{'resume s':>9} {'of it verify':>13} {'resume MB/s':>12}"]
    for name, r in rows.items():
        mb = r["bytes"] / 1e6
        save, commit = statistics.median(r["save_s"]), statistics.median(r["commit_s"])
        resume, verify = statistics.median(r["resume_s"]), statistics.median(r["verify_s"])
        lines.append(f"{name:<8} {mb:>7.1f} {save:>8.3f} {commit:>13.3f} {mb / save:>10.1f} "
                     f"{resume:>9.3f} {verify:>13.3f} {mb / resume:>12.1f}")
    local, s3 = rows.get("local"), rows.get("s3")
    if local and s3:
        lines.append("")
        lines.append(f"s3 / local (medians): save {statistics.median(s3['save_s']) / statistics.median(local['save_s']):.2f}x, "
                     f"resume {statistics.median(s3['resume_s']) / statistics.median(local['resume_s']):.2f}x")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", help="a torchvision model name")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (part 1)")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()

    import fsspec

    from tests.helpers.s3 import start_s3_server

    load_before = os.getloadavg()
    state = the_state(args.model)
    with tempfile.TemporaryDirectory(prefix="etrain-bench-ckpt-") as work:
        server = start_s3_server(os.path.join(work, "moto.log"))
        try:
            os.environ.update(server.env)
            fsspec.filesystem("s3").mkdir("bench")
            trained = {}
            for name, root in (("local", os.path.join(work, "train")), ("s3", "s3://bench/train")):
                print(f"[bench] {name}: training {args.steps} steps with a fault and a resume", flush=True)
                trained[name] = train_on(root, args.steps)
            rows = {}
            for name, run_dir in (("local", os.path.join(work, "run")), ("s3", "s3://bench/run")):
                print(f"[bench] {name}: {args.repeats} saves and resumes", flush=True)
                rows[name] = measure(run_dir, state, args.repeats)
        finally:
            server.stop()
    facts = host(load_before, os.getloadavg(), packages=("torch", "s3fs", "moto"))
    header = (f"training, checkpoint save and resume: local disk vs S3-compatible server (moto, 127.0.0.1), "
              f"{datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC\n"
              f"state: torchvision {args.model} weights + AdamW state + RNG, as rank 0 of a DDP job writes it; "
              f"median of {args.repeats}\n"
              f"host: {facts['hostname']}, {facts['cores']} cores, {facts['cpu']}; load "
              f"{facts['load_avg_before'][0]} before, {facts['load_avg_after'][0]} after; "
              f"s3fs {facts['versions']['s3fs']}, moto {facts['versions']['moto']}")
    text = header + "\n\n" + training_table(trained) + table(rows, args.model)
    print("\n" + text, end="")
    write_results(text, args.out)
    write_json({"training": trained, "rows": rows, "model": args.model, "host": facts}, args.out)
    print(f"[bench] table written to {os.path.relpath(args.out, os.getcwd())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
