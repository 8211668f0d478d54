"""Code archives users ship with their jobs: stored once by content (POST /v1/code), checked
before they are kept, unpacked to check a job's task, and handed to Ray as the workers'
working directory. Nothing here imports what an archive holds."""

from __future__ import annotations

import hashlib
import io
import os
import re
import stat
import tempfile
import zipfile
import zlib
from pathlib import Path

from service.settings import Settings
from workers.storage import fsync_dir

ID = re.compile(r"^[0-9a-f]{16,64}$")  # what JobSpec.code accepts; stored ids are full sha256 digests
# A zip may unpack to far more than it weighs; Ray unpacks it on every node.
UNPACKED_PER_PACKED = 10
# Ray runs `python -m workers.run` inside the unpacked archive, and puts it first on every
# worker's path: a top-level `workers` of the user's would stand in for elastic-train's.
SHADOWED = ("workers",)
SKIP_DIRS = {"__pycache__", ".git"}
SKIP_SUFFIXES = (".pyc",)
ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest a zip can hold: the same tree gives the same bytes


class BadArchive(ValueError):
    """Not a zip, or one whose entries the service will not unpack; the message names the entry."""


class TooLarge(ValueError):
    """The archive is over the service's limit."""


def code_dir(settings: Settings) -> Path:
    return settings.data_dir / "code"


def archive_path(settings: Settings, code_id: str) -> Path | None:
    """Where the archive `code_id` is kept, or None when the id cannot be one (never a path elsewhere)."""
    if not isinstance(code_id, str) or not ID.match(code_id):
        return None
    return code_dir(settings) / f"{code_id}.zip"


def stored(settings: Settings, code_id: str) -> Path | None:
    """The path of a stored archive, or None when there is none."""
    path = archive_path(settings, code_id)
    return path if path is not None and path.is_file() else None


def info(settings: Settings, code_id: str) -> dict | None:
    path = stored(settings, code_id)
    if path is None:
        return None
    st = path.stat()
    return {"id": code_id, "size": st.st_size, "created": st.st_mtime}


# ---------------------------------------------------------------- checking an archive


def entry_problem(entry: zipfile.ZipInfo) -> str | None:
    """Why an entry may not be unpacked, or None when it may."""
    name = entry.filename.replace("\\", "/")
    if name.startswith("/"):
        return "is an absolute path"
    if re.match(r"^[A-Za-z]:", name):
        return "names a drive"
    if ".." in name.split("/"):
        return "climbs out of the archive's root (a '..' component)"
    if stat.S_ISLNK(entry.external_attr >> 16):
        return "is a symbolic link"
    top = name.split("/", 1)[0]
    for package in SHADOWED:
        if top == package and ("/" in name or entry.is_dir()) or top == f"{package}.py":
            return (f"is a top-level {package!r}, which would hide elastic-train's own {package!r} package from "
                    "the workers; rename it")
    return None


def check_archive(path: str | os.PathLike, *, max_unpacked: int) -> int:
    """Raise BadArchive unless `path` is a zip every entry of which stays inside its root
    (and whose contents read back intact). Returns the number of entries."""
    try:
        with zipfile.ZipFile(path) as zf:
            entries = zf.infolist()
            total = 0
            for entry in entries:
                problem = entry_problem(entry)
                if problem:
                    raise BadArchive(f"entry {entry.filename!r} {problem}")
                total += entry.file_size
            if total > max_unpacked:
                raise BadArchive(f"the archive unpacks to {total} bytes; at most {max_unpacked} are allowed")
            corrupt = zf.testzip()
    except BadArchive:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error) as e:
        raise BadArchive(f"the body is not a readable zip archive: {e}") from None
    except (RuntimeError, NotImplementedError) as e:  # encrypted, or a compression zipfile lacks
        raise BadArchive(f"the archive cannot be unpacked: {e}") from None
    if corrupt is not None:
        raise BadArchive(f"entry {corrupt!r} is corrupt (its checksum does not match)")
    return len(entries)


# ---------------------------------------------------------------- storing an upload


class Upload:
    """An archive arriving in pieces: written to a temporary file beside the store, counted
    and hashed as it comes, then checked and renamed into place (atomic)."""

    def __init__(self, settings: Settings):
        self.settings, self.limit = settings, settings.max_code_bytes
        self.dir = code_dir(settings)
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(dir=self.dir, prefix=".upload-", suffix=".zip")
        self.file = os.fdopen(fd, "wb")
        self.size, self.digest = 0, hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise TooLarge(too_large(self.limit))
        self.digest.update(chunk)
        self.file.write(chunk)

    def finish(self) -> tuple[str, bool]:
        """Check and keep the archive. Returns (id, created): created is False when the
        same bytes were stored before."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        check_archive(self.tmp, max_unpacked=UNPACKED_PER_PACKED * self.limit)
        code_id = self.digest.hexdigest()
        final = self.dir / f"{code_id}.zip"
        if final.is_file():
            return code_id, False
        os.chmod(self.tmp, 0o644)
        os.replace(self.tmp, final)  # the same bytes racing in from two requests: either is right
        fsync_dir(str(self.dir))
        return code_id, True

    def discard(self) -> None:
        """Remove the temporary file (a no-op once it has been renamed)."""
        if not self.file.closed:
            self.file.close()
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def too_large(limit: int) -> str:
    return f"code archive over {limit} bytes (the service's ETRAIN_MAX_CODE_BYTES); leave data and virtual " \
           "environments out of it"


def unpack(path: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Unpack a stored (so already checked) archive into `dest`."""
    with zipfile.ZipFile(path) as zf:
        zf.extractall(dest)


# ---------------------------------------------------------------- making an archive (the CLI)


def make_archive(directory: str | os.PathLike) -> bytes:
    """A zip of a directory's files, the same bytes for the same tree: sorted names, fixed
    times and modes, no __pycache__, .git or *.pyc. Files are stored relative to the
    directory (Ray unpacks the archive as the working directory)."""
    root = Path(directory)
    files = []
    for here, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        for name in names:
            path = Path(here) / name
            if name.endswith(SKIP_SUFFIXES) or not path.is_file():
                continue
            files.append((path.relative_to(root).as_posix(), path))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, path in sorted(files):
            entry = zipfile.ZipInfo(name, date_time=ZIP_TIME)
            entry.create_system = 3  # unix: the mode below means what it says everywhere
            mode = 0o755 if os.access(path, os.X_OK) else 0o644
            entry.external_attr = (stat.S_IFREG | mode) << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(entry, path.read_bytes())
    return buffer.getvalue()
