"""elastic-train (Ray Train) against plain torchrun: same model, data, workers and loop.

    python bench/vs_torchrun.py [--steps 5000] [--dataset-size 8192] ...   (or ./run bench)

Four jobs, each in its own run directory under a temporary storage root:

  ray       python -m workers.run SPEC            (a local Ray, started by workers.run)
  torchrun  torchrun ... bench/torchrun_worker.py (DDP on gloo, rendezvous on 127.0.0.1)

each once undisturbed and once with rank 1 SIGKILLed at --crash-step (torchrun with
--max-restarts 1). Both run workers.loop.train, so both write the same metrics.jsonl
and events.jsonl; everything below is read from those files.

Reported: steady-state samples/s (attempt 1, after --warmup steps; median of the per-step
rate, and the rate over the summed step time and over the wall-clock span), the same over
the steps after Ray's warm spares finished booting (a one-time cost of every start, which
a 2-core host pays out of the workers' cores), their ratio, recovery seconds after the crash (failure -> next completed step, from the `resumed`
event, split into failure -> group restarted -> first step), steps recomputed, and
whether each recovered run ends with the same weights as its undisturbed twin. The table
goes to --out (a .txt), the same figures as JSON next to it (.json), which `etrain report` draws.

Timings are reported, never asserted: on a busy machine they are noisy. The exit code is
1 only when a run fails or a recovered run's weights differ from its undisturbed twin.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from workers import events  # noqa: E402  (light: no torch, no ray)
from workers.events import Kind  # noqa: E402
from workers.run import prepare_run_dir, summarize  # noqa: E402
from workers.spec import JobSpec, absolute_paths  # noqa: E402

from common import clean, finish, host  # bench/ is sys.path[0] when run as a script
from cpu_share import CpuSampler

WORKER = os.path.join(ROOT, "bench", "torchrun_worker.py")
CORES = len(os.sched_getaffinity(0))
RESULTS = os.path.join(ROOT, "bench", "results", "vs_torchrun.txt")
SYSTEMS = ("ray", "torchrun")


def log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


# --------------------------------------------------------------------------- specs


def job_spec(args: argparse.Namespace, job_id: str, storage: str, crash: bool) -> JobSpec:
    faults = [{"at_step": args.crash_step, "rank": 1, "kind": "crash"}] if crash else []
    return absolute_paths(JobSpec.model_validate({
        "job_id": job_id,
        "model": "simple_cnn",
        "dataset": {"name": "synthetic", "size": args.dataset_size},
        "workers": args.workers,
        "resources": {"cpu": args.cpu},
        "training": {"max_steps": args.steps, "global_batch_size": args.batch, "seed": args.seed},
        "checkpoint": {"every_steps": args.checkpoint_every, "keep": 3},
        "failure": {"max_failures": 3, "collective_timeout_s": args.collective_timeout, "spares": not args.no_spares},
        "faults": faults,
        "storage": storage,
    }))


# --------------------------------------------------------------------------- processes


@dataclass
class Run:
    system: str
    crash: bool
    spec: JobSpec
    log_path: str
    rc: int | None = None
    wall_s: float = 0.0
    timed_out: bool = False
    summary: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    cpu: CpuSampler = field(default_factory=CpuSampler)
    spawned: float | None = None  # epoch seconds the bench started the command

    @property
    def name(self) -> str:
        return f"{self.system}-{'crash' if self.crash else 'clean'}"

    @property
    def run_dir(self) -> str:
        return self.spec.run_dir

    @property
    def ok(self) -> bool:
        return self.rc == 0 and bool(self.summary) and self.summary.get("status") == "succeeded"


def _kill_group(proc: subprocess.Popen) -> None:
    """End the process group this bench started for one run (its own session), nothing else."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_logged(cmd: list[str], env: dict[str, str], log_path: str, timeout: float, echo: bool,
               cpu: CpuSampler | None = None, run: Run | None = None) -> tuple[int, float, bool]:
    """Run `cmd` in its own session, output to `log_path` (and stdout with echo); `cpu`
    samples its process tree while it runs; `run` gets the instant it was started."""
    started = time.monotonic()
    if run is not None:
        run.spawned = time.time()
    timed_out = threading.Event()
    with open(log_path, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)
        if cpu is not None:
            cpu.start(proc.pid)

        def expire() -> None:
            timed_out.set()
            _kill_group(proc)

        timer = threading.Timer(timeout, expire)
        timer.start()
        try:
            for line in proc.stdout:
                out.write(line)
                if echo:
                    sys.stdout.write("    " + line)
                    sys.stdout.flush()
            rc = proc.wait()
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            timer.cancel()
            if cpu is not None:
                cpu.stop()
    return rc, time.monotonic() - started, timed_out.is_set()


def last_summary(log_path: str) -> dict[str, Any] | None:
    with open(log_path, errors="replace") as f:
        for line in reversed(f.read().splitlines()):
            if line.startswith("{") and '"job_id"' in line:
                try:
                    return json.loads(line)
                except ValueError:
                    return None
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ray(run: Run, workdir: str, args: argparse.Namespace) -> None:
    spec_path = os.path.join(workdir, "specs", f"{run.spec.job_id}.json")
    with open(spec_path, "w") as f:
        f.write(run.spec.model_dump_json(indent=1))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": ROOT}
    # A fresh local Ray for every job, never someone else's cluster: without an address,
    # ray.init() joins the cluster a `ray start` recorded in $RAY_TMPDIR/ray/ray_current_cluster,
    # so give the job a temp dir of its own (short: Ray's socket paths must fit 107 bytes).
    env.pop("RAY_ADDRESS", None)
    ray_tmp = tempfile.mkdtemp(prefix="etb-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
    env["RAY_TMPDIR"] = ray_tmp
    cmd = [sys.executable, "-m", "workers.run", spec_path]
    run.rc, run.wall_s, run.timed_out = run_logged(cmd, env, run.log_path, args.timeout, args.verbose, run.cpu, run)
    run.summary = last_summary(run.log_path)
    if args.keep or not run.ok:
        run.notes.append(f"Ray logs in {ray_tmp}")
    else:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def run_torchrun(run: Run, workdir: str, args: argparse.Namespace) -> None:
    spec = run.spec
    spec_path = os.path.join(workdir, "specs", f"{spec.job_id}.json")
    with open(spec_path, "w") as f:
        f.write(spec.model_dump_json(indent=1))
    prepare_run_dir(spec)  # what workers.run does before it starts Ray
    events.emit(spec.run_dir, events.JobStarted(pid=os.getpid(), launcher="torchrun"))
    port = free_port()
    threads = str(max(1, int(spec.resources.cpu)))
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": threads,
           # gloo picks its interface from the hostname unless told; keep it on loopback.
           "GLOO_SOCKET_IFNAME": "lo",
           # By default the agent shares its rendezvous TCPStore with the workers and keeps it
           # across restarts without a per-attempt key prefix: the restarted group then reads
           # the dead group's gloo addresses and init_process_group ends in "connectFullMesh
           # failed ... Connect timeout" (pytorch/pytorch#135712). A store per attempt avoids it.
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run",  # the `torchrun` console script
           "--nnodes", "1", "--nproc-per-node", str(spec.workers),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", spec.job_id,
           "--local-addr", "127.0.0.1", "--max-restarts", str(1 if run.crash else 0),
           WORKER, spec_path]
    run.rc, run.wall_s, run.timed_out = run_logged(cmd, env, run.log_path, args.timeout, args.verbose, run.cpu, run)
    error = None if run.rc == 0 else f"torchrun exited with {run.rc}" + (" (timed out)" if run.timed_out else "")
    run.summary = summarize(spec, run.wall_s, error)
    masters = []
    with open(run.log_path, errors="replace") as f:
        for line in f:
            if "[bench-worker] rank 0: master " in line:
                masters.append(line.split("master ", 1)[1].split(" ", 1)[0])
    if masters:
        run.notes.append("torchrun master " + ", ".join(dict.fromkeys(masters)))


# --------------------------------------------------------------------------- analysis


def throughput(run: Run, warmup: int, batch: int) -> dict[str, float] | None:
    """Steady state of attempt 1, after the warm-up steps."""
    ms = [m for m in events.metrics(run.run_dir) if m.get("attempt") == 1 and m.get("step", 0) > warmup]
    if len(ms) < 2:
        return None
    ms.sort(key=lambda m: m["step"])
    span = ms[-1]["time"] - ms[0]["time"]
    return {
        "median": statistics.median(m["samples_per_s"] for m in ms),
        "step_time": len(ms) * batch / sum(m["step_s"] for m in ms),
        # Between the first and last logged step: includes checkpoints and logging too.
        "wall": (len(ms) - 1) * batch / span if span > 0 else float("nan"),
        "steps": len(ms),
        "first": ms[0]["step"],
        "last": ms[-1]["step"],
        # Shares of the whole machine over the same steps: what the background took from the workers.
        **{f"{k}_cpu": v for k, v in (run.cpu.share(ms[0]["time"], ms[-1]["time"], CORES) or {}).items()
           if k != "window_s"},
    }


def spares_warm_step(run: Run) -> int | None:
    """The first step after Ray's warm spares for a restart (failure.spares) finished
    booting and importing: they are asked for once the workers train, and import torch
    at idle priority on the cores the workers train on, a one-time cost per (re)start."""
    ms = sorted((m for m in events.metrics(run.run_dir) if m.get("attempt") == 1), key=lambda m: m["step"])
    if not ms:
        return None
    quiet = run.cpu.last_busy("ray::IDLE", after=ms[0]["time"])
    if quiet is None:
        return None
    return next((m["step"] for m in ms if m["time"] > quiet), None)


def startup_s(run: Run) -> float | None:
    """The command started -> first completed step. From the bench starting the command
    (`python -m workers.run` or torchrun), so that both systems' interpreter start and
    imports count: the job's own job_started event came after the Ray driver's imports."""
    started = run.spawned
    first = min((m["time"] for m in events.metrics(run.run_dir) if m.get("attempt") == 1), default=None)
    return first - started if started is not None and first is not None else None


def recovery(run: Run) -> dict[str, Any] | None:
    resumed = events.events(run.run_dir, Kind.RESUMED)
    if not resumed:
        return None
    r = resumed[0]
    out = {k: r.get(k) for k in ("recovery_s", "lost_steps", "from_step", "reached_step", "failed_rank", "cause")}
    fault = next(iter(events.events(run.run_dir, Kind.FAULT_INJECTED)), None)
    attempt = next((a for a in events.events(run.run_dir, Kind.ATTEMPT_STARTED) if a.get("attempt") == r.get("attempt")), None)
    if fault and attempt:
        out["to_restart_s"] = attempt["time"] - fault["time"]  # detection + new worker group + rendezvous
        out["to_step_s"] = r["time"] - attempt["time"]  # imports, data, checkpoint load, DDP, first step
    out["restarts"] = len(events.events(run.run_dir, Kind.ATTEMPT_STARTED)) - 1
    return out


def _phases(points: list[tuple[str, float | None]]) -> dict[str, float] | None:
    """Consecutive differences of named instants, in time order; a phase whose instant
    is unknown is folded into the next known one (so the phases always add up to the whole)."""
    known = sorted(((name, t) for name, t in points if t is not None), key=lambda p: p[1])
    if len(known) < 2:
        return None
    return {name: round(t - prev, 3) for (_, prev), (name, t) in zip(known, known[1:])}


def _started(run: Run, attempt: int) -> list[dict]:
    return [w for w in events.events(run.run_dir, Kind.WORKER_STARTED) if w.get("attempt") == attempt]


def _latest(values) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def warm_starts(run: Run) -> str | None:
    """How many of the restarted workers started in a warm spare: a process that was
    up before the fault."""
    fault = next(iter(events.events(run.run_dir, Kind.FAULT_INJECTED)), None)
    resumed = next(iter(events.events(run.run_dir, Kind.RESUMED)), None)
    if not fault or not resumed:
        return None
    workers = _started(run, resumed["attempt"])
    warm = [w for w in workers if (w.get("process_started") or math.inf) < fault["time"]]
    return f"{len(warm)}/{len(workers)}"


def restart_phases(run: Run) -> dict[str, float] | None:
    """Where a restart's seconds went, failure to the next completed step. The slowest
    worker gates each phase, so each instant is the last worker's."""
    resumed = next(iter(events.events(run.run_dir, Kind.RESUMED)), None)
    fault = next(iter(events.events(run.run_dir, Kind.FAULT_INJECTED)), None)
    if not resumed or not fault:
        return None
    failed = [f for f in events.events(run.run_dir, Kind.WORKER_FAILED) if f["time"] >= fault["time"]]
    # A worker that started in a warm spare (failure.spares) was booted before the fault:
    # its process start is no phase of this restart.
    workers = [{**w, "process_started": w.get("process_started") if (w.get("process_started") or 0) > fault["time"]
                else None} for w in _started(run, resumed["attempt"])]
    return _phases([
        ("fault", fault["time"]),
        # A survivor's collective failed on the dead peer (its own worker_failed).
        ("peers noticed", next((f["time"] for f in failed if not f.get("process_died")), None)),
        # Ray Train's controller saw the dead process (torchrun writes no such event).
        ("controller noticed", next((f["time"] for f in failed if f.get("process_died")), None)),
        # Old group torn down, new placement group and actors scheduled, processes forked.
        ("processes started", _latest(w.get("process_started") for w in workers)),
        # Interpreter and Ray worker boot, imports, the train context, the process group.
        ("process group up", _latest(w.get("ready") for w in workers)),
        # The task, its data and model, the strategy.
        ("task built", _latest(w["time"] for w in workers)),
        # The checkpoint read and the first step trained.
        ("first step", resumed["time"]),
    ])


def launch_phases(run: Run) -> dict[str, float] | None:
    """Where launch to first step went (the undisturbed run)."""
    started = run.spawned
    job = next(iter(events.events(run.run_dir, Kind.JOB_STARTED)), None)
    first = min((m["time"] for m in events.metrics(run.run_dir) if m.get("attempt") == 1), default=None)
    if started is None or first is None:
        return None
    workers = _started(run, 1)
    return _phases([
        ("launch", started),
        # The launcher's interpreter and imports (Ray's driver: ray, torch, ray.train).
        ("job started", job["time"] if job and job["time"] > started else None),
        # Cluster (Ray: ray.init starts one; torchrun: the agent), controller, placement group.
        ("processes started", _latest(w.get("process_started") for w in workers)),
        ("process group up", _latest(w.get("ready") for w in workers)),
        ("task built", _latest(w["time"] for w in workers)),
        ("first step", first),
    ])


def launch_cpu(run: Run) -> dict[str, float] | None:
    """CPU seconds by process from launch to the first step (the undisturbed run)."""
    first = min((m["time"] for m in events.metrics(run.run_dir) if m.get("attempt") == 1), default=None)
    return run.cpu.since_start(first) if first is not None else None


def phases_line(label: str, phases: dict[str, float] | None) -> str:
    if not phases:
        return f"{label}: -"
    return f"{label}: " + ", ".join(f"-> {name} {s:.2f}" for name, s in phases.items()) + \
        f" (total {sum(phases.values()):.2f} s)"


def digest(run: Run) -> str | None:
    finished = events.events(run.run_dir, Kind.FINISHED)
    return finished[-1].get("weights_sha256") if finished else None


# --------------------------------------------------------------------------- report


def _f(value: Any, fmt: str = "{:.1f}") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value != value:
        return "-"
    return fmt.format(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def percent(share: float | None) -> str | None:
    return None if share is None else f"{100 * share:.1f}"


def _ratio(a: Any, b: Any) -> str:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b and a == a and b == b:
        return f"{a / b:.2f}"
    return "-"


def report(args: argparse.Namespace, runs: dict[tuple[str, bool], Run], load: tuple[list[float], list[float]],
           versions: dict[str, str]) -> tuple[str, bool, dict]:
    """The table, whether every run passed, and the same figures as data (for service/report.py)."""
    thr = {s: throughput(runs[(s, False)], args.warmup, args.batch) if (s, False) in runs else None for s in SYSTEMS}
    # The same steps on both sides, once Ray's spares are warm: what training costs after
    # their one-time boot, the state of a job that runs longer than this bench.
    warm = spares_warm_step(runs[("ray", False)]) if ("ray", False) in runs else None
    warm = warm if warm and args.warmup < warm < args.steps - 1 else None
    thr_warm = {s: throughput(runs[(s, False)], warm - 1, args.batch) if warm and (s, False) in runs else None
                for s in SYSTEMS}
    rec = {s: recovery(runs[(s, True)]) if (s, True) in runs else None for s in SYSTEMS}
    sha = {(s, c): digest(r) for (s, c), r in runs.items()}
    wall = {(s, c): r.wall_s for (s, c), r in runs.items()}

    def row(label: str, ray: Any, tr: Any, fmt: str = "{:.1f}", ratio: bool = True) -> str:
        return f"{label:<46}{_f(ray, fmt):>12}{_f(tr, fmt):>12}{(_ratio(ray, tr) if ratio else ''):>14}"

    def get(d: dict | None, key: str) -> Any:
        return d.get(key) if d else None

    steady = thr["ray"] or thr["torchrun"]
    window = f"steps {steady['first']}-{steady['last']}" if steady else "-"
    lines = [
        "elastic-train (Ray Train) vs torchrun: the same loop (workers.loop.train), DDP on gloo, CPU",
        f"job: simple_cnn, synthetic {args.dataset_size} samples, {args.workers} workers x {args.cpu:g} CPU, "
        f"global batch {args.batch}, {args.steps} steps, checkpoint every {args.checkpoint_every}, seed {args.seed}",
        f"fault: rank 1 SIGKILLed at step {args.crash_step} (Ray Train max_failures 3, torchrun --max-restarts 1); "
        f"Ray's warm spares {'off' if args.no_spares else 'on'}",
        f"host: {platform.node()}, {os.cpu_count()} cores, python {platform.python_version()}, "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + f"; load avg {load[0][0]:.2f} before, {load[1][0]:.2f} after; {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"steady state: attempt 1 of the undisturbed runs, {window} (first {args.warmup} skipped)",
        "",
        f"{'':<46}{'ray train':>12}{'torchrun':>12}{'ray/torchrun':>14}",
        row("steady samples/s, median of steps", get(thr["ray"], "median"), get(thr["torchrun"], "median")),
        row("steady samples/s, over summed step time", get(thr["ray"], "step_time"), get(thr["torchrun"], "step_time")),
        row("steady samples/s, wall clock (+ckpt, report)", get(thr["ray"], "wall"), get(thr["torchrun"], "wall")),
        *([row(f"  median, steps {warm}-{args.steps} (spares warm)", get(thr_warm["ray"], "median"),
                get(thr_warm["torchrun"], "median")),
           row(f"  over summed step time, steps {warm}-{args.steps}", get(thr_warm["ray"], "step_time"),
               get(thr_warm["torchrun"], "step_time"))] if warm else []),
        row("steady CPU: workers, % of all cores", *(percent(get(thr[s], "workers_cpu")) for s in SYSTEMS), "{}",
            ratio=False),
        row("steady CPU: the rest of the run, % of all cores",
            *(percent(get(thr[s], "background_cpu")) for s in SYSTEMS), "{}", ratio=False),
        row("startup: launch -> first step (s)", *(startup_s(runs[(s, False)]) if (s, False) in runs else None
                                                    for s in SYSTEMS)),
        row("job wall time, undisturbed (s)", wall.get(("ray", False)), wall.get(("torchrun", False))),
        row("job wall time, with crash (s)", wall.get(("ray", True)), wall.get(("torchrun", True))),
        row("recovery_s: failure -> next completed step", get(rec["ray"], "recovery_s"), get(rec["torchrun"], "recovery_s"), "{:.2f}"),
        row("  failure -> next attempt_started event (s)", get(rec["ray"], "to_restart_s"), get(rec["torchrun"], "to_restart_s"), "{:.2f}"),
        row("  attempt_started -> first step (s)", get(rec["ray"], "to_step_s"), get(rec["torchrun"], "to_step_s"), "{:.2f}"),
        row("  restarted workers that started warm (spares)",
            *(warm_starts(runs[(s, True)]) if (s, True) in runs else None for s in SYSTEMS), "{}", ratio=False),
        row("restarts", get(rec["ray"], "restarts"), get(rec["torchrun"], "restarts"), "{}", ratio=False),
        row("resumed from step", get(rec["ray"], "from_step"), get(rec["torchrun"], "from_step"), "{}", ratio=False),
        row("steps recomputed (lost_steps)", get(rec["ray"], "lost_steps"), get(rec["torchrun"], "lost_steps"), "{}", ratio=False),
        row("failed rank / cause", *(f"{r['failed_rank']}/{r['cause']}" if r else None
                                     for r in (rec["ray"], rec["torchrun"])), "{}", ratio=False),
        row("weights_sha256, undisturbed", (sha.get(("ray", False)) or "-")[:10], (sha.get(("torchrun", False)) or "-")[:10], "{}", ratio=False),
        row("weights_sha256, recovered", (sha.get(("ray", True)) or "-")[:10], (sha.get(("torchrun", True)) or "-")[:10], "{}", ratio=False),
    ]
    good = True
    same = {}
    for s in SYSTEMS:
        a, b = sha.get((s, False)), sha.get((s, True))
        same[s] = "yes" if a and a == b else ("NO" if a and b else "-")
        if (s, False) in runs and (s, True) in runs:
            good &= same[s] == "yes"
    lines.append(row("recovered == undisturbed", same["ray"], same["torchrun"], "{}", ratio=False))
    a, b = sha.get(("ray", False)), sha.get(("torchrun", False))
    lines.append(f"ray and torchrun end with the same weights: {'yes' if a and a == b else ('no' if a and b else '-')}")
    lines.append("")
    for s in SYSTEMS:
        if (s, False) in runs:
            lines.append(phases_line(f"{s} launch, s", launch_phases(runs[(s, False)])))
        if (s, True) in runs:
            lines.append(phases_line(f"{s} restart, s", restart_phases(runs[(s, True)])))
    for s in SYSTEMS:
        cpu = launch_cpu(runs[(s, False)]) if (s, False) in runs else None
        if cpu:
            lines.append(f"{s} launch CPU-s by process ({cpu['total']:.1f} in all): "
                         + ", ".join(f"{name} {v:.1f}" for name, v in cpu.items() if name != "total"))
    for s in SYSTEMS:
        top = get(thr[s], "background_top_cpu")
        if top:
            lines.append(f"{s} steady CPU, the rest by process, % of all cores: "
                         + ", ".join(f"{name} {percent(share)}" for name, share in top.items()))
    lines.append("")
    for (s, c), r in sorted(runs.items()):
        status = "ok" if r.ok else f"FAILED (rc {r.rc}{', timed out' if r.timed_out else ''})"
        good &= r.ok
        extra = f"; {'; '.join(r.notes)}" if r.notes else ""
        lines.append(f"{r.name:<15} {status:<8} sha256 {sha.get((s, c)) or '-'}{extra}")
    systems = {}
    for s in SYSTEMS:
        if not any((s, c) in runs for c in (False, True)):
            continue
        systems[s] = {
            "throughput": thr[s],
            "throughput_spares_warm": thr_warm[s],
            "spares_warm_from_step": warm,
            "startup_s": startup_s(runs[(s, False)]) if (s, False) in runs else None,
            "wall_undisturbed_s": wall.get((s, False)),
            "wall_crash_s": wall.get((s, True)),
            # "exact": resumed from the newest committed checkpoint, weights bit-identical to the
            # undisturbed run. A "live" recovery mode, once there is one, adds rows of its own.
            "recovery": [{"mode": "exact", **rec[s]}] if rec[s] else [],
            "launch_phases_s": launch_phases(runs[(s, False)]) if (s, False) in runs else None,
            "launch_cpu_s": launch_cpu(runs[(s, False)]) if (s, False) in runs else None,
            "restart_phases_s": restart_phases(runs[(s, True)]) if (s, True) in runs else None,
            "warm_starts": warm_starts(runs[(s, True)]) if (s, True) in runs else None,
            "recovered_equals_undisturbed": same[s],
            "ok": all(runs[(s, c)].ok for c in (False, True) if (s, c) in runs),
        }
    data = {
        "bench": "vs_torchrun",
        "quick": False,
        "host": host(load[0], load[1], packages=("torch", "ray")),
        "job": {"model": "simple_cnn", "dataset_size": args.dataset_size, "workers": args.workers, "cpu": args.cpu,
                "batch": args.batch, "steps": args.steps, "checkpoint_every": args.checkpoint_every,
                "crash_step": args.crash_step, "warmup": args.warmup, "seed": args.seed},
        "systems": {s: {k: ({kk: clean(vv) for kk, vv in v.items()} if isinstance(v, dict) else v)
                        for k, v in d.items()} for s, d in systems.items()},
        "same_weights_across_systems": bool(a and a == b) if a and b else None,
    }
    return "\n".join(lines) + "\n", good, data


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/vs_torchrun.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=5000,
                   help="max_steps of every run: long enough for a steady window after Ray's spares have booted")
    p.add_argument("--dataset-size", type=int, default=8192, help="synthetic samples")
    p.add_argument("--batch", type=int, default=64, help="global batch size")
    p.add_argument("--workers", type=int, default=2, help="DDP workers (>= 2: rank 1 is the one killed)")
    p.add_argument("--cpu", type=float, default=1.0, help="CPUs (threads) per worker")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--crash-step", type=int, default=4000,
                   help="step at which rank 1 is SIGKILLed; Ray's warm spares (failure.spares) boot from 5 s "
                        "after a group starts to train, so an earlier failure finds none")
    p.add_argument("--no-spares", action="store_true", help="Ray: failure.spares false (every restart boots "
                                                            "new processes, as before spares)")
    p.add_argument("--warmup", type=int, default=20, help="steps of attempt 1 left out of the steady state")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--collective-timeout", type=int, default=30, help="collective_timeout_s (both systems)")
    p.add_argument("--only", choices=SYSTEMS, help="run one system only (None: both)")
    p.add_argument("--no-crash", action="store_true", help="skip the recovery runs")
    p.add_argument("--timeout", type=float, default=600, help="seconds before a run is killed")
    p.add_argument("--workdir", help="storage root for the runs (None: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the run directories (kept anyway when a run fails)")
    p.add_argument("--out", default=RESULTS, help="where the table is written, its JSON next to it")
    p.add_argument("-v", "--verbose", action="store_true", help="echo every run's output")
    args = p.parse_args(argv)
    if args.workers < 2:
        p.error("--workers must be at least 2")
    if args.batch % args.workers:
        p.error("--batch must be divisible by --workers")
    if not 1 <= args.crash_step <= args.steps:
        p.error("--crash-step must be within 1..--steps")
    if not 0 <= args.warmup < args.steps - 1:
        p.error("--warmup must leave at least two steps")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    versions = {name: importlib.metadata.version(name) for name in ("torch", "ray")}
    workdir = os.path.abspath(args.workdir) if args.workdir else tempfile.mkdtemp(prefix="etrain-bench-")
    storage = os.path.join(workdir, "runs")
    for sub in ("runs", "specs", "logs"):
        os.makedirs(os.path.join(workdir, sub), exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    systems = (args.only,) if args.only else SYSTEMS
    plan = [(s, False) for s in systems] + ([] if args.no_crash else [(s, True) for s in systems])
    runs: dict[tuple[str, bool], Run] = {}
    log(f"work dir {workdir}; {len(plan)} runs: " + ", ".join(f"{s}-{'crash' if c else 'clean'}" for s, c in plan))
    load_before = list(os.getloadavg())
    try:
        for system, crash in plan:
            job_id = f"bench-{system}-{'crash' if crash else 'clean'}-{tag}"
            run = Run(system, crash, job_spec(args, job_id, storage, crash),
                      os.path.join(workdir, "logs", f"{job_id}.log"))
            runs[(system, crash)] = run
            log(f"{run.name}: starting ({run.log_path})")
            (run_ray if system == "ray" else run_torchrun)(run, workdir, args)
            rec = recovery(run) if crash else None
            thr = None if crash else throughput(run, args.warmup, args.batch)
            detail = (f", recovery {rec['recovery_s']:.2f}s, {rec['lost_steps']} steps recomputed" if rec else "") + (
                f", median {thr['median']:.0f} samples/s" if thr else "")
            log(f"{run.name}: {'ok' if run.ok else 'FAILED'} in {run.wall_s:.1f}s (rc {run.rc}){detail}")
            if not run.ok:
                with open(run.log_path, errors="replace") as f:
                    tail = f.read()[-4000:]
                print(tail.rstrip() + "\n", flush=True)
    except KeyboardInterrupt:
        log("interrupted; reporting what finished")
    text, good, data = report(args, runs, (load_before, list(os.getloadavg())), versions)
    return finish(text, args.out, workdir, keep=args.keep, good=good, data=data)


if __name__ == "__main__":
    sys.exit(main())
