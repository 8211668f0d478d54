"""What the service accepts beyond a valid JobSpec (DESIGN.md invariants 6 and 7)."""

from __future__ import annotations

import os
from typing import Any

from service.settings import Settings
from workers.spec import MODELS, JobSpec


class Rejected(ValueError):
    def __init__(self, loc: tuple[str, ...], message: str):
        super().__init__(message)
        self.loc, self.message = loc, message


def admit(spec: JobSpec, settings: Settings, capacity: dict[str, Any] | None) -> JobSpec:
    """Check a request's spec against the service's rules; return it with the storage
    the service chooses. `capacity` is the cluster's totals (None when Ray is down)."""
    if "storage" in spec.model_fields_set:
        raise Rejected(("body", "storage"), "storage is chosen by the service; leave it out")
    if spec.model.name == "custom" and not settings.allow_custom_models:
        raise Rejected(("body", "model", "name"),
                       "model 'custom' runs code named in the request and is disabled on this service; "
                       f"allowed: {', '.join(m for m in MODELS if m != 'custom')}")
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
    if capacity is not None:
        cpus, gpus = capacity.get("cpus", {}).get("total", 0), capacity.get("gpus", {}).get("total", 0)
        # An elastic job starts once its minimum fits.
        need_cpu, need_gpu = spec.min_workers * spec.resources.cpu, spec.min_workers * spec.resources.gpu
        if need_cpu > cpus or need_gpu > gpus:
            raise Rejected(("body", "workers"),
                           f"{spec.min_workers} workers need {need_cpu:g} CPUs and {need_gpu:g} GPUs; the cluster "
                           f"has {cpus:g} CPUs and {gpus:g} GPUs in all, so this job could never start")
    return spec.model_copy(update={"storage": settings.runs_dir})
