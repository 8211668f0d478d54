"""A fake Ray gateway for tests where Ray is not the point (and for bench/)."""

from __future__ import annotations

import threading
from typing import Any, Sequence


class FakeGateway:
    dashboard_url = "http://127.0.0.1:8265"

    def __init__(self, cpus: float = 8, gpus: float = 0):
        self.submitted: dict[str, dict[str, Any]] = {}
        self.statuses: dict[str, str] = {}
        self.killed: list[tuple[int, str | None]] = []
        self.stopped: list[str] = []
        self.cpus, self.gpus = cpus, gpus
        self._lock = threading.Lock()

    def submit(self, *, submission_id: str, spec_path: str, job_id: str, code_path: str | None = None,
               requirements: Sequence[str] = ()) -> None:
        with self._lock:  # Ray refuses a second job with the same submission id
            if submission_id not in self.submitted:
                self.submitted[submission_id] = {"spec_path": spec_path, "job_id": job_id, "code_path": code_path,
                                                  "requirements": list(requirements)}
                self.statuses[submission_id] = "PENDING"

    def status(self, submission_id: str) -> str | None:
        return self.statuses.get(submission_id)

    def job_statuses(self) -> dict[str, str]:
        return {sid: status for sid in list(self.statuses) if (status := self.status(sid)) is not None}

    def logs(self, submission_id: str) -> str:
        return f"logs of {submission_id}\n"

    async def tail_logs(self, submission_id: str):
        yield f"logs of {submission_id}\n"

    def stop(self, submission_id: str) -> None:
        self.stopped.append(submission_id)
        if submission_id in self.submitted:  # Ray answers 404 for an id it does not hold, and keeps none
            self.statuses[submission_id] = "STOPPED"

    def kill_process(self, *, pid: int, node_id: str | None, submission_id: str | None = None,
                     job_id: str | None = None) -> None:
        self.killed.append((pid, node_id))

    def cluster(self) -> dict[str, Any]:
        return {"nodes": 1, "cpus": {"total": self.cpus, "free": self.cpus}, "gpus": {"total": self.gpus, "free": self.gpus},
                "ray_version": "fake", "dashboard_url": self.dashboard_url}

    def ping(self) -> None:
        pass
