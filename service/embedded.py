"""A local Ray head for `etrain serve` when no RAY_ADDRESS is given."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from service.settings import without_secrets


class RayStartError(RuntimeError):
    """Ray did not start; the message is one line: the cause from its log, and the log's path."""


class EmbeddedRay:
    """`ray start --head --block` in its own process group, so stopping the group stops
    every process the head started (Ray's own `ray stop` would end every Ray on the host)."""

    def __init__(self, *, gcs_port: int, dashboard_port: int, num_cpus: int | None, log_path: str,
                 extra_env: dict[str, str] | None = None):
        self.gcs_address = f"127.0.0.1:{gcs_port}"
        self.dashboard_url = f"http://127.0.0.1:{dashboard_port}"
        self.ports = {"--ray-port": gcs_port, "--dashboard-port": dashboard_port}
        self.temp_dir: str | None = None  # made by start()
        self.cmd = [_ray_bin(), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs_port),
                    "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port),
                    "--disable-usage-stats", *(["--num-cpus", str(num_cpus)] if num_cpus else []),
                    # Its default port (52365) is taken when another Ray runs on this machine.
                    "--dashboard-agent-listen-port", str(_free_port())]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        from workers.run import POLL_ENV, POLL_S

        # What the head and so every job it runs sees on top of this process's environment.
        self.env = {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token"), POLL_ENV: POLL_S,
                    # Job entrypoints run with the head's environment: give them this interpreter.
                    "PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}", **(extra_env or {})}

    @classmethod
    def worker_node(cls, gcs_address: str, *, num_cpus: int, resources: dict[str, float], log_path: str,
                    env: dict[str, str]) -> EmbeddedRay:
        """Another node joining the head at `gcs_address`, on this machine: what a
        multi-node test adds and removes (stopping its process group is that node dying)."""
        import json

        node = cls.__new__(cls)
        node.gcs_address, node.dashboard_url, node.log_path, node.proc, node.env = gcs_address, None, log_path, None, env
        node.ports, node.temp_dir = {}, None
        node.cmd = [_ray_bin(), "start", "--block", "--address", gcs_address, "--node-ip-address", "127.0.0.1",
                    "--num-cpus", str(num_cpus), "--resources", json.dumps(resources), "--disable-usage-stats",
                    # Nodes on one machine must not share ports: left to Ray, two clash.
                    *[arg for flag in ("--dashboard-agent-listen-port", "--metrics-export-port",
                                       "--runtime-env-agent-port", "--node-manager-port", "--object-manager-port",
                                       "--dashboard-agent-grpc-port")
                      for arg in (flag, str(_free_port()))]]
        return node

    def child_env(self) -> dict[str, str]:
        """This process's environment for `ray start`, less what jobs must not see."""
        env = without_secrets({**os.environ, **self.env})
        env.pop("RAY_ADDRESS", None)
        return env

    def start(self, timeout: float = 120) -> None:
        from workers import ray_token

        # `ray start` refuses to start without a token where none was ever made.
        ray_token.ensure()
        for flag, port in self.ports.items():
            # Said plainly before Ray is asked: its own report of a taken port is a C++ check failure.
            if not port_free("127.0.0.1", port):
                raise RayStartError(f"port {port} on 127.0.0.1 is in use ({flag}); choose another port")
        cmd = self.cmd
        if self.dashboard_url:
            # A Ray job's driver joins "the latest cluster" recorded in <temp dir>/ray_current_cluster
            # (Ray's job supervisor sets its RAY_ADDRESS so): in the shared /tmp/ray, this head's
            # jobs joined whichever Ray had started last on the machine. A temp dir of its own
            # (short, as it holds unix sockets; owner-only) keeps them here. Joining nodes take the head's.
            self.temp_dir = tempfile.mkdtemp(prefix="etrain-ray-")
            cmd = [*cmd, "--temp-dir", self.temp_dir]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.child_env(),
                                         start_new_session=True)
        if self.dashboard_url:
            self._wait_ready(timeout)
        else:
            self._wait_joined(timeout)

    def _failed(self, what: str) -> RayStartError:
        cause = (log_cause(self.log_path) or "").rstrip(".")
        return RayStartError(f"{what}: {cause}; see {self.log_path}" if cause else f"{what}; see {self.log_path}")

    def _wait_joined(self, timeout: float) -> None:
        """`ray start` says so once the node has registered with the head."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            with open(self.log_path, "rb") as log:
                if b"Ray runtime started" in log.read():
                    return
            if self.proc.poll() is not None:
                raise self._failed(f"Ray node exited with code {self.proc.returncode}")
            time.sleep(0.5)
        self.stop()
        raise self._failed(f"Ray node did not join in {timeout:.0f}s")

    def _wait_ready(self, timeout: float) -> None:
        """The head answers once its job agent takes submissions, not when the GCS is up."""
        from ray.job_submission import JobSubmissionClient

        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise self._failed("the local Ray head did not start")
            try:
                JobSubmissionClient(self.dashboard_url).submit_job(entrypoint="true")
                return
            except Exception:
                if time.time() > deadline:
                    self.stop()
                    raise self._failed(f"the local Ray head was not ready after {timeout:.0f}s") from None
                time.sleep(1)

    def stop(self, grace_s: float = 10) -> None:
        if self.proc is None or self.proc.poll() is not None and not _group_alive(self.proc.pid):
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.time() + wait
            while time.time() < deadline and _group_alive(self.proc.pid):
                self.proc.poll()
                time.sleep(0.2)
            if not _group_alive(self.proc.pid):
                return


# ---------------------------------------------------------------- a log's cause in one line

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LOG_PREFIX = re.compile(r"^\[?\d{4}-\d\d-\d\d[ T][\d:.,]+\]?\s+(?:[A-Z]+\s+\S+ -- |\S+\s+)?")
_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Exit)): (.+)")
_ERROR_WORDS = re.compile(r"error|refused|failed|fatal|cannot|could not|denied", re.IGNORECASE)
MAX_CAUSE = 300


def log_cause(path: str, tail_bytes: int = 64_000) -> str | None:
    """The line of a log that says why a process failed: the last exception raised, else
    the last line that names an error, else the last line; shortened to one line."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return cause_of(text)


def cause_of(text: str) -> str | None:
    lines = [_LOG_PREFIX.sub("", _ANSI.sub("", line)).strip() for line in text.splitlines()]
    # Traceback frames name files and code, not causes.
    lines = [line for line in lines if line and not line.startswith(("File \"", "Traceback", "^", "~"))]
    if not lines:
        return None
    for line in reversed(lines):
        match = _EXCEPTION.match(line)
        if match:
            return _shorten(f"{match.group(1)}: {match.group(2)}")
    hit = next((line for line in reversed(lines) if _ERROR_WORDS.search(line)), lines[-1])
    return _shorten(hit)


def _shorten(line: str) -> str:
    """The first sentences of a long message, up to MAX_CAUSE characters."""
    line = " ".join(line.split())
    if len(line) <= MAX_CAUSE:
        return line
    cut = line.rfind(". ", 0, MAX_CAUSE)
    return line[:cut + 1] if cut > 40 else line[:MAX_CAUSE - 3] + "..."


# ---------------------------------------------------------------- ports and process groups

def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now (SO_REUSEADDR, as uvicorn and Ray bind)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _ray_bin() -> str:
    return shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
