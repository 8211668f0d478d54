"""Warm spare processes for the next restart of the worker group.

A restart in exact mode starts every worker again, and on a small host most of its
seconds are new processes booting: Ray's worker start, then `import torch` and
`ray.train.torch` (~3 CPU-s each here). Ray's raylet can start idle worker processes
ahead of time for a given job and runtime env (PrestartWorkers), and an actor with that
same job and env takes one instead of starting its own; the job's setup hook imports
what a training worker needs while the process sits idle. So once a worker group is up,
each node asks its raylet for as many spares as it runs workers, and the next group on
that node starts in processes that are already warm.

Why by hand: Ray 2.60 has the raylet's PrestartWorkers RPC but no Python API for it
(newer Rays have `prestart_workers_on_local_node`, the same request through the core
worker). This module sends the request itself, through Ray's own gRPC channel helper
(token auth included), with the runtime env string the calling worker was started
with: the raylet matches spares to actors by a hash of that exact string.
"""

from __future__ import annotations

import json
import os
import threading
import time

# Set on Ray Train's workers only (RunConfig.worker_runtime_env), so that the job's
# setup hook, which Ray runs in every process of the job, warms only processes that
# may become training workers: never the controller.
TRAIN_WORKER_ENV = "ETRAIN_TRAIN_WORKER"
TRAIN_WORKER_ENV_VARS = {TRAIN_WORKER_ENV: "1"}
HOOK = "workers.spares.warm_up"
# How long the raylet keeps an idle spare before it may end it (when the node runs short
# of idle CPUs; a finished job's idle processes it ends at once), and how often a node
# counts its spares and tops them up again.
KEEP_ALIVE_S = 3600
TOP_UP_S = 60.0
# Launch spares wait only for the actors about to start; one that is not used (its
# worker went to another node) is the raylet's to end after this.
LAUNCH_KEEP_ALIVE_S = 120
# A spare boots on the cores the workers train on (its imports at idle priority, Ray's
# own start not): a job that ends within seconds of its start never pays for one.
FIRST_AFTER_S = 5.0
# The raylet starts at most min(cores, CPUs) worker processes at a time and drops the
# rest of a request (2 here: of 3 workers' spares, one never came). What it dropped is
# asked for again this soon, up to QUICK_RETRIES times in a row: long enough after a
# request for the processes it started to show (~0.5-0.7 s at a launch here), so none
# is asked for twice. A spare that dies as it boots is asked for again at the next top-up.
RETRY_S = 2.0
LAUNCH_RETRY_S = 1.5
QUICK_RETRIES = 5


def warm_up() -> None:
    """Ray's worker_process_setup_hook: runs when any process of the job starts.

    Beside a training group of the job, the imports run in a thread of the lowest
    priority (SCHED_IDLE), so that spares take only cores the group leaves idle. Only
    that thread is lowered: a process cannot raise its priority again without
    privileges, and the process goes on to be a training worker. At launch, when no
    group trains here yet, an actor sent to this process waits for the hook to end, so
    the imports run at the process's own priority."""
    if not os.environ.get(TRAIN_WORKER_ENV):
        return
    idle = _group_training_here(os.environ.get("RAY_JOB_ID", ""))
    thread = threading.Thread(target=_import, args=(idle,), name="etrain-warm-up")
    thread.start()
    thread.join()


def _group_training_here(job: str) -> bool:
    return any(cmdline.startswith(b"ray::RayTrainWorker") for cmdline, _ in _job_processes(job))


def _job_processes(job: str):
    """(command line, environment) of each of this Ray job's processes on this node, read
    from /proc (none without it). A process's environment is readable to its own user,
    as Ray's workers are to each other."""
    key = f"RAY_JOB_ID={job}".encode()
    for pid in [p for p in os.listdir("/proc") if p.isdigit()] if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if key in env:
            yield cmdline, env


def _import(idle: bool) -> None:
    if idle and hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    try:
        import ray.train.torch  # noqa: F401
        import torch._dynamo  # noqa: F401  (torch.use_deterministic_algorithms imports it: ~0.7 CPU-s here)

        import workers.loop  # noqa: F401  (torch, the strategies, the tasks)
    except Exception:  # noqa: BLE001, S110  (the worker imports them again and reports what fails, with its job)
        pass


def keep(count: int, train: bool = True, after_s: float = FIRST_AFTER_S,
         stop: threading.Event | None = None) -> threading.Thread:
    """Keep `count` spares on this node from `after_s` on, until `stop` is set: spares for
    training workers, or (`train` False) for the job's other actors. From a thread:
    training never waits on the raylet, and a refused request costs one line, not the job.

    The node's spares are counted before each request, so they never grow past `count`:
    a restart that came while they booted starts fresh processes, and the spares that
    register after it wait for the next restart rather than being asked for again."""
    stop = stop or threading.Event()

    def ask() -> None:
        if stop.wait(after_s):
            return
        import ray

        job = ray.get_runtime_context().get_job_id()
        retries = 0
        while True:
            missing = count - spares_here(job, train)
            try:
                if missing > 0:
                    prestart(missing)
            except Exception as exc:  # noqa: BLE001  (spares only make a restart faster: say so and train on)
                print(f"[train] no warm spare processes for the next restart: {exc}", flush=True)
                return
            retries = retries + 1 if missing > 0 else 0
            soon = 0 < retries <= QUICK_RETRIES
            if not os.path.isdir("/proc") or stop.wait(RETRY_S if soon else TOP_UP_S):
                return  # without /proc no count: ask once, never pile spares up

    thread = threading.Thread(target=ask, name="etrain-spares", daemon=True)
    thread.start()
    return thread


def spares_here(job: str, train: bool = True) -> int:
    """This job's idle or booting Ray worker processes on this node, for training
    workers or not. Read from /proc: the raylet says how many idle workers it has, but
    not whose or for which runtime env."""
    return _ray_workers_here(job, idle=True)[train]


def _ray_workers_here(job: str, idle: bool) -> dict[bool, int]:
    """This job's Ray worker processes on this node, idle or booting ones only, or
    (`idle` False) those running an actor too; counted by whether they are in the
    training workers' env (True) or not, in one pass over /proc."""
    marker = f"{TRAIN_WORKER_ENV}=1".encode()
    # Booting: Ray's worker script; setproctitle names it ray::IDLE once it has
    # connected, and after its actor's class once it has one.
    named = b"ray::IDLE" if idle else b"ray::"
    counts = {True: 0, False: 0}
    for cmdline, env in _job_processes(job):
        if b"default_worker.py" in cmdline or cmdline.startswith(named):
            counts[marker in env] += 1
    return counts


def at_launch(workers_here: int, train_env_vars: dict[str, str], controller_actors: int = 2) -> None:
    """From the driver, after ray.init and before the trainer starts: the processes Ray
    Train is about to start on this node, booted now, while the driver imports Ray
    Train and builds the trainer. `controller_actors` in the controller's runtime env (the
    controller, pinned to the driver's node, the synchronization actor it starts beside
    itself, and on a shared cluster its placement-group cleaner) and `workers_here` in
    the training workers' env.

    Each env string is the one Ray will give those actors, made here the way Ray makes
    it (see `child_env`) from what Ray Train passes: the controller gets the job's env
    with Ray Train's propagated variables (DataParallelTrainer._initialize_and_run_controller),
    the workers the controller's with those and RunConfig.worker_runtime_env's
    (WorkerGroup._get_worker_runtime_env). A string that came out different would only
    leave the spares unused: tests/integration/test_recovery.py checks that none is
    left idle once the workers train."""
    import ray
    from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
    from ray.train.v2._internal.constants import (
        DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
        get_env_vars_to_propagate,
    )

    job = ray.get_runtime_context().get_runtime_env_string()
    controller = child_env(job, {"env_vars": {
        **get_env_vars_to_propagate(),
        RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR: os.environ.get(
            RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE)}})
    worker = child_env(controller, {"env_vars": {**get_env_vars_to_propagate(), **train_env_vars}})
    wanted = [(False, controller_actors, controller), (True, workers_here, worker)]
    for _, count, env in wanted:
        if count > 0:
            prestart(count, env=env, keep_alive_s=LAUNCH_KEEP_ALIVE_S)
    if os.path.isdir("/proc"):
        threading.Thread(target=_complete_launch, args=(ray.get_runtime_context().get_job_id(), wanted),
                         name="etrain-launch-spares", daemon=True).start()


def _complete_launch(job: str, wanted: list[tuple[bool, int, str]]) -> None:
    """Ask again for the launch spares the raylet dropped. Counted with the processes
    their actors already took, so none is asked for twice; and only once no new process
    came in the last LAUNCH_RETRY_S: on a loaded host the raylet may still be starting
    what it was asked for after that long, and asking again then leaves one spare too
    many idle (seen once in CI, with a launch spare of the controller's env left over)."""
    seen = None
    for _ in range(QUICK_RETRIES + 1):
        time.sleep(LAUNCH_RETRY_S)
        have = _ray_workers_here(job, idle=False)
        short = [(count - have[train], env) for train, count, env in wanted]
        if all(n <= 0 for n, _ in short):
            return
        if have != seen:
            seen = have
            continue
        try:
            for n, env in short:
                if n > 0:
                    prestart(n, env=env, keep_alive_s=LAUNCH_KEEP_ALIVE_S)
        except Exception:  # noqa: BLE001  (the first request already said whether the raylet answers)
            return
        seen = None  # what this request starts shows in the counts to come


def child_env(parent: str, child: dict) -> str:
    """The runtime env string of an actor started with `child` by a process whose env
    string is `parent`. Ray's core worker (C++) merges the two, the child's keys over the
    parent's and env_vars key by key, and serializes the result compactly with sorted
    keys and UTF-8 as it is (nlohmann::json's dump); Ray has no Python function for it."""
    merged = json.loads(parent)
    for key, value in child.items():
        merged[key] = {**merged[key], **value} if key == "env_vars" and "env_vars" in merged else value
    return json.dumps(merged, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def prestart(count: int, env: str | None = None, keep_alive_s: int = KEEP_ALIVE_S) -> None:
    """`count` idle worker processes of this job on this node, in the runtime env `env`
    (None: the caller's own)."""
    import ray
    from ray._private.grpc_utils import init_grpc_channel
    from ray._private.utils import get_runtime_env_info
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc
    from ray.runtime_env import RuntimeEnv

    context = ray.get_runtime_context()
    env = env or context.get_runtime_env_string()
    info = get_runtime_env_info(RuntimeEnv.deserialize(env), is_job_runtime_env=False, serialize=False)
    # The raylet hashes this string to match a spare to an actor; Python's own
    # serialization of the same env differs in its spacing, so keep the given one.
    info.serialized_runtime_env = env
    node = ray._private.worker.global_worker.node
    channel = init_grpc_channel(f"{node.node_ip_address}:{node.node_manager_port}")
    try:
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(
            node_manager_pb2.PrestartWorkersRequest(
                language=common_pb2.PYTHON, job_id=bytes.fromhex(context.get_job_id()), runtime_env_info=info,
                keep_alive_duration_secs=keep_alive_s, num_workers=count),
            timeout=30)
    finally:
        channel.close()
