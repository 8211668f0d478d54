"""A local Ray head for `etrain serve` when no RAY_ADDRESS is given."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time


class EmbeddedRay:
    """`ray start --head --block` in its own process group, so stopping the group stops
    every process the head started (Ray's own `ray stop` would end every Ray on the host)."""

    def __init__(self, *, gcs_port: int, dashboard_port: int, num_cpus: int | None, log_path: str,
                 extra_env: dict[str, str] | None = None):
        self.gcs_address = f"127.0.0.1:{gcs_port}"
        self.dashboard_url = f"http://127.0.0.1:{dashboard_port}"
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
        node.cmd = [_ray_bin(), "start", "--block", "--address", gcs_address, "--node-ip-address", "127.0.0.1",
                    "--num-cpus", str(num_cpus), "--resources", json.dumps(resources), "--disable-usage-stats",
                    # Nodes on one machine must not share ports: left to Ray, two clash.
                    *[arg for flag in ("--dashboard-agent-listen-port", "--metrics-export-port",
                                       "--runtime-env-agent-port", "--node-manager-port", "--object-manager-port",
                                       "--dashboard-agent-grpc-port")
                      for arg in (flag, str(_free_port()))]]
        return node

    def start(self, timeout: float = 120) -> None:
        env = {**os.environ, **self.env}
        env.pop("RAY_ADDRESS", None)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        if self.dashboard_url:
            self._wait_ready(timeout)
        else:
            self._wait_joined(timeout)

    def _wait_joined(self, timeout: float) -> None:
        """`ray start` says so once the node has registered with the head."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            with open(self.log_path, "rb") as log:
                if b"Ray runtime started" in log.read():
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"Ray node exited with code {self.proc.returncode}; see {self.log_path}")
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"Ray node did not join in {timeout:.0f}s; see {self.log_path}")

    def _wait_ready(self, timeout: float) -> None:
        """The head answers once its job agent takes submissions, not when the GCS is up."""
        from ray.job_submission import JobSubmissionClient

        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Ray head exited with code {self.proc.returncode}; see {self.log_path}")
            try:
                JobSubmissionClient(self.dashboard_url).submit_job(entrypoint="true")
                return
            except Exception:
                if time.time() > deadline:
                    self.stop()
                    raise RuntimeError(f"Ray head not ready after {timeout:.0f}s; see {self.log_path}") from None
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


def _ray_bin() -> str:
    return shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
