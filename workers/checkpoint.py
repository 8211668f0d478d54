"""Atomic checkpoints in the run directory (DESIGN.md invariant 2).

Layout: checkpoints/step-000120/ holds the shards and manifest.json; checkpoints/LATEST
names the newest committed one. Shards go to checkpoints/.tmp-step-000120/, are fsynced,
the manifest is written last, then the directory is renamed and LATEST replaced.

Written here rather than taken from Ray: Ray Train registers checkpoints but, as seen
with Ray 2.60, can resume from an older one than the newest in storage; and
torch.distributed.checkpoint writes shards but defines no commit marker. The run
directory is the source of truth; Ray is told about each commit afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from typing import Any

MANIFEST = "manifest.json"
LATEST = "LATEST"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def tmp_dir(run_dir: str, step: int) -> str:
    return os.path.join(root(run_dir), f".tmp-{step_name(step)}")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_shard(directory: str, name: str, obj: Any) -> None:
    """torch.save one shard and fsync it; called by every rank for its own files."""
    import torch  # here, so the control plane can read manifests without loading torch

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def commit(run_dir: str, step: int, meta: dict[str, Any]) -> str:
    """Seal the temporary directory of `step` once every rank's shards are in it."""
    src = tmp_dir(run_dir, step)
    files = {
        name: {"bytes": os.path.getsize(os.path.join(src, name)), "sha256": _sha256(os.path.join(src, name))}
        for name in sorted(os.listdir(src))
        if name != MANIFEST
    }
    manifest = {"step": step, "committed_at": time.time(), "files": files, **meta}
    with open(os.path.join(src, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(src)
    dst = os.path.join(root(run_dir), step_name(step))
    if os.path.exists(dst):  # a replay after a failure recommitted this step; same bytes
        shutil.rmtree(dst)
    os.rename(src, dst)
    fsync_dir(root(run_dir))
    latest_tmp = os.path.join(root(run_dir), f".{LATEST}.tmp")
    with open(latest_tmp, "w") as f:
        f.write(step_name(step) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(root(run_dir), LATEST))
    fsync_dir(root(run_dir))
    return dst


def read_manifest(path: str, *, verify: bool = True) -> dict[str, Any] | None:
    """The manifest of a committed checkpoint, or None when it is incomplete or damaged."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    for name, info in manifest.get("files", {}).items():
        file = os.path.join(path, name)
        if not os.path.isfile(file) or os.path.getsize(file) != info["bytes"]:
            return None
        if verify and _sha256(file) != info["sha256"]:
            return None
    return manifest


def committed_steps(run_dir: str) -> list[int]:
    """Steps with a step-* directory, newest first (not yet checked for a manifest)."""
    try:
        names = os.listdir(root(run_dir))
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)) for n in names if (m := _STEP_DIR.match(n))), reverse=True)


def sound(run_dir: str) -> list[tuple[int, str]]:
    """Every committed checkpoint with a complete manifest, newest first; the first is
    verified against its SHA-256 sums.

    LATEST is read as well as the directory: it may name a checkpoint that a later one
    superseded before LATEST was replaced; the scan finds one damaged since, and skips it.
    """
    candidates = committed_steps(run_dir)
    try:
        with open(os.path.join(root(run_dir), LATEST)) as f:
            named = _STEP_DIR.match(f.read().strip())
        if named and int(named.group(1)) not in candidates:
            candidates.append(int(named.group(1)))
    except OSError:
        pass
    found: list[tuple[int, str]] = []
    for step in sorted(set(candidates), reverse=True):
        path = os.path.join(root(run_dir), step_name(step))
        # Hash only up to the first sound one: the older ones are fallbacks, and a
        # damaged fallback fails to load and is skipped in turn.
        if read_manifest(path, verify=not found) is not None:
            found.append((step, path))
    return found


def latest(run_dir: str) -> tuple[int, str] | None:
    """The newest committed checkpoint whose manifest verifies."""
    found = sound(run_dir)
    return found[0] if found else None


def set_aside(run_dir: str, step: int) -> str:
    """Move a checkpoint that could not be loaded out of the way (kept for a post-mortem,
    never resumed from again: the name no longer matches step-*)."""
    src = os.path.join(root(run_dir), step_name(step))
    dst = os.path.join(root(run_dir), f".unloadable-{step_name(step)}-{int(time.time())}")
    os.rename(src, dst)
    fsync_dir(root(run_dir))
    return dst


def prune(run_dir: str, keep: int) -> list[int]:
    """Delete sealed checkpoints beyond the newest `keep`. Directories without a manifest
    do not count as kept ones, so a damaged one never costs a sound one."""
    sealed = [s for s in committed_steps(run_dir)
              if read_manifest(os.path.join(root(run_dir), step_name(s)), verify=False) is not None]
    removed = []
    for step in sealed[keep:]:
        shutil.rmtree(os.path.join(root(run_dir), step_name(step)), ignore_errors=True)
        removed.append(step)
    return removed


def clear_partial(run_dir: str) -> None:
    """Remove temporaries left by a failed attempt; call before any rank starts writing."""
    try:
        names = os.listdir(root(run_dir))
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root(run_dir), name), ignore_errors=True)


def _array_globals() -> list[Any]:
    """What unpickling a NumPy array needs (a rank's RNG state holds NumPy's as one): it
    builds an array and nothing else."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # NumPy 1.x
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_shard(path: str, name: str) -> Any:
    """torch.load with weights_only: storage that other users or jobs can write (a shared
    filesystem) could hold a crafted pickle, which a full unpickle would run. Shards hold
    tensors and plain values, and NumPy's RNG state, whose arrays are allowed by name."""
    import torch

    with torch.serialization.safe_globals(_array_globals()):
        return torch.load(os.path.join(path, name), map_location="cpu", weights_only=True)
