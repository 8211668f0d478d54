"""Ray's token auth on a machine that never ran Ray.

Ray 2.60 turns token auth on for local clusters, but only `ray.init()` writes a token
where none exists; `ray start` (the head `etrain serve` and the tests start, and every
extra node) refuses to start without one. So everything here that starts or joins Ray
calls `ensure()` first: the head, every node, every job driver and every client then
read the same token. Ray's own generator writes the file with the default umask
(world-readable) and races with a second process writing at the same moment, hence
this small writer: exclusive create, owner-only, one winner.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

MODE_ENV, TOKEN_ENV, PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"


def token_path() -> Path:
    """Where Ray reads the token from: RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token."""
    return Path(os.environ.get(PATH_ENV) or Path.home() / ".ray" / "auth_token")


def ensure() -> Path | None:
    """Turn token auth on for this process and its children and make sure the token
    exists (0600). Returns the token file, or None when RAY_AUTH_TOKEN carries it.
    An explicit RAY_AUTH_MODE=disabled is the operator's choice and is kept."""
    os.environ.setdefault(MODE_ENV, "token")
    if os.environ[MODE_ENV].lower() != "token" or os.environ.get(TOKEN_ENV):
        return None
    path = token_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o077:
            path.chmod(0o600)  # written by an older Ray with the default umask
        # A process that won the create may not have written yet: give it a moment.
        for _ in range(50):
            if path.read_text().strip():
                return path
            time.sleep(0.05)
        raise RuntimeError(f"the Ray token file {path} is empty; delete it to have a new one made") from None
    with os.fdopen(fd, "w") as f:
        # Ray's own generator makes 32 hex digits from uuid4; 64 from the OS's CSPRNG is no weaker.
        f.write(secrets.token_hex(32))
        f.flush()
        os.fsync(f.fileno())
    return path
