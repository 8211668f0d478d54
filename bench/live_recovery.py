"""failure.mode live against exact mode and plain torchrun: the same job, side by side.

    python bench/live_recovery.py [--steps 400] [--failures 5] ...

Six runs of one job (bench/vs_torchrun.py's: simple_cnn on synthetic data, DDP on gloo):

  exact     python -m workers.run, failure.mode exact (Ray Train restarts the worker group)
  live      python -m workers.run, failure.mode live  (torchft replica groups)
  torchrun  torchrun ... bench/torchrun_worker.py

each once undisturbed (steady-state samples/s, launch to first step) and once with
crashes: exact and torchrun one (rank 1 SIGKILLed at --crash-step, as in vs_torchrun.py),
live --failures of them, spread over the run and over the ranks. Reported per system:
failure to next completed step (exact, torchrun: the `resumed` event), the survivors'
stall and the replacement's rejoin (live: the `live_recovered` events, p50 and p95),
committed steps lost or recomputed, and samples/s. Figures are printed, never asserted;
the exit code is 1 only when a run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from common import host  # noqa: E402
from vs_torchrun import (  # noqa: E402
    Run, job_spec, launch_phases, log, percent, phases_line, recovery, restart_phases, run_ray, run_torchrun, startup_s,
    throughput)

from workers import events  # noqa: E402
from workers.events import Kind  # noqa: E402
from workers.spec import JobSpec  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results", "live_recovery.txt")


def live_faults(args: argparse.Namespace) -> list[dict]:
    """--failures crashes between the warm-up and the last 20%, on ranks in turn."""
    first, last = args.warmup + 20, int(args.steps * 0.8)
    gap = (last - first) // max(1, args.failures - 1)
    return [{"at_step": first + i * gap, "rank": i % args.workers, "kind": "crash"} for i in range(args.failures)]


def make_run(args, system: str, crash: bool, storage: str, logs: str) -> Run:
    spec = job_spec(args, f"{system}-{'crash' if crash else 'clean'}", storage, crash and system != "live")
    fields = spec.model_dump(mode="json")
    fields["failure"]["max_failures"] = max(3, 2 * args.failures)
    if system == "live":
        fields["failure"]["mode"] = "live"
        fields["faults"] = live_faults(args) if crash else []
    spec = JobSpec.model_validate(fields)
    return Run(system, crash, spec, os.path.join(logs, f"{spec.job_id}.log"))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def live_figures(run: Run) -> dict:
    recovered = events.events(run.run_dir, Kind.LIVE_RECOVERED)
    steps = [m["step"] for m in events.metrics(run.run_dir)]
    stalls = [r["stall_s"] for r in recovered]
    rejoins = [r["rejoin_s"] for r in recovered if r.get("rejoin_s") is not None]
    return {
        "failures": len(events.events(run.run_dir, Kind.FAULT_INJECTED)),
        "recoveries": len(recovered),
        "restarts": len(events.events(run.run_dir, Kind.ATTEMPT_STARTED)) - 1,
        "stall_p50": pct(stalls, 0.5), "stall_p95": pct(stalls, 0.95),
        "rejoin_p50": pct(rejoins, 0.5), "rejoin_p95": pct(rejoins, 0.95),
        "survivor_steps": sum(r["survivor_steps"] for r in recovered),
        "samples_skipped": sum(r["samples_skipped"] for r in recovered),
        # Every step completed once: none lost, none recomputed.
        "steps_once": steps == list(range(1, run.spec.training.max_steps + 1)),
        "survivors_restarted": any(r["survivors_restarted"] for r in recovered),
    }


def f(value, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def report(args, runs: dict[tuple[str, bool], Run], load: tuple[list[float], list[float]]) -> tuple[str, dict]:
    systems = ("exact", "live", "torchrun")
    thr = {s: throughput(runs[(s, False)], args.warmup, args.batch) if (s, False) in runs else None for s in systems}
    start = {s: startup_s(runs[(s, False)]) if (s, False) in runs else None for s in systems}
    rec = {s: recovery(runs[(s, True)]) if (s, True) in runs else None for s in ("exact", "torchrun")}
    crashed_live = ("live", True) in runs
    # Without the live crash run (--no-crash, --systems) its figures are all empty.
    live = live_figures(runs[("live", True)]) if crashed_live else defaultdict(lambda: None)
    where = host(load[0], load[1], packages=("torch", "ray", "torchft-nightly"))
    versions = ", ".join(f"{k} {v}" for k, v in where["versions"].items())
    lines = [(f"host: {where['hostname']}, {where['usable_cores']} cores ({where['cpu']}), load "
              f"{where['load_avg_before']} -> {where['load_avg_after']}, {where['utc']}; {versions}"),
             (f"job: simple_cnn, {args.workers} workers, {args.steps} steps, batch {args.batch}, "
              f"checkpoint every {args.checkpoint_every}"), ""]
    lines.append(f"{'system':<9} {'samples/s':>10} {'launch->step1 s':>16} {'failures':>9} {'to next step s':>15} "
                 f"{'steps lost':>11} {'restarts':>9}")
    for s in systems:
        t = thr[s]["median"] if thr[s] else None
        if s == "live" and not crashed_live:
            row = ("-", "-", "-", "-")
        elif s == "live":
            row = (live["failures"], f"stall p95 {f(live['stall_p95'])}", "0" if live["steps_once"] else "?",
                   live["restarts"])
        else:
            r = rec[s] or {}
            row = ((1 if r else 0) if (s, True) in runs else "-", f(r.get("recovery_s")), r.get("lost_steps", "-"),
                   r.get("restarts", "-"))
        lines.append(f"{s:<9} {f(t, '{:.0f}'):>10} {f(start[s], '{:.1f}'):>16} {row[0]:>9} {row[1]:>15} "
                     f"{row[2]:>11} {row[3]:>9}")
    lines.append("")
    phases = {}
    for s in systems:
        if (s, False) in runs:
            phases[f"{s} launch"] = launch_phases(runs[(s, False)])
        if (s, True) in runs and s != "live":
            phases[f"{s} restart"] = restart_phases(runs[(s, True)])
    lines += [phases_line(f"{label}, s", p) for label, p in phases.items()] + [""]
    if crashed_live:
        lines.append(
            f"live: {live['recoveries']} recoveries of {live['failures']} failures; survivors' stall p50 "
            f"{f(live['stall_p50'])} s, p95 {f(live['stall_p95'])} s; failure to the replacement's first step "
            f"p50 {f(live['rejoin_p50'])} s, p95 {f(live['rejoin_p95'])} s; survivors trained "
            f"{live['survivor_steps']} steps meanwhile, {live['samples_skipped']} samples of missing groups "
            f"skipped; every step completed once: {'yes' if live['steps_once'] else 'NO'}; survivors restarted: "
            f"{'YES' if live['survivors_restarted'] else 'no'}")

    cpu = [f"{s} workers {percent(thr[s].get('workers_cpu'))}%, the rest {percent(thr[s].get('background_cpu'))}%"
           for s in systems if thr[s] and thr[s].get("workers_cpu") is not None]
    if cpu:
        lines.append("steady-state CPU, share of all cores: " + "; ".join(cpu))
    for s in systems:
        top = (thr[s] or {}).get("background_top_cpu")
        if top:
            lines.append(f"  {s}, the rest by process: "
                         + ", ".join(f"{name} {percent(share)}%" for name, share in top.items()))

    def ratio(a, b):
        return f"{a / b:.2f}x" if a and b else "-"

    e, t, lv = (thr[s]["median"] if thr[s] else None for s in ("exact", "torchrun", "live"))
    lines.append(f"goals: live stall p95 {f(live['stall_p95'])} s (<= 5 s); exact failure->next step "
                 f"{ratio((rec['exact'] or {}).get('recovery_s'), (rec['torchrun'] or {}).get('recovery_s'))} "
                 f"torchrun's (<= 1.0x); exact launch->first step {ratio(start['exact'], start['torchrun'])} "
                 f"torchrun's (<= 1.5x); live samples/s {ratio(lv, e)} exact's (>= 0.9x); exact {ratio(e, t)} "
                 f"torchrun's (>= 0.97x)")
    failed = [r.name for r in runs.values() if not r.ok]
    if failed:
        lines.append(f"failed runs (figures above still drawn from their events): {', '.join(failed)}")
    data = {"host": where, "failed": failed, "phases_s": phases, "throughput": thr, "startup_s": start,
            "recovery": rec, "live": live}
    return "\n".join(lines), data


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python bench/live_recovery.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--failures", type=int, default=5, help="crashes in the live run")
    p.add_argument("--dataset-size", type=int, default=8192)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--cpu", type=float, default=1.0)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--crash-step", type=int, default=170)
    p.add_argument("--no-spares", action="store_true", help="exact: failure.spares false (see vs_torchrun.py)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--collective-timeout", type=int, default=30)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--systems", default="exact,live,torchrun", help="comma-separated subset to run")
    p.add_argument("--no-crash", action="store_true", help="the undisturbed runs only (steady state, launch)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="etrain-live-bench-")
    storage, logs = os.path.join(workdir, "runs"), os.path.join(workdir, "logs")
    for d in (storage, logs, os.path.join(workdir, "specs")):
        os.makedirs(d)
    runs: dict[tuple[str, bool], Run] = {}
    load_before = list(os.getloadavg())
    for crash in (False,) if args.no_crash else (False, True):
        for system in args.systems.split(","):
            run = make_run(args, system, crash, storage, logs)
            log(f"{run.name} ...")
            (run_torchrun if system == "torchrun" else run_ray)(run, workdir, args)
            log(f"{run.name}: rc {run.rc}, {run.wall_s:.0f}s")
            runs[(system, crash)] = run
    failed = [r.name for r in runs.values() if not r.ok]
    table, data = report(args, runs, (load_before, list(os.getloadavg())))
    print(table, flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as out:
        out.write(table + "\n")
    with open(os.path.splitext(args.out)[0] + ".json", "w") as out:
        json.dump(data, out, indent=1, default=str)
    if failed:
        print(f"failed runs: {', '.join(failed)}; logs in {logs}", flush=True)
        return 1
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
