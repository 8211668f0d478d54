"""The training loop on one CUDA device, without Ray: does a run resumed after a fault end
with the undisturbed run's weights, in fp32, bf16 and fp16, and are two undisturbed runs
the same? CPU runs are checked by the test suite; this is the GPU check for a machine that
has one (the CI machine has none).

    python bench/gpu_check.py [--out DIR]

Per precision: an undisturbed run, a second undisturbed run (run-to-run determinism on the
GPU), and a run with an exception injected at step 17 that a second attempt resumes from
the checkpoint of step 10 (the shards loaded with weights_only, the CUDA RNG state
included). Printed: the three digests' agreement and the median samples/s. Exit 1 when a
digest differs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def spec_for(storage: str, job_id: str, precision: str, faults=()):
    from workers.spec import JobSpec

    spec = JobSpec.model_validate({
        "job_id": job_id, "model": "simple_cnn", "precision": precision,
        "dataset": {"name": "synthetic", "size": 4096, "noise": 2.0},
        "workers": 1, "resources": {"gpu": 1},
        "training": {"max_steps": 60, "global_batch_size": 256, "seed": 7},
        "checkpoint": {"every_steps": 10, "keep": 3},
        "faults": list(faults), "storage": storage,
    })
    os.makedirs(spec.run_dir, exist_ok=True)
    return spec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="a directory for gpu_check.json")
    args = p.parse_args()

    import torch

    from workers import events
    from workers.faults import InjectedFault
    from workers.loop import WorkerEnv, train

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here", file=sys.stderr)
        return 2
    env = WorkerEnv(rank=0, world_size=1, local_rank=0)
    rows, good = [], True
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory(prefix="etrain-gpu-") as storage:
        for precision in ("fp32", "bf16", "fp16"):
            twin = train(spec_for(storage, f"{precision}-twin", precision), env)
            again = train(spec_for(storage, f"{precision}-again", precision), env)
            faulty = spec_for(storage, f"{precision}-faulty", precision,
                              faults=[{"at_step": 17, "rank": 0, "kind": "exception"}])
            try:
                train(faulty, env)
                raise SystemExit("gpu_check: the injected fault did not fire")
            except InjectedFault:
                pass
            resumed = train(faulty, env)
            (r,) = events.events(faulty.run_dir, events.Kind.RESUMED)
            rates = [m["samples_per_s"] for m in events.metrics(os.path.join(storage, f"{precision}-twin"))][5:]
            row = {"precision": precision, "twin": twin["weights_sha256"][:16],
                   "run_to_run_equal": again["weights_sha256"] == twin["weights_sha256"],
                   "resumed_equal": resumed["weights_sha256"] == twin["weights_sha256"],
                   "resumed_from": r["from_step"], "lost_steps": r["lost_steps"],
                   "median_samples_per_s": round(statistics.median(rates))}
            good &= row["run_to_run_equal"] and row["resumed_equal"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\nprecision  run-to-run  resumed==undisturbed  from step  lost  samples/s (median)")
    for r in rows:
        print(f"{r['precision']:<10} {str(r['run_to_run_equal']):<11} {str(r['resumed_equal']):<21} "
              f"{r['resumed_from']:>9} {r['lost_steps']:>5}  {r['median_samples_per_s']:>10}")
    if args.out:
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
