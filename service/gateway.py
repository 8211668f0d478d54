"""Everything the service asks of Ray: the Jobs SDK for submit/status/logs/stop, the
state API for the cluster, and a Ray task to kill a worker process on its node."""

from __future__ import annotations

import shlex
import sys
from typing import Any, AsyncIterator, Protocol, Sequence

from service.settings import Settings


class GatewayError(RuntimeError):
    """Ray could not be reached or refused the request."""


class Gateway(Protocol):
    dashboard_url: str

    def submit(self, *, submission_id: str, spec_path: str, job_id: str, code_path: str | None = None,
               requirements: Sequence[str] = ()) -> None: ...
    def status(self, submission_id: str) -> str | None: ...
    def logs(self, submission_id: str) -> str: ...
    def tail_logs(self, submission_id: str) -> AsyncIterator[str]: ...
    def stop(self, submission_id: str) -> None: ...
    def kill_process(self, *, pid: int, node_id: str | None) -> None: ...
    def cluster(self) -> dict[str, Any]: ...
    def ping(self) -> None: ...


class RayGateway:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.dashboard_url = settings.dashboard_url.rstrip("/")
        self.python = settings.python or sys.executable
        self._client = None

    @property
    def client(self):
        if self._client is None:
            from ray.job_submission import JobSubmissionClient

            try:
                self._client = JobSubmissionClient(self.dashboard_url)
            except Exception as e:
                raise GatewayError(f"Ray Jobs API at {self.dashboard_url} unreachable: {e}") from e
        return self._client

    def connect(self) -> None:
        """Connect this process to Ray as a driver, for tasks and cluster resources.

        Call it from the main thread before installing signal handlers: ray.init installs
        a native SIGTERM handler that would otherwise end the process before cleanup."""
        self._driver()

    def _driver(self) -> None:
        from workers import ray_token

        ray_token.ensure()  # before ray's import, which reads RAY_AUTH_MODE once
        import ray

        if not ray.is_initialized():
            address = self.settings.ray_address or "auto"
            try:
                ray.init(address=address, namespace="etrain-service", log_to_driver=False, include_dashboard=False)
            except Exception as e:  # a wrong address or token: one line, not Ray's traceback
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise GatewayError(f"cannot connect to Ray at {address}: {first}") from e

    def submit(self, *, submission_id: str, spec_path: str, job_id: str, code_path: str | None = None,
               requirements: Sequence[str] = ()) -> None:
        """`code_path`: a stored code archive, the working directory of the driver and every
        worker (the Jobs SDK uploads it to the cluster); `requirements`: pip installs for them."""
        env = runtime_env(code_path, requirements)
        # With pip, Ray puts the job in a virtualenv of its own: `python` is that one's,
        # which this interpreter's absolute path would pass by.
        python = "python" if requirements else self.python
        # The very command a user would pass to `ray job submit`.
        entrypoint = f"{shlex.quote(python)} -m workers.run {shlex.quote(spec_path)}"
        try:
            self.client.submit_job(entrypoint=entrypoint, submission_id=submission_id,
                                   metadata={"etrain_job_id": job_id}, runtime_env=env)
        except RuntimeError as e:
            if "already exists" in str(e):  # resubmitting the same id is how we stay idempotent
                return
            raise GatewayError(f"Ray refused job {job_id}: {e}") from e
        except Exception as e:
            raise GatewayError(f"Ray refused job {job_id}: {e}") from e

    def status(self, submission_id: str) -> str | None:
        try:
            return str(self.client.get_job_status(submission_id).value)
        except RuntimeError as e:
            if "does not exist" in str(e) or "404" in str(e):
                return None
            raise GatewayError(str(e)) from e

    def logs(self, submission_id: str) -> str:
        try:
            return self.client.get_job_logs(submission_id)
        except Exception as e:
            raise GatewayError(str(e)) from e

    async def tail_logs(self, submission_id: str) -> AsyncIterator[str]:
        async for chunk in self.client.tail_job_logs(submission_id):
            yield chunk

    def stop(self, submission_id: str) -> None:
        try:
            self.client.stop_job(submission_id)
        except Exception as e:
            raise GatewayError(str(e)) from e

    def kill_process(self, *, pid: int, node_id: str | None) -> None:
        """SIGKILL a worker process, from a Ray task placed on the worker's node."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._driver()
        strategy = NodeAffinitySchedulingStrategy(node_id, soft=False) if node_id else "DEFAULT"
        try:
            killed = ray.get(_kill_task().options(scheduling_strategy=strategy).remote(pid), timeout=60)
        except Exception as e:
            raise GatewayError(f"could not reach the worker's node through Ray: {e}") from e
        if not killed:
            raise ProcessLookupError(pid)

    def cluster(self) -> dict[str, Any]:
        import ray

        self._driver()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        total, free = ray.cluster_resources(), ray.available_resources()
        return {
            "nodes": len(nodes),
            "cpus": {"total": total.get("CPU", 0), "free": free.get("CPU", 0)},
            "gpus": {"total": total.get("GPU", 0), "free": free.get("GPU", 0)},
            "ray_version": ray.__version__,
            "dashboard_url": self.dashboard_url,
        }

    def ping(self) -> None:
        try:
            self.client.get_version()
        except Exception as e:
            raise GatewayError(f"Ray Jobs API at {self.dashboard_url} unreachable: {e}") from e


def runtime_env(code_path: str | None, requirements: Sequence[str] = ()) -> dict[str, Any] | None:
    """The Ray runtime_env of a job: its code archive as working_dir (Ray takes a local .zip
    and uploads it), its requirements as pip. None when it has neither."""
    env: dict[str, Any] = {}
    if code_path:
        env["working_dir"] = str(code_path)
    if requirements:
        env["pip"] = list(requirements)
    return env or None


_kill = None


def _kill_task():
    """The remote function, made on first use: importing the service must not import ray."""
    global _kill
    if _kill is None:
        import ray

        @ray.remote(num_cpus=0)
        def kill(pid: int) -> bool:
            import os
            import signal

            # A pid is reused once its process ends: kill only a busy Ray worker (titled
            # `ray::<actor or task>`), never what took the pid of one that ended. Where
            # there is no /proc to ask (macOS) the pid is trusted. Inline, not a helper of
            # this module: the cluster may have only `workers/` installed.
            if os.path.isdir("/proc/self"):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        title = f.read()
                except OSError:
                    return False
                if not title.startswith(b"ray::") or title.startswith(b"ray::IDLE"):
                    return False
            try:
                os.kill(pid, signal.SIGKILL)
                return True
            except ProcessLookupError:
                return False

        _kill = kill
    return _kill

