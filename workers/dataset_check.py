"""Is a spec's dataset there? Answered before Ray starts, without importing torch: the
driver starts its cluster while torch imports, and a check that needed torch first would
put that import back in front of the cluster (~1 s of every launch here)."""

from __future__ import annotations

import os
import sysconfig

from workers.spec import DatasetSpec

TORCHVISION_SETS = ("mnist", "fashion_mnist", "cifar10")


class DatasetUnavailable(RuntimeError):
    """The files are not there and cannot be fetched; the message says where they go."""


def source_root() -> str:
    """Where python_source reads from when the spec names no root: the standard library."""
    return sysconfig.get_paths()["stdlib"]


def check_available(spec: DatasetSpec) -> str | None:
    """Fail fast, before any worker starts, when files are missing. Returns a notice
    when the spec falls back to the synthetic set. Only the torchvision sets import
    torch here: they are built once to find (or download) their files."""
    missing = []
    if spec.name in TORCHVISION_SETS:
        from workers.data import _torchvision

        try:
            _torchvision(spec, seed=0)  # downloads once here rather than in every worker at once
        except DatasetUnavailable as e:
            if not spec.fallback_to_synthetic:
                raise
            return f"notice: {e}; training on the synthetic dataset instead"
    elif spec.name == "idx":
        missing = [p for p in (spec.images, spec.labels) if not os.path.isfile(p)]
    elif spec.name == "image_folder" and not os.path.isdir(spec.root):
        missing = [spec.root]
    elif spec.name == "python_source" and not os.path.isdir(spec.root or source_root()):
        missing = [spec.root or source_root()]
    if not missing:
        return None
    if spec.fallback_to_synthetic:
        return f"notice: {', '.join(missing)} not found; training on the synthetic dataset instead"
    raise DatasetUnavailable(f"dataset {spec.name!r}: {', '.join(missing)} not found; put the files there")
