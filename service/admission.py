"""What the service accepts beyond a valid JobSpec (DESIGN.md invariants 6 and 7)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from typing import Any

from service import code
from service.settings import Settings, without_secrets
from workers.spec import MODELS, JobSpec


class Rejected(ValueError):
    def __init__(self, loc: tuple[str, ...], message: str):
        super().__init__(message)
        self.loc, self.message = loc, message


class CodeOff(PermissionError):
    """The operator turned users' own code off (ETRAIN_ALLOW_CODE=false): 403."""


CODE_OFF = "the operator turned users' own code off on this service (ETRAIN_ALLOW_CODE=false)"


def code_off_for(spec: JobSpec) -> str | None:
    """Why a job may not run on a service without users' code, or None when it may."""
    # requirements too: pip runs a package's build code, and may fetch any URL.
    used = [f for f, on in (("task", spec.task), ("code", spec.code), ("requirements", spec.requirements),
                            ("model 'custom'", spec.model.name == "custom")) if on]
    if not used:
        return None
    return (f"{CODE_OFF}: this job sets {' and '.join(used)}; use a built-in model "
            f"({', '.join(m for m in MODELS if m != 'custom')}) and no task, code or requirements")


def admit(spec: JobSpec, settings: Settings, capacity: dict[str, Any] | None) -> JobSpec:
    """Check a request's spec against the service's rules; return it with the storage
    the service chooses. `capacity` is the cluster's totals (None when Ray is down)."""
    if "storage" in spec.model_fields_set:
        raise Rejected(("body", "storage"), "storage is chosen by the service; leave it out")
    if not settings.allow_code and (why := code_off_for(spec)):
        raise CodeOff(why)
    if spec.code and code.stored(settings, spec.code) is None:
        raise Rejected(("body", "code"), f"no code archive {spec.code}; upload it with POST /v1/code "
                       "(`etrain submit --code DIR` does both)")
    roots = settings.allowed_data_roots
    for field in ("root", "images", "labels"):
        path = getattr(spec.dataset, field)
        if path is None:
            continue
        # A NUL byte makes realpath raise, and no file name can hold one: reject it like any bad path.
        real = "" if "\x00" in path else os.path.realpath(path)
        if not os.path.isabs(path) or not any(real == r or real.startswith(r + os.sep) for r in roots):
            # Only where the files are is checked, not that they exist: a spec with
            # fallback_to_synthetic may name files this machine lacks.
            raise Rejected(("body", "dataset", field),
                           f"dataset.{field} must be an absolute path inside one of: {', '.join(roots)}; "
                           "to allow another directory, start the service with `etrain serve --dataset-root DIR` "
                           "(or set ETRAIN_DATASET_ROOTS)")
    if capacity is not None and not settings.autoscaling and (why := never_fits(spec, capacity)):
        raise Rejected(("body", "workers"), why)
    admitted = spec.model_copy(update={"storage": settings.runs_dir})
    check_task(admitted, settings)
    return admitted


def never_fits(spec: JobSpec, capacity: dict[str, Any]) -> str | None:
    """Why the cluster could never place the job's workers, or None. Each worker is one
    bundle (CPUs, GPUs, custom resources) that must fit on one node; an elastic job starts
    once its minimum fits. `capacity["node_resources"]`: each live node's total resources."""
    need = {"CPU": spec.resources.cpu, "GPU": spec.resources.gpu, **spec.resources.custom}
    need = {k: v for k, v in need.items() if v > 0}
    nodes = capacity.get("node_resources")
    if nodes is None:  # only totals known: at least the sum must fit
        nodes = [{"CPU": capacity.get("cpus", {}).get("total", 0), "GPU": capacity.get("gpus", {}).get("total", 0)}]
    fits = sum(_workers_on(node, need, spec.min_workers) for node in nodes)
    if fits >= spec.min_workers:
        return None
    def amounts(res: dict[str, float], times: int = 1) -> str:
        return ", ".join(f"{res.get(k, 0) * times:g} {_NAMES.get(k, k)}" for k in need)

    offers = "; ".join(amounts(node) for node in nodes) or "no live node"
    return (f"{spec.min_workers} workers need {amounts(need, spec.min_workers)} in all, {amounts(need)} per worker "
            f"on one node; the cluster's nodes ({offers}) hold {fits} of them, so this job could never start")


_NAMES = {"CPU": "CPUs", "GPU": "GPUs"}


def _workers_on(node: dict[str, float], need: dict[str, float], cap: int) -> int:
    """How many workers of shape `need` one node holds, at most `cap` (a tiny request on a
    big node divides to infinity, which no int holds)."""
    share = min(node.get(k, 0) / v for k, v in need.items())
    return int(min(share, cap) + 1e-9)


def check_task(spec: JobSpec, settings: Settings) -> None:
    """A job with a task of its own: import it (with its code archive) and check it has the
    hooks the job's strategy needs, before the job is accepted. `python -m workers.check`
    does it in a subprocess, with a time limit and without the service's secrets: user
    code is never imported into the service."""
    if not spec.task:
        return
    if spec.requirements:
        # Accepted unchecked: the task may import what its requirements install, which the
        # service's interpreter may lack. Ray installs them for the workers, where a missing
        # hook fails the job instead.
        return
    python = settings.python or sys.executable
    with tempfile.TemporaryDirectory(prefix="etrain-check-") as tmp:
        spec_file, cwd = os.path.join(tmp, "spec.json"), os.path.join(tmp, "run")
        os.mkdir(cwd)
        with open(spec_file, "w") as f:
            f.write(spec.model_dump_json())
        args = [python, "-m", "workers.check", spec_file]
        if spec.code:
            unpacked = os.path.join(tmp, "code")
            code.unpack(code.archive_path(settings, spec.code), unpacked)
            args += ["--code", unpacked]
        rc, stderr = _run_check(args, cwd, settings.task_check_timeout_s)
    if rc == 0:
        return
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    if rc is None:
        raise Rejected(("body", "task"), f"checking task {spec.task!r} took over {settings.task_check_timeout_s:g}s "
                       "(importing it must not train or download anything)")
    if rc == 2 and last:
        raise Rejected(("body", "task"), last)
    raise Rejected(("body", "task"), f"checking task {spec.task!r} failed (exit code {rc})"
                   + (f": {last}" if last else ""))


def _run_check(args: list[str], cwd: str, timeout: float) -> tuple[int | None, str]:
    """(exit code, or None after the time limit; the end of stderr). Output goes to files,
    so a task that prints without end cannot fill the service's memory."""
    env = {**without_secrets(os.environ), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("RAY_ADDRESS", None)
    with open(os.path.join(cwd, "stdout"), "wb") as out, open(os.path.join(cwd, "stderr"), "w+b") as err:
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:  # the check and anything it started
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        err.seek(0, os.SEEK_END)
        err.seek(max(0, err.tell() - 8192))
        return rc, err.read().decode(errors="replace")
