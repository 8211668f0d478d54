"""Where a job's files live: a local (or mounted, shared) path, or a URI that fsspec
reaches (s3://bucket/prefix, gs://..., any filesystem with an fsspec implementation).

Credentials and the endpoint come from the standard environment (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, ...; botocore reads them), never from a spec. fsspec rather than
pyarrow: torch.distributed.checkpoint writes to a URI through fsspec, so the sharded
strategies' shards and every other file share one client and one configuration.

The two kinds differ in what they promise, and the callers rely on it:
- local: a rename is atomic and files are fsynced, so a checkpoint is written to a
  temporary directory and renamed into place;
- object stores: no rename and no append, but one object's PUT is atomic (a reader sees
  the whole of it or none of it), so a checkpoint is written in place and sealed by
  objects written last (its manifest, then LATEST).
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
from typing import IO, Any

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def scheme(uri: str) -> str | None:
    """The URI's scheme (s3, gs, ...), or None for a local path (file:// counts as local)."""
    m = _SCHEME.match(uri)
    return None if m is None or m.group(1) == "file" else m.group(1)


def is_local(uri: str) -> bool:
    return scheme(uri) is None


def local_path(uri: str) -> str:
    return uri.removeprefix("file://")


def join(uri: str, *parts: str) -> str:
    return os.path.join(uri, *parts) if is_local(uri) else posixpath.join(uri, *parts)


def name(uri: str) -> str:
    return posixpath.basename(uri.rstrip("/"))


def relative(path: str, start: str) -> str:
    return os.path.relpath(path, start) if is_local(path) else posixpath.relpath(
        path.split("://", 1)[1], start.split("://", 1)[1])


def _fs(uri: str):
    import fsspec  # here: the control plane reads local run records without it

    options = {}
    if scheme(uri) in ("s3", "s3a") and os.environ.get("AWS_ENDPOINT_URL"):
        # Named, so it is part of fsspec's instance cache key: a process whose environment
        # names another endpoint later (a test's second server) gets a client for that one.
        options["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
    return fsspec.core.url_to_fs(uri, **options)[0]


def listdir(uri: str) -> list[str]:
    """The names directly under `uri`; [] when there is nothing there."""
    if is_local(uri):
        try:
            return os.listdir(local_path(uri))
        except (FileNotFoundError, NotADirectoryError):
            return []
    fs = _fs(uri)
    try:
        return [name(entry) for entry in fs.ls(uri, detail=False, refresh=True)]
    except FileNotFoundError:
        return []


def sizes(uri: str) -> dict[str, int]:
    """{name: size} of the files directly under `uri`, from one listing; {} when none."""
    if is_local(uri):
        path = local_path(uri)
        try:
            return {n: os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
                    if os.path.isfile(os.path.join(path, n))}
        except (FileNotFoundError, NotADirectoryError):
            return {}
    try:
        entries = _fs(uri).ls(uri, detail=True, refresh=True)
    except FileNotFoundError:
        return {}
    return {name(e["name"]): e["size"] for e in entries if e.get("type") == "file"}


def size(uri: str) -> int | None:
    """The size of the file at `uri`, or None when there is none."""
    if is_local(uri):
        path = local_path(uri)
        return os.path.getsize(path) if os.path.isfile(path) else None
    try:
        info = _fs(uri).info(uri, refresh=True)
    except FileNotFoundError:
        return None
    return info["size"] if info.get("type") == "file" else None


def exists(uri: str) -> bool:
    return size(uri) is not None


def open_file(uri: str, mode: str = "rb") -> IO[Any]:
    if is_local(uri):
        return open(local_path(uri), mode)
    return _fs(uri).open(uri, mode)


def makedirs(uri: str) -> None:
    """A directory to write into; object stores have none to make."""
    if is_local(uri):
        os.makedirs(local_path(uri), exist_ok=True)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(uri: str, data: bytes) -> None:
    """Write a whole file so a reader sees all of it or none of it (the old content until
    then): locally a temporary file, fsynced and renamed over; on an object store one PUT."""
    if not is_local(uri):
        _fs(uri).pipe_file(uri, data)
        return
    path = local_path(uri)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def read_bytes(uri: str) -> bytes:
    """A whole file. On an object store one GET: an object replaced meanwhile is read as
    one version or the other (a file handle's ranged reads would fail on the change)."""
    if is_local(uri):
        with open(local_path(uri), "rb") as f:
            return f.read()
    return _fs(uri).cat_file(uri)


def remove_tree(uri: str) -> None:
    """Remove a directory (a prefix) and everything under it; nothing there is no error."""
    if is_local(uri):
        shutil.rmtree(local_path(uri), ignore_errors=True)
        return
    fs = _fs(uri)
    try:
        fs.rm(uri, recursive=True)
    except FileNotFoundError:
        pass


def move_tree(src: str, dst: str) -> None:
    """Locally a rename (atomic). An object store has none: a copy, then the source is removed."""
    if is_local(src):
        os.rename(local_path(src), local_path(dst))
        fsync_dir(os.path.dirname(local_path(dst)))
        return
    fs = _fs(src)
    fs.copy(src, dst, recursive=True)
    fs.rm(src, recursive=True)
