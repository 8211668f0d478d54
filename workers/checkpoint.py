"""Atomic checkpoints in the run directory (DESIGN.md invariant 2), on a local path or an
object store (workers.storage).

Layout: checkpoints/step-000120/ holds the shards and manifest.json; checkpoints/LATEST
names the newest committed one. A checkpoint whose files do not match its manifest (sizes,
SHA-256) is never loaded.

How a commit is made atomic depends on what the storage offers:
- local: shards go to checkpoints/.tmp-step-000120/ and are fsynced, the manifest is
  written last, then the directory is renamed into place and LATEST replaced;
- object store (no rename): shards are written in place into step-000120/; the manifest,
  one PUT after every shard, seals it; LATEST follows. A step directory without a manifest
  is one being written (or abandoned by a crash): never loaded, never pruned while it may
  be written, and cleared by the next attempt before any rank writes (clear_partial).

Written here rather than taken from Ray: Ray Train registers checkpoints but, as seen
with Ray 2.60, can resume from an older one than the newest in storage; and
torch.distributed.checkpoint writes shards but defines no commit marker. The run
directory is the source of truth; Ray is told about each commit afterwards.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import time
from typing import Any

from pydantic import ValidationError

from workers import segments, storage
from workers.events import Manifest, ManifestFile

MANIFEST = "manifest.json"
LATEST = "LATEST"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def root(run_dir: str) -> str:
    return storage.join(run_dir, "checkpoints")


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def path_of(run_dir: str, step: int) -> str:
    return storage.join(root(run_dir), step_name(step))


def tmp_dir(run_dir: str, step: int) -> str:
    """Where every rank writes the shards of `step` before it is committed."""
    if storage.is_local(run_dir):
        return storage.join(root(run_dir), f".tmp-{step_name(step)}")
    return path_of(run_dir, step)  # no rename on an object store: in place, sealed by its manifest


def _sha256(uri: str) -> str:
    h = hashlib.sha256()
    with storage.open_file(uri, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_shard(directory: str, name: str, obj: Any) -> None:
    """torch.save one shard, whole (fsynced locally, one PUT on an object store); called
    by every rank for its own files."""
    import torch  # here, so the control plane can read manifests without loading torch

    storage.makedirs(directory)
    if storage.is_local(directory):
        with open(storage.local_path(storage.join(directory, name)), "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        return
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    storage.write_bytes(storage.join(directory, name), buffer.getvalue())


def commit(run_dir: str, step: int, meta: dict[str, Any]) -> str:
    """Seal the checkpoint of `step` once every rank's shards are written."""
    # The steps before this checkpoint must be in the run record once it is sealed. On an
    # object store they may still wait in this process's open metrics segment, and a
    # worker killed after the seal (held in Ray's report barrier by a dead peer, say)
    # would take them along while the run resumes after them.
    segments.flush_run(run_dir)
    src = tmp_dir(run_dir, step)
    files = {}
    for name in sorted(storage.listdir(src)):
        if name != MANIFEST:
            uri = storage.join(src, name)
            files[name] = ManifestFile(bytes=storage.size(uri), sha256=_sha256(uri))
    manifest = Manifest(step=step, files=files, **meta)
    storage.write_bytes(storage.join(src, MANIFEST), manifest.model_dump_json(indent=1).encode())
    dst = path_of(run_dir, step)
    if storage.is_local(run_dir):  # write_bytes fsynced the manifest and src
        storage.remove_tree(dst)  # there only when a replay after a failure recommitted this step
        storage.move_tree(src, dst)
    storage.write_bytes(storage.join(root(run_dir), LATEST), (step_name(step) + "\n").encode())
    return dst


def read_manifest(path: str, *, verify: bool = True) -> Manifest | None:
    """The manifest of a committed checkpoint, or None when it is incomplete or damaged."""
    try:
        manifest = Manifest.model_validate_json(storage.read_bytes(storage.join(path, MANIFEST)))
    except (OSError, ValueError, ValidationError):
        return None
    for name, info in manifest.files.items():
        file = storage.join(path, name)
        if storage.size(file) != info.bytes:
            return None
        if verify and _sha256(file) != info.sha256:
            return None
    return manifest


def verified(path: str) -> bool:
    """Whether every file of the checkpoint at `path` matches its manifest's SHA-256."""
    return read_manifest(path, verify=True) is not None


def committed_steps(run_dir: str) -> list[int]:
    """Steps with a step-* directory, newest first (not yet checked for a manifest)."""
    names = storage.listdir(root(run_dir))
    return sorted((int(m.group(1)) for n in names if (m := _STEP_DIR.match(n))), reverse=True)


def latest_named(run_dir: str) -> int | None:
    """The step LATEST names, whether or not that checkpoint is still sound."""
    try:
        named = _STEP_DIR.match(storage.read_bytes(storage.join(root(run_dir), LATEST)).decode().strip())
    except (OSError, UnicodeDecodeError):
        return None
    return int(named.group(1)) if named else None


def sound(run_dir: str) -> list[tuple[int, str]]:
    """Every committed checkpoint with a complete manifest, newest first; the first is
    verified against its SHA-256 sums (the others are verified before they are loaded:
    CheckpointManager.load_newest).

    LATEST is read as well as the directory: it may name a checkpoint that a later one
    superseded before LATEST was replaced; the scan finds one damaged since, and skips it.
    """
    candidates = committed_steps(run_dir)
    named = latest_named(run_dir)
    if named is not None and named not in candidates:
        candidates.append(named)
    found: list[tuple[int, str]] = []
    for step in sorted(set(candidates), reverse=True):
        path = path_of(run_dir, step)
        # Hash only up to the first sound one: hashing every fallback would read the
        # whole retention on each resume, and a fallback is verified when it is tried.
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
    dst = storage.join(root(run_dir), f".unloadable-{step_name(step)}-{int(time.time())}")
    storage.move_tree(path_of(run_dir, step), dst)
    return dst


def prune(run_dir: str, keep: int) -> list[int]:
    """Delete sealed checkpoints beyond the newest `keep`. Directories without a manifest
    do not count as kept ones, so a damaged one never costs a sound one, and are not
    removed here (one may be being written); neither is the one LATEST names."""
    sealed = [s for s in committed_steps(run_dir) if read_manifest(path_of(run_dir, s), verify=False) is not None]
    named = latest_named(run_dir)
    removed = []
    for step in sealed[keep:]:
        if step == named:
            continue
        storage.remove_tree(path_of(run_dir, step))
        removed.append(step)
    return removed


def clear_partial(run_dir: str, sound_steps: list[tuple[int, str]] | None = None) -> None:
    """Remove what a failed attempt half-wrote; call before any rank starts writing.
    Locally that is the .tmp-* directories. On an object store it is every step directory
    without a manifest, and every one newer than the newest sound checkpoint (it could not
    be loaded, and the next attempt will write that step again in place): those are set
    aside, so no write ever lands in a prefix that holds another attempt's files.
    `sound_steps`: sound(run_dir), when the caller has it (it hashes the newest checkpoint)."""
    names = storage.listdir(root(run_dir))
    if storage.is_local(run_dir):
        for name in names:
            if name.startswith(".tmp-"):
                storage.remove_tree(storage.join(root(run_dir), name))
        return
    found = sound(run_dir) if sound_steps is None else sound_steps
    for step in committed_steps(run_dir):
        if not found or step > found[0][0]:
            if storage.exists(storage.join(path_of(run_dir, step), MANIFEST)):
                set_aside(run_dir, step)
            else:
                storage.remove_tree(path_of(run_dir, step))


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

    uri = storage.join(path, name)
    # From an object store in one read: torch.load's many small seeks would each be a request.
    source = storage.local_path(uri) if storage.is_local(uri) else io.BytesIO(storage.read_bytes(uri))
    with torch.serialization.safe_globals(_array_globals()):
        return torch.load(source, map_location="cpu", weights_only=True)
