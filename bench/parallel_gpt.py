"""gpt under each parallel strategy on 1, 2 and 4 workers: torchrun, gloo, CPU.

    python bench/parallel_gpt.py [--quick] [--workers 1 2 4] [--strategies ddp fsdp ...]

Every configuration that exists for a worker count runs twice under torchrun (the
launcher of bench/vs_torchrun.py, one process per worker, workers.loop.train): once with
checkpoints written in the foreground, once with parallel.async_checkpoint (not for ddp,
which has no background path). Reported per row, all read from the run directories:
samples/s and speed-up over 1 worker, the share of step time in gloo collectives and
peak memory per worker (sync run, ETRAIN_PROFILE_STEPS), and checkpoint save times.
ddp-bf16 is ddp in bf16 autocast: against ddp on as many workers, what mixed precision buys.

The table goes to --out (a .txt), the same rows as JSON next to it (.json), which
`etrain report` draws.

Timings are reported, never asserted. The exit code is 1 only when a run fails.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import signal
import statistics
import sys
import tempfile
import textwrap
import time
import uuid
from dataclasses import dataclass

from common import clean, finish, host  # bench/ is sys.path[0] when run as a script
from pydantic import ValidationError
from vs_torchrun import ROOT, Run, _f, log, run_torchrun  # puts the repository root on sys.path

from workers import events
from workers.events import Kind
from workers.spec import JobSpec, absolute_paths

RESULTS = os.path.join(ROOT, "bench", "results", "parallel_gpt.txt")
QUICK_RESULTS = os.path.join(ROOT, "bench", "results", "parallel_gpt.quick.txt")  # never clobbers real figures
PROFILE_ENV = "ETRAIN_PROFILE_STEPS"  # workers.profiling.ENV, named here so the bench need not import torch

# name: (strategy, parallel degrees, layout with w workers and d = w // 2 data-parallel groups)
CONFIGS = {
    "ddp": ("ddp", {}, "dp{w}"),
    "fsdp": ("fsdp", {}, "shard{w}"),
    "tensor": ("tensor", {}, "tp{w}"),
    "pipeline-1f1b": ("pipeline", {"schedule": "1f1b"}, "pp{w}"),
    "pipeline-gpipe": ("pipeline", {"schedule": "gpipe"}, "pp{w}"),
    "dp-tp": ("hybrid", {"tensor": 2}, "dp{d} x tp2"),
    "dp-pp": ("hybrid", {"pipeline": 2}, "dp{d} x pp2"),
    "hsdp": ("hybrid", {"shard": 2}, "rep{d} x shard2"),
    "ddp-bf16": ("ddp", {}, "dp{w}"),
}
# Configurations that train in something other than fp32 (autocast, fp32 weights): ddp-bf16
# against ddp on the same worker count is what mixed precision buys.
PRECISION = {"ddp-bf16": "bf16"}


@dataclass(frozen=True)
class Size:
    layers: int
    width: int
    heads: int
    context: int
    batch: int
    steps: int
    every: int  # checkpoint every N steps
    warmup: int  # first steps left out of samples/s
    profile: tuple[int, int]  # steps run under torch.profiler: between checkpoints, left out of samples/s
    samples: int = 2048
    vocab: int = 256


# Big enough that matmuls, not Python, fill a step; small enough for 4 processes on 2 cores.
FULL = Size(layers=4, width=128, heads=4, context=64, batch=32, steps=40, every=10, warmup=5, profile=(11, 19))
QUICK = Size(layers=4, width=32, heads=4, context=16, batch=16, steps=12, every=4, warmup=2, profile=(5, 7))


def params(s: Size) -> int:
    block = 12 * s.width**2 + 13 * s.width  # q, k, v, o, fc1, fc2 with biases, two LayerNorms
    return (2 * s.vocab + s.context) * s.width + s.layers * block + 2 * s.width


def job_spec(size: Size, name: str, workers: int, background: bool, job_id: str, storage: str) -> JobSpec:
    strategy, degrees, _ = CONFIGS[name]
    return absolute_paths(JobSpec.model_validate({
        "job_id": job_id,
        "model": {"name": "gpt", "layers": size.layers, "width": size.width, "heads": size.heads,
                  "context": size.context},
        "dataset": {"name": "synthetic_tokens", "size": size.samples, "vocab_size": size.vocab},
        "strategy": strategy,
        "precision": PRECISION.get(name, "fp32"),
        "parallel": {**degrees, "async_checkpoint": background},
        "workers": workers,
        "resources": {"cpu": 1},
        "training": {"max_steps": size.steps, "global_batch_size": size.batch, "seed": 0},
        "checkpoint": {"every_steps": size.every, "keep": 2},
        "storage": storage,
    }))


def why_not(size: Size, name: str, workers: int) -> str | None:
    """Why the configuration has no form with this many workers (the spec's own check), or None."""
    try:
        job_spec(size, name, workers, False, "check", ROOT)
    except ValidationError as e:
        return e.errors()[0]["msg"].removeprefix("Value error, ")
    return None


def reap(spec_path: str) -> None:
    """torchrun starts its workers in sessions of their own, so ending its process group
    on a timeout can miss them: end any process still running this run's spec file
    (a path unique to this bench invocation)."""
    needle = spec_path.encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            os.kill(int(pid), signal.SIGKILL)
        except OSError:  # gone already, or not ours to read
            continue


def launch(run: Run, workdir: str, args: argparse.Namespace, profile: str | None) -> None:
    # run_torchrun hands the workers this process's environment.
    if profile:
        os.environ[PROFILE_ENV] = profile
    try:
        run_torchrun(run, workdir, args)
    finally:
        os.environ.pop(PROFILE_ENV, None)
        reap(os.path.join(workdir, "specs", f"{run.spec.job_id}.json"))


# --------------------------------------------------------------------------- measures


def measure(run: Run, size: Size) -> dict:
    committed = events.events(run.run_dir, Kind.CHECKPOINT_COMMITTED)
    ckpt_steps = {c["step"] for c in committed}
    first, last = size.profile
    rates = [m["samples_per_s"] for m in events.metrics(run.run_dir)
             if m.get("attempt") == 1 and m["step"] > size.warmup and m["step"] not in ckpt_steps
             and not first <= m["step"] <= last]
    ranks = events.events(run.run_dir, Kind.WORKER_FINISHED)
    shares = [r["comm_s"] / r["profiled_wall_s"] for r in ranks if r.get("profiled_wall_s")]
    # The last step's checkpoint is always written in the foreground, even with async on.
    saves = [c for c in committed if c["step"] < size.steps]
    return {
        "rate": statistics.median(rates) if rates else None,
        "steps": len(rates),
        "comm_mean": 100 * statistics.mean(shares) if shares else None,
        "comm_max": 100 * max(shares) if shares else None,
        "rss": max((r["peak_rss_mb"] for r in ranks), default=None),
        "blocked": statistics.median(c["blocked_s"] for c in saves) if saves else None,
        "save": statistics.median(c["save_s"] for c in saves) if saves else None,
    }


# --------------------------------------------------------------------------- report


COLUMNS = [("config", "<15"), ("workers", ">7"), ("layout", ">16"), ("samples/s", ">10"), ("speed-up", ">9"),
           ("comm % mean", ">12"), ("max", ">5"), ("peak RSS MB", ">12"), ("ckpt blocked s sync", ">20"),
           ("async", ">7"), ("async save s", ">13")]


def line(cells: list[str]) -> str:
    return "  ".join(f"{c:{fmt}}" for c, (_, fmt) in zip(cells, COLUMNS)).rstrip()


def report(args, size: Size, results: dict, skipped: dict, load: tuple, wall_s: float) -> tuple[str, dict]:
    """The table, and the same rows as data (bench/results/*.json, read by service/report.py)."""
    torch_version = importlib.metadata.version("torch")
    first, last = size.profile
    ddp1 = (results.get(("ddp", 1)) or {}).get("sync")
    rows, failed, fallback, data_rows = [], [], False, []
    for name in args.strategies:
        ref, mark = ((results.get((name, 1)) or {}).get("sync"), "") if not why_not(size, name, 1) else (ddp1, "*")
        fallback |= bool(mark)
        for w in args.workers:
            cells = [name, str(w), CONFIGS[name][2].format(w=w, d=w // 2)]
            row = {"config": name, "strategy": CONFIGS[name][0], "precision": PRECISION.get(name, "fp32"),
                   "workers": w, "layout": cells[2], "status": "ok"}
            if (name, w) in skipped:
                rows.append(line(cells[:2] + ["-"] * 9))
                data_rows.append({**row, "layout": None, "status": "not applicable", "why": skipped[(name, w)]})
                continue
            if (name, w) not in results:  # interrupted before it ran
                continue
            sync, back = results[(name, w)].get("sync"), results[(name, w)].get("async")
            for label, m in (("sync", sync), ("async", back)):
                if m and not m["ok"]:
                    failed.append(f"{name} {w}w {label}: {m['error']} (log {m['log']})")
            if not (sync and sync["ok"]):
                rows.append(line(cells + ["FAILED"] + ["-"] * 7))
                data_rows.append({**row, "status": "failed"})
                continue
            speedup = (f"{sync['rate'] / ref['rate']:.2f}{mark}"
                       if ref and ref.get("ok") and ref["rate"] and sync["rate"] else "-")
            ok_back = back if back and back["ok"] else None
            data_rows.append({
                **row, "samples_per_s": sync["rate"],
                "speedup": sync["rate"] / ref["rate"] if speedup != "-" else None,
                "speedup_over": ("ddp 1 worker" if mark else f"{name} 1 worker") if speedup != "-" else None,
                "comm_pct_mean": sync["comm_mean"], "comm_pct_max": sync["comm_max"],
                "peak_rss_mb": sync["rss"], "ckpt_blocked_sync_s": sync["blocked"],
                "ckpt_blocked_async_s": ok_back and ok_back["blocked"],
                "async_save_s": ok_back and ok_back["save"],
                **({"status": "async failed"} if back and not ok_back else {}),
            })
            rows.append(line(cells + [
                _f(sync["rate"]), speedup, _f(sync["comm_mean"], "{:.0f}"), _f(sync["comm_max"], "{:.0f}"),
                _f(sync["rss"], "{:.0f}"), _f(sync["blocked"], "{:.3f}"),
                "FAILED" if back and not ok_back else _f(ok_back and ok_back["blocked"], "{:.3f}"),
                _f(ok_back and ok_back["save"], "{:.3f}"),
            ]))
    cores = os.cpu_count() or 1
    most = max(args.workers)
    note = (f"NOTE: {most} worker processes share {cores} cores: the CPU is oversubscribed, so a speed-up above "
            f"{min(most, cores)}x is impossible here and the figures mostly show each strategy's overheads. "
            "The table is the method; a GPU machine gives the real figures.")
    text = [
        "gpt under each parallel strategy: torchrun, gloo, CPU, 1 thread per worker (workers.loop.train)"
        + (" -- QUICK MODE, a smoke test: tiny model, figures meaningless" if args.quick else ""),
        f"job: gpt {size.layers} layers, width {size.width}, {size.heads} heads, context {size.context} "
        + f"({params(size) / 1e6:.2f}M params); synthetic_tokens {size.samples} samples, vocab {size.vocab}; "
        + f"global batch {size.batch}, {size.steps} steps, adam fp32"
        + "".join(f" ({n}: {p} autocast, fp32 weights)" for n, p in PRECISION.items() if n in args.strategies)
        + f", checkpoint every {size.every}, seed 0",
        f"host: {platform.node()}, {cores} cores, python {platform.python_version()}, torch {torch_version}; "
        + f"load avg {load[0]:.2f} before, {load[1]:.2f} after; {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; "
        + f"bench wall time {wall_s / 60:.1f} min",
        *([textwrap.fill(note, 110)] if most > cores else []),
        "",
        line([c for c, _ in COLUMNS]),
        *rows,
        "",
    ]
    # One line per reason the spec gave (its first clause), not one per configuration.
    reasons: dict[str, list[str]] = {}
    for (name, w), why in skipped.items():
        reasons.setdefault(why.split(":")[0], []).append(f"{name} on {w} worker{'s' * (w > 1)}")
    gone = [f"{', '.join(names)}: {why} (the spec's check)" for why, names in reasons.items()]
    footnotes = [
        ("samples/s", ("median over steady steps of global batch / step_s (rank 0's metrics.jsonl, sync run): "
                       f"steps after the first {size.warmup}, leaving out checkpoint steps and the profiled steps "
                       f"{first}-{last}")),
        ("speed-up", "samples/s over the same configuration on 1 worker"
                     + ("; * over ddp on 1 worker, where the configuration has no 1-worker form" if fallback else "")),
        ("comm %", (f"per rank, time covered by gloo:* profiler ranges (overlapping ranges, such as a "
                    f"pipeline's sends and receives in flight together, counted once) / wall time of steps "
                    f"{first}-{last} ({PROFILE_ENV}={first}:{last}, sync run); mean and max over ranks. On CPU a "
                    "collective's time includes waiting for slower peers")),
        ("peak RSS MB", ("largest per-worker process peak RSS (ru_maxrss) of the sync run; it includes the Python "
                         "and torch runtime, so compare rows rather than read it as model memory")),
        ("ckpt blocked", ("median over the checkpoints before the last step of how long training waited for one: "
                          "sync run, then async run (parallel.async_checkpoint: staging copy to CPU memory, rng "
                          "shard, commit barrier). The last step's checkpoint is always written in the foreground")),
        ("async save s", ("median save_s of the async run: from the start of the save until the checkpoint was "
                          "sealed, while training went on")),
        ("-", "; ".join(["not applicable. ddp: no background checkpoint path", *gone])),
    ]
    text += [textwrap.fill(body, 110, initial_indent=f"{key:<14}", subsequent_indent=" " * 14,
                           break_on_hyphens=False)
             for key, body in footnotes]
    if failed:
        text += ["", "FAILED runs:", *failed]
    data = {
        "bench": "parallel_gpt",
        "quick": bool(args.quick),
        "host": {**host([load[0]], [load[1]]), "wall_s": round(wall_s, 1)},
        "job": {**size.__dict__, "profile": list(size.profile), "params": params(size), "optimizer": "adam"},
        "oversubscribed": most > cores,
        "note": note if most > cores else None,
        "footnotes": dict(footnotes),
        "rows": [{k: clean(v) for k, v in r.items()} for r in data_rows],
        "failed": failed,
    }
    return "\n".join(text) + "\n", data


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/parallel_gpt.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model and few steps: a smoke test of the bench")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="worker counts")
    p.add_argument("--strategies", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), metavar="NAME",
                   help=f"configurations, of {', '.join(CONFIGS)}")
    p.add_argument("--timeout", type=float, default=600, help="seconds before a run is killed")
    p.add_argument("--keep", action="store_true", help="keep the run directories (kept anyway when a run fails)")
    p.add_argument("--out", help="where the table is written, its JSON next to it "
                                 f"(None: {os.path.relpath(RESULTS, ROOT)}, "
                                 f"{os.path.relpath(QUICK_RESULTS, ROOT)} with --quick)")
    p.add_argument("-v", "--verbose", action="store_true", help="echo every run's output")
    args = p.parse_args(argv)
    args.workers = sorted(set(args.workers))
    if min(args.workers) < 1:
        p.error("--workers must be at least 1")
    args.out = args.out or (QUICK_RESULTS if args.quick else RESULTS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    size = QUICK if args.quick else FULL
    workdir = tempfile.mkdtemp(prefix="etrain-pgpt-")
    for sub in ("runs", "specs", "logs"):
        os.makedirs(os.path.join(workdir, sub))
    tag = uuid.uuid4().hex[:6]
    results: dict[tuple[str, int], dict] = {}
    skipped: dict[tuple[str, int], str] = {}
    good = True
    started, load_before = time.monotonic(), os.getloadavg()[0]
    log(f"work dir {workdir}")
    try:
        for name in args.strategies:
            for w in args.workers:
                why = why_not(size, name, w)
                if why:
                    skipped[(name, w)] = why
                    log(f"{name} {w}w: skipped: {why}")
                    continue
                results[(name, w)] = {}
                for mode in ("sync",) if CONFIGS[name][0] == "ddp" else ("sync", "async"):
                    job_id = f"pgpt-{name}-{w}w-{mode}-{tag}"
                    spec = job_spec(size, name, w, mode == "async", job_id, os.path.join(workdir, "runs"))
                    run = Run("torchrun", False, spec, os.path.join(workdir, "logs", f"{job_id}.log"))
                    log(f"{name} {w}w {mode}: starting")
                    launch(run, workdir, args, f"{size.profile[0]}:{size.profile[1]}" if mode == "sync" else None)
                    m = {"ok": run.ok, "log": run.log_path, "error": (run.summary or {}).get("error"),
                         **measure(run, size)}
                    results[(name, w)][mode] = m
                    log(f"{name} {w}w {mode}: {'ok' if run.ok else 'FAILED'} in {run.wall_s:.1f}s, "
                        f"median {_f(m['rate'], '{:.0f}')} samples/s over {m['steps']} steps, "
                        f"ckpt blocked {_f(m['blocked'], '{:.3f}')}s")
                    if not run.ok:
                        good = False
                        with open(run.log_path, errors="replace") as f:
                            print(f.read()[-4000:].rstrip() + "\n", flush=True)
    except KeyboardInterrupt:
        good = False
        log("interrupted; reporting what finished")
    text, data = report(args, size, results, skipped, (load_before, os.getloadavg()[0]), time.monotonic() - started)
    return finish(text, args.out, workdir, keep=args.keep, good=good, data=data)


if __name__ == "__main__":
    sys.exit(main())
