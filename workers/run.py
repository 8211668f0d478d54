"""Entrypoint: `python -m workers.run SPEC` runs one job on Ray Train and prints a
one-line JSON summary last. The same command works under `ray job submit`."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

from pydantic import ValidationError

from workers import events, failures, metrics_read, ray_token, segments, storage
from workers.events import Kind
from workers.process_clock import process_started
from workers.spec import JobSpec, absolute_paths, cache_dir, load_spec, write_spec_json

EXIT_OK, EXIT_FAILED, EXIT_BAD_SPEC = 0, 1, 2
POLL_ENV, POLL_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5"
# After a lost node Ray Train first asks for the old worker count again and waits this
# long for it (default 60 s) before an elastic job settles for the workers that fit.
START_TIMEOUT_ENV, ELASTIC_START_TIMEOUT_S = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "15"
PREEMPTION_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def train_func(config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker; Ray has already set up the process group."""
    ready = time.time()
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode

    from workers.loop import WorkerEnv, train

    spec = JobSpec.model_validate(config["spec"])
    ctx = ray.train.get_context()

    def on_checkpoint(metrics: dict[str, Any], path: str | None) -> None:
        # The checkpoint is already committed in the run directory, which is Ray's
        # experiment directory too: register it with Ray, without copying it and in the
        # background. A synchronous report waits for the controller to take the previous
        # one, which it polls every 2 s: that stalled training ~1.8 s per checkpoint.
        ray.train.report(
            metrics,
            checkpoint=_ray_checkpoint(Checkpoint, path),
            checkpoint_dir_name=f"checkpoints/step-{metrics['step']:06d}",
            checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
            checkpoint_upload_fn=_already_committed,
            delete_local_checkpoint_after_upload=False,
        )

    env = WorkerEnv(ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_rank(), on_checkpoint,
                    node_id=ray.get_runtime_context().get_node_id(), process_started=process_started(), ready=ready)
    if _wants_spares(spec) and env.local_rank == 0:
        from workers import spares

        # One spare per worker on this node: an exact-mode restart starts them all again.
        env.on_started = lambda: spares.keep(ctx.get_local_world_size())
    if spec.failure.mode == "live":
        from ray.train.collective import barrier
        from ray.train.v2._internal.execution.context import get_train_context

        # Ray Train makes one synchronization actor per start of the worker group and hands
        # it to the replacements of failed groups too: its id tells the two apart. No public
        # API says whether a worker is a replacement.
        env.generation = get_train_context().get_synchronization_actor()._actor_id.hex()
        env.barrier = barrier
    train(spec, env)


def _wants_spares(spec: JobSpec) -> bool:
    return spec.failure.mode == "exact" and spec.failure.spares


def _ray_checkpoint(cls, path: str | None):
    if path is None:
        return None
    # A URI: Ray resolves its filesystem (pyarrow, the same AWS_* environment).
    return cls.from_directory(path) if storage.is_local(path) else cls(path)


def _already_committed(checkpoint, _dir_name: str):
    return checkpoint


class RunDirTaken(ValueError):
    """The run directory belongs to another spec with the same job_id: leave it alone."""


def prepare_run_dir(spec: JobSpec) -> str:
    """Create the run directory and write spec.json once; a resubmission must match it."""
    path = storage.join(spec.run_dir, "spec.json")
    if storage.exists(path):
        existing = JobSpec.model_validate_json(storage.read_bytes(path))
        # The worker count may change between runs of one job (resume a stopped job
        # on fewer or more workers: sharded checkpoints reshard); nothing else may.
        if existing.model_copy(update={"workers": spec.workers}) != spec:
            raise RunDirTaken(f"{spec.run_dir} already holds a different spec for job {spec.job_id}; use a new job_id "
                              "(only the worker count may change when a job is run again)")
        if existing.workers != spec.workers:
            # spec.json stays as first submitted (the run directory's contract); each
            # attempt_started records the worker count it really ran with.
            events.emit(spec.run_dir, events.WorkersChanged(old=existing.model_dump()["workers"],
                                                            new=spec.model_dump()["workers"]))
            return spec.run_dir
    write_spec_json(spec)
    return spec.run_dir


def spool_dir(run_dir: str) -> str:
    """This host's local spool for a run on an object store: files that grow (the driver's
    output, TensorBoard's event files) are written here and copied whole to the store."""
    return os.path.join(cache_dir(), "spool", storage.name(run_dir))


def mlflow_view(spec: JobSpec, run_dir: str) -> list:
    """[the job's MLflow logger] when MLFLOW_TRACKING_URI is set; a line, and no logger,
    when mlflow is not installed: training goes on."""
    from workers import mlflow_logger

    if not mlflow_logger.wanted():
        return []
    if importlib.util.find_spec("mlflow") is None:  # imported by the logger's thread, not here
        print(f"[train] {mlflow_logger.NOT_INSTALLED}", flush=True)
        return []
    return [mlflow_logger.MlflowLogger(run_dir, spec.model_dump(mode="json"))]


def tee_output(run_dir: str) -> str | None:
    """Copy this driver's whole output (its own lines, Ray's, the workers' forwarded ones)
    into the run record too: Ray keeps a job's logs only while its head lives, and the
    service shows each driver of a resubmitted job. `tee` runs in a session of its own, so
    a stop of the driver's process group leaves it to write the driver's last lines, and it
    ends when the driver's end closes the pipe (no Python thread would outlive a SIGKILL)."""
    tee = shutil.which("tee")
    if tee is None:
        return None
    name = f"driver-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}.log"
    if storage.is_local(run_dir):
        os.makedirs(os.path.join(run_dir, events.DRIVER_LOGS), exist_ok=True)
        path = os.path.join(run_dir, events.DRIVER_LOGS, name)
    else:
        # An object store takes no append: tee writes a local spool (a cache), copied whole
        # into the run record every few seconds and at the end (segments.mirror).
        spool = spool_dir(run_dir)
        os.makedirs(spool, exist_ok=True)
        path = os.path.join(spool, name)
        segments.mirror(path, storage.join(run_dir, events.DRIVER_LOGS, name))
    for stream in (sys.stdout, sys.stderr):  # one tee each: stdout and stderr stay apart
        stream.flush()
        fd = stream.fileno()
        proc = subprocess.Popen([tee, "-a", "-i", path], stdin=subprocess.PIPE, stdout=fd, start_new_session=True)
        os.dup2(proc.stdin.fileno(), fd)
        proc.stdin.close()
        if not storage.is_local(run_dir):
            _tees.append(proc)
    return path


_tees: list[subprocess.Popen] = []  # the tees whose spool is copied to an object store


def flush_record() -> None:
    """Before the process exits: on an object store, the driver's output reaches the run
    record only through the spool's copy, so let tee write the last lines (it ends when
    our ends of its pipes close), then copy every open segment and the spool."""
    if _tees:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            os.close(fd)
        for proc in _tees:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass  # another process holds the pipe open: copy what is there
    segments.flush()


def note_lost_driver(run_dir: str) -> None:
    """A run directory whose last driver ended without `finished` or `failed` lost that
    driver (killed, or its node died). Record it dated by the last sign of life, so the
    recovery that follows is measured from then."""
    history = events.events(run_dir)
    starts = [i for i, e in enumerate(history) if e["event"] == Kind.JOB_STARTED]
    if not starts or any(e["event"] in events.VERDICTS for e in history[starts[-1]:]):
        return
    latest = metrics_read.latest(run_dir)
    last_seen = max([e["time"] for e in history] + ([latest["time"]] if latest else []))
    events.emit(run_dir, events.DriverLost(time=last_seen, noticed_at=time.time(), error="driver process lost",
                                           pid=history[starts[-1]].get("pid")))


RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's, in its experiment directory (ours)


def forget_ray_snapshot(run_dir: str) -> None:
    """Ray Train records every reported checkpoint in a snapshot and, when a new driver
    starts on the same directory, refuses to start if one of them is gone. Retention is
    ours (checkpoint.prune) and so is resume (LATEST), so the snapshot of a previous
    driver only ever stops a resubmitted job; a new driver starts without it."""
    if storage.is_local(run_dir):
        try:
            os.remove(os.path.join(run_dir, RAY_SNAPSHOT))
        except FileNotFoundError:
            pass
    else:
        storage.remove_tree(storage.join(run_dir, RAY_SNAPSHOT))


def summarize(spec: JobSpec, wall_s: float, error: str | None) -> dict[str, Any]:
    run_dir = spec.run_dir
    finished = next(iter(events.events(run_dir, Kind.FINISHED)[-1:]), None)
    failed = next(iter(events.events(run_dir, Kind.FAILED)[-1:]), None)
    resumed = events.events(run_dir, Kind.RESUMED)
    attempts = events.events(run_dir, Kind.ATTEMPT_STARTED)
    status = "succeeded" if finished and not error else "failed"
    summary: dict[str, Any] = {
        "job_id": spec.job_id,
        "status": status,
        "final_step": (finished or {}).get("final_step", max(metrics_read.reached(run_dir).values(), default=0)),
        "loss": (finished or {}).get("loss"),
        "val_accuracy": (finished or {}).get("val_accuracy"),
        "val_loss": (finished or {}).get("val_loss"),
        "val_metrics": (finished or {}).get("val_metrics") or {},
        "restarts": max(0, len(attempts) - 1),
        "steps_recomputed": sum(r.get("lost_steps", 0) for r in resumed),
        "recoveries": [
            {k: r.get(k) for k in ("failed_rank", "cause", "from_step", "lost_steps", "recovery_s")} for r in resumed
        ],
        # failure.mode live: failures the survivors trained through, no restart
        "live_recoveries": [{k: r.get(k) for k in events.LIVE_RECOVERY_KEYS}
                            for r in events.events(run_dir, Kind.LIVE_RECOVERED)],
        "world_size": attempts[-1].get("world_size") if attempts else None,
        "resizes": [{k: r.get(k) for k in ("old_size", "new_size", "from_step")}
                    for r in events.events(run_dir, Kind.RESIZED)],
        "wall_s": round(wall_s, 2),
        "weights_sha256": (finished or {}).get("weights_sha256"),
        "run_dir": run_dir,
    }
    if status == "failed":
        summary["error"] = (failed or {}).get("error") or error or "training did not finish"
        last = attempts[-1].get("attempt") if attempts else None
        blamed = failures.culprit([e for e in events.events(run_dir, Kind.WORKER_FAILED) if e.get("attempt") == last])
        if blamed and blamed.get("traceback"):
            summary["traceback"] = blamed["traceback"][-1500:]  # its tail: where in the user's code
    return summary


# Ray Train's print patch sends a worker's print both to its logger and its stdout,
# so every line reached the driver twice.
WORKER_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}

JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray for the driver of a Ray job


def worker_runtime_env(spec: JobSpec, code: str | None) -> dict[str, Any]:
    """What every worker needs besides the cluster's Python: the task's code as its
    working directory (Ray uploads it, so workers on other machines import it) and the
    spec's requirements."""
    env: dict[str, Any] = {"env_vars": dict(WORKER_ENV)}
    if _wants_spares(spec):
        from workers import spares

        # Ray runs the hook in every process of the job; it warms only training workers.
        env["worker_process_setup_hook"] = spares.HOOK
    if code:
        env["working_dir"] = code
    if spec.requirements:
        env["pip"] = list(spec.requirements)
    job = json.loads(os.environ.get(JOB_CONFIG_ENV) or "{}").get("runtime_env") or {}
    # The driver of a Ray job (`ray job submit --working-dir DIR`): the job's runtime_env
    # already reaches every worker, and Ray refuses a key given twice.
    for key in [k for k in env if k != "env_vars" and k in job]:
        del env[key]
    env["env_vars"] = {k: v for k, v in env["env_vars"].items() if k not in (job.get("env_vars") or {})}
    return env


def _ray_init(spec: JobSpec, verbose: bool, code: str | None = None) -> None:
    import logging

    import ray

    quiet = {} if verbose else {"logging_level": logging.WARNING}
    runtime_env = worker_runtime_env(spec, code)
    # Ray Train's controller polls workers every 2 s by default; each poll takes one
    # reported checkpoint and notices a dead worker, so poll faster. Ray Train hands this
    # variable from the driver to the controller it starts, on any cluster (a RayJob's
    # too), so it is set for both paths.
    os.environ.setdefault(POLL_ENV, POLL_S)
    # Ray Train's preemption watcher tells a loop that its node is draining, so that it
    # can checkpoint first. This loop checkpoints on its own schedule and recovers from a
    # lost node like from any failure; the watcher would only be one more Ray worker
    # process on every start and restart (~1.9 CPU-s to boot, measured here), taking
    # the cores from the workers that are starting. Set the variable to 1 for it.
    os.environ.setdefault(PREEMPTION_ENV, "0")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=verbose, runtime_env=runtime_env, **quiet)
        return
    # A local cluster sized to the job: logical CPUs may exceed cores since each worker
    # runs with a fixed thread count (resources.cpu).
    need = int(spec.max_workers * spec.resources.cpu) + 1
    # The raylet prestarts one idle worker per CPU for the first driver, with the driver's
    # runtime env. Ray Train's workers never reuse them (their env differs: the
    # controller's), so on a small machine they only compete with the controller and
    # the workers for the cores while the job starts.
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    # No dashboard: nobody is shown its address, and on a cluster of its own the run
    # leaves out the one part of Ray Train that asked it anything, the placement-group
    # cleaner (workers/trainer.py). Starting one took ~1 s of the launch here.
    # address="local": a new cluster even where `ray start` left one recorded in /tmp/ray.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False,
             log_to_driver=verbose, runtime_env=runtime_env, **quiet)


def run(spec: JobSpec, verbose: bool = False, code: str | None = None, tee: bool = False) -> dict[str, Any]:
    """`code`: the directory the task is imported from, shipped to every worker; `tee`:
    copy this process's output into the run record (the entrypoint does)."""
    ray_token.ensure()  # before Ray is imported: it reads RAY_AUTH_MODE once, at import
    from workers.console import QuietRay, Reporter
    from workers.dataset_check import check_available
    from workers.tensorboard import BoardWriter

    started = time.time()
    run_dir = prepare_run_dir(spec)
    if tee:
        tee_output(run_dir)
    from workers import check, tasks

    # Before Ray starts: a task that cannot run as the spec asks is refused, not retried.
    reason = check.problem(spec, code)
    if reason:
        raise check.Refused(reason)
    notice = None if spec.task else check_available(spec.dataset)
    if notice:
        print(notice, flush=True)
    note_lost_driver(run_dir)
    forget_ray_snapshot(run_dir)
    reporter = Reporter(run_dir, started=started, views=[BoardWriter(run_dir, spool=spool_dir(run_dir)),
                                                         *mlflow_view(spec, run_dir)])
    events.emit(run_dir, events.JobStarted(pid=os.getpid(), ray_address=os.environ.get("RAY_ADDRESS")))
    print(f"[train] job {spec.job_id}: {tasks.describe(spec)}, {spec.strategy}, "
          f"{spec.workers if not spec.elastic else f'{spec.workers.min}-{spec.workers.max}'} worker(s); "
          f"run directory {run_dir}", flush=True)
    if spec.elastic:
        os.environ.setdefault(START_TIMEOUT_ENV, ELASTIC_START_TIMEOUT_S)
    stdout = sys.stdout
    if not verbose:
        sys.stdout = QuietRay(stdout)
    own_cluster = not os.environ.get("RAY_ADDRESS")  # ray.init starts one, and stops it at the end
    imports = _import_trainer(spec)
    _ray_init(spec, verbose, code)
    if _wants_spares(spec):
        _launch_spares(spec, own_cluster)
    imports.join()
    from ray.train import TrainingFailedError

    reporter.start()
    error = None
    fallbacks = 0
    try:
        while True:
            try:
                _trainer(spec, run_dir, own_cluster).fit()
            except TrainingFailedError as e:
                if _replacement_lost_its_peers(spec, e) and _may_retry(spec, fallbacks):
                    fallbacks += 1
                    print("[train] another worker died while Ray replaced a failed one: "
                          "starting every worker again from the newest checkpoint", flush=True)
                    forget_ray_snapshot(run_dir)
                    continue
                error = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                if not events.events(run_dir, Kind.ATTEMPT_STARTED):
                    error = _start_failure(spec, error)
            break
    finally:
        import ray

        # Disconnect (and stop a local cluster) now, so Ray's log forwarding has
        # finished before the summary: the summary must be the last line.
        ray.shutdown()
    summary = summarize(spec, time.time() - started, error)
    if summary["status"] == "failed" and not events.events(run_dir, Kind.FAILED):
        events.emit(run_dir, events.Failed(error=summary["error"]))
    reporter.stop()
    sys.stdout = stdout
    sys.stdout.flush()
    return summary


def _import_trainer(spec: JobSpec) -> threading.Thread:
    """Import Ray Train (~1 CPU-s here; torch too in live mode, ~1.3 more) while ray.init
    starts the cluster, which spends most of its seconds waiting for Ray's processes:
    launch to first step went from 9.4-10.0 s to 7.8-8.3 s here. The checks before Ray
    need neither (workers/dataset_check.py). In exact mode the driver never imports
    torch (workers/torch_backend.py).
    An import that fails here fails again, with its traceback, where it is used."""
    names = ["workers.recorder", "workers.trainer", "workers.torch_backend"]
    if spec.failure.mode == "live":
        names.append("ray.train.v2.torch.torchft_config")

    def load() -> None:
        try:
            for name in names:
                importlib.import_module(name)
        except Exception:  # noqa: BLE001, S110
            pass

    thread = threading.Thread(target=load, name="etrain-imports", daemon=True)
    thread.start()
    return thread


def _launch_spares(spec: JobSpec, own_cluster: bool) -> None:
    """The first worker group's processes, booted while the driver builds the trainer
    (workers/spares.py): as many as its workers that fit on this node, all of them on a
    cluster this driver started, and the controller's with its actors (on a shared
    cluster one more: the placement-group cleaner, see workers/trainer.py)."""
    import ray

    from workers import spares

    here = spec.max_workers
    try:
        if not own_cluster:
            node_id = ray.get_runtime_context().get_node_id()
            have = next(n["Resources"] for n in ray.nodes() if n["NodeID"] == node_id)
            need = {"CPU": spec.resources.cpu, "GPU": spec.resources.gpu, **spec.resources.custom}
            here = min([here, *(int(have.get(k, 0) // v) for k, v in need.items() if v > 0)])
        # The controller and its synchronization actor; the placement-group cleaner on a
        # shared cluster; the autoscaling coordinator where an elastic run keeps it.
        controller_actors = 2 + (not own_cluster) + (own_cluster and spec.elastic)
        spares.at_launch(here, spares.TRAIN_WORKER_ENV_VARS, controller_actors=controller_actors)
    except Exception as exc:  # noqa: BLE001  (they only make the start faster: say so and start)
        print(f"[train] no warm processes for the start: {exc}", flush=True)


def _trainer(spec: JobSpec, run_dir: str, own_cluster: bool):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    from workers import spares
    from workers.recorder import FailureRecorder
    from workers.trainer import SyncActorSpare, Trainer

    use_gpu = spec.resources.gpu > 0
    return Trainer(
        train_func,
        own_cluster=own_cluster,
        train_loop_config={"spec": spec.model_dump(mode="json")},
        scaling_config=ScalingConfig(
            # (min, max): Ray Train starts with what fits, restarts smaller after a lost
            # node, and grows back (a restart from the newest checkpoint) when it can.
            num_workers=(spec.workers.min, spec.workers.max) if spec.elastic else spec.workers,
            elastic_resize_monitor_interval_s=spec.workers.resize_check_s if spec.elastic else 60.0,
            use_gpu=use_gpu,
            resources_per_worker={"CPU": spec.resources.cpu, **({"GPU": spec.resources.gpu} if use_gpu else {}),
                                  **spec.resources.custom},
        ),
        backend_config=_torch_config(spec, use_gpu),
        run_config=RunConfig(
            name=spec.job_id,
            storage_path=spec.storage,
            failure_config=FailureConfig(max_failures=spec.failure.max_failures),
            # Retention is ours (checkpoint.prune): Ray must not delete what we may resume from.
            checkpoint_config=CheckpointConfig(num_to_keep=None),
            callbacks=[FailureRecorder(run_dir), *([SyncActorSpare()] if _wants_spares(spec) else [])],
            worker_runtime_env={"env_vars": spares.TRAIN_WORKER_ENV_VARS} if _wants_spares(spec) else None,
        ),
    )


def _replacement_lost_its_peers(spec: JobSpec, e: Exception) -> bool:
    """failure.mode live, two or more workers lost together (a whole node): Ray Train
    noticed one dead a poll before the others and, replacing that one's group, called the
    others' workers (Ray 2.60 clears their result queues first). One of them dead by then
    ends the run with a controller error that Ray's failure policy never retries, though
    the job can go on: as after a whole-group failure, every worker starts again from the
    newest checkpoint (survivors, if any, too)."""
    from ray.exceptions import RayActorError
    from ray.train.v2.api.exceptions import ControllerError

    return (spec.failure.mode == "live" and isinstance(e, ControllerError)
            and isinstance(e.controller_failure, RayActorError))


def _may_retry(spec: JobSpec, fallbacks: int) -> bool:
    # Ray's own count of failures starts again with each run of the trainer: the
    # fallbacks have a budget of their own, the same max_failures.
    return spec.failure.max_failures == -1 or fallbacks < spec.failure.max_failures


def _torch_config(spec: JobSpec, use_gpu: bool):
    from workers.torch_backend import TorchConfig

    backend = "nccl" if use_gpu else "gloo"
    if spec.failure.mode == "live":
        # Each worker its own replica group, a torchft lighthouse on the head; Ray Train
        # replaces only a failed group.
        from ray.train.v2.torch.torchft_config import TorchftConfig

        from workers.live import lighthouse_kwargs

        return TorchftConfig(lighthouse_kwargs=lighthouse_kwargs(), backend=backend,
                             timeout_s=spec.failure.collective_timeout_s)
    return TorchConfig(backend=backend, timeout_s=spec.failure.collective_timeout_s)


def _start_failure(spec: JobSpec, error: str) -> str:
    """Ray Train failed to start the workers (before any of our code ran on them): say
    which part of the spec met which worker."""
    if spec.resources.gpu > 0 and ("GPU" in error or "CUDA" in error or "NCCL" in error):
        return (f"resources.gpu is {spec.resources.gpu:g} but the workers Ray placed have no usable GPU: {error}")
    return f"the workers could not start: {error}"


def _last_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


def _one_line(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'spec'}: {err['msg']}" for err in e.errors())
    return str(e)


def main(argv: list[str] | None = None, tee: bool = False) -> int:
    """`tee`: copy this process's output into the run record (only as the entrypoint,
    whose stdout and stderr are its own to redirect)."""
    parser = argparse.ArgumentParser(prog="python -m workers.run", description=__doc__)
    parser.add_argument("spec", help="job spec file, YAML or JSON")
    parser.add_argument("--storage", help="override the spec's storage root")
    parser.add_argument("--job-id", help="override the spec's job_id")
    parser.add_argument("--code", metavar="DIR",
                        help="directory holding the spec's task; every worker gets it as its working directory")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="also show Ray's own output and the workers' (quiet by default)")
    args = parser.parse_args(argv)
    ray_token.ensure()
    try:
        spec = load_spec(args.spec)
        overrides = {k: v for k, v in {"storage": args.storage, "job_id": args.job_id}.items() if v}
        if overrides:
            spec = JobSpec.model_validate({**spec.model_dump(), **overrides})
        spec = absolute_paths(spec)
        code = os.path.abspath(args.code) if args.code else None
        if code and not os.path.isdir(code):
            raise ValueError(f"--code {args.code}: no such directory")
    except (OSError, ValueError, ValidationError) as e:
        print(f"error: invalid spec {args.spec}: {_one_line(e)}", file=sys.stderr)
        return EXIT_BAD_SPEC
    try:
        summary = run(spec, args.verbose, code, tee=tee)
    except Exception as e:  # a clear line, not a traceback, for what stops a job before training
        from workers.dataset_check import DatasetUnavailable

        if not isinstance(e, (DatasetUnavailable, ValueError)):
            if args.verbose:
                raise
            print(f"error: {_last_line(e)} (run again with --verbose for the traceback)", file=sys.stderr)
            return EXIT_FAILED
        if not isinstance(e, RunDirTaken):
            # The verdict goes in the run directory too, so a service watching it does
            # not take this exit for a lost driver and run it again.
            events.emit(spec.run_dir, events.Failed(error=str(e), classification="deterministic"))
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_SPEC
    print(json.dumps(summary), flush=True)
    return EXIT_OK if summary["status"] == "succeeded" else EXIT_FAILED


if __name__ == "__main__":
    code = main(tee=True)
    sys.stdout.flush()
    sys.stderr.flush()
    flush_record()  # os._exit runs no atexit handler
    # Ray is shut down and every record is fsynced; tearing down torch's and Ray's
    # modules at interpreter exit only costs ~2 s after the job has ended.
    os._exit(code)
