"""A real, throwaway PostgreSQL server for tests: initdb into a fresh directory, pg_ctl
start on 127.0.0.1 (and a unix socket in that directory), stop with `pg_ctl stop -m fast`.

    with postgres_server() as pg:          # or the `postgres_server` fixture below
        url = pg.create_database("t1")      # postgresql+psycopg://postgres@127.0.0.1:PORT/t1
        pg.stop(); pg.start()               # an outage on the same data dir and port

initdb and postgres refuse to run as root, so as root the server runs as the `postgres`
user if there is one, else `nobody`, in a directory made for (and owned by) that user;
pytest's own tmp dirs are root-only (0700) and so unusable. Binaries: $PG_BIN, else the
newest /usr/lib/postgresql/<ver>/bin, else initdb on PATH.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SUPERUSER = "postgres"  # the database role made by initdb; trust auth, no password


def pg_bin() -> Path | None:
    """Where initdb/pg_ctl live, or None when PostgreSQL is not installed."""
    if os.environ.get("PG_BIN"):
        return Path(os.environ["PG_BIN"])
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                      key=lambda p: [int(n) for n in re.findall(r"\d+", p.parent.parent.name)] or [0])
    if versions:
        return versions[-1].parent
    found = shutil.which("initdb")
    return Path(found).resolve().parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_user() -> pwd.struct_passwd | None:
    """The unprivileged account to run PostgreSQL as, or None to run as ourselves."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("running as root and there is no 'postgres' or 'nobody' user for PostgreSQL to run as")


@dataclass
class Postgres:
    bin: Path
    base: Path  # holds data/, the unix socket and server.log; removed by `destroy`
    port: int
    user: pwd.struct_passwd | None = None
    databases: list[str] = field(default_factory=list)

    @property
    def data_dir(self) -> Path:
        return self.base / "data"

    @property
    def log_path(self) -> Path:
        return self.base / "server.log"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        kw = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []} if self.user else {}
        done = subprocess.run([str(self.bin / args[0]), *args[1:]], check=False, cwd=self.base, capture_output=True,
                              text=True, env={**os.environ, "LC_ALL": "C"}, timeout=120, **kw)
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stdout}{done.stderr}\n"
                               f"{self.log_tail()}")
        return done

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data_dir), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8",
                  "--no-locale", "--no-sync")

    def start(self) -> None:
        # fsync off: a test server need not survive power loss; `stop -m fast` still
        # shuts down cleanly, so a stop/start keeps every committed row.
        opts = f"-h 127.0.0.1 -p {self.port} -k {self.base} -c fsync=off -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_path), "-o", opts, "-w", "-t", "60",
                  "start")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (fast: roll back open transactions, drop connections)."""
        if self.running():
            self._run("pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    def running(self) -> bool:
        return self.data_dir.exists() and self._run("pg_ctl", "-D", str(self.data_dir), "status",
                                                    check=False).returncode == 0

    def create_database(self, name: str) -> str:
        """A new, empty database; its SQLAlchemy URL."""
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user=SUPERUSER, dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        self.databases.append(name)
        return self.url(name)

    def destroy(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        shutil.rmtree(self.base, ignore_errors=True)


@contextlib.contextmanager
def postgres_server() -> Iterator[Postgres]:
    """A started server, stopped and deleted on exit whatever happened inside."""
    bin_dir = pg_bin()
    if bin_dir is None or not (bin_dir / "initdb").exists():
        # A failure, not a skip: the ledger's PostgreSQL tests are acceptance tests, and
        # .ci/run installs the server where a machine lacks it.
        pytest.fail("PostgreSQL server binaries not found: install postgresql (apt) or set PG_BIN")
    user = _server_user()
    base = Path(tempfile.mkdtemp(prefix="etrain-pg-"))
    if user is not None:
        os.chown(base, user.pw_uid, user.pw_gid)
    pg = Postgres(bin_dir, base, _free_port(), user)
    try:
        pg.init()
        for tries_left in (2, 1, 0):
            try:
                pg.start()
                break
            except RuntimeError:  # the free port was taken again before the server bound it
                if not tries_left:
                    raise
                pg.port = _free_port()
        yield pg
    finally:
        pg.destroy()


@pytest.fixture(scope="session")
def postgres_session_server() -> Iterator[Postgres]:
    """One server for the session (import this fixture into a test module to use it)."""
    with postgres_server() as pg:
        yield pg


@pytest.fixture
def postgres_url(postgres_session_server, request) -> str:
    """A fresh database on the session's server, named after the test."""
    name = re.sub(r"\W+", "_", request.node.name).lower()[:40] + f"_{len(postgres_session_server.databases)}"
    return postgres_session_server.create_database(name)
