"""Prometheus metrics of the service: jobs by state, recoveries, request latency."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily


class ServiceMetrics:
    def __init__(self, count_by_state):
        self.registry = CollectorRegistry()
        self._count_by_state = count_by_state
        self.registry.register(self)
        self.restarts = Counter("etrain_job_restarts", "Worker-group restarts of jobs", registry=self.registry)
        self.steps_recomputed = Counter("etrain_steps_recomputed", "Training steps redone after failures",
                                        registry=self.registry)
        self.recovery_seconds = Histogram("etrain_recovery_seconds", "Seconds from a failure to the next step",
                                          buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600), registry=self.registry)
        self.request_seconds = Histogram("etrain_http_request_seconds", "API request latency",
                                         ["method", "route", "status"], registry=self.registry)
        self._seen: dict[str, tuple[int, int]] = {}

    def collect(self):
        # Read from the ledger at scrape time: the ledger, not this process, holds the truth.
        gauge = GaugeMetricFamily("etrain_jobs", "Jobs by state", labels=["state"])
        for state, n in self._count_by_state().items():
            gauge.add_metric([state], n)
        yield gauge

    def observe_job(self, job_id: str, info: dict[str, Any]) -> None:
        """Count recoveries the reconciler had not seen (since this process started)."""
        recoveries = [r for r in info["recovery_s"] if r is not None]
        seen, steps = self._seen.setdefault(job_id, (len(recoveries), info["steps_recomputed"]))
        for r in recoveries[seen:]:
            self.recovery_seconds.observe(r)
            self.restarts.inc()
        self.steps_recomputed.inc(max(0, info["steps_recomputed"] - steps))
        self._seen[job_id] = (len(recoveries), info["steps_recomputed"])
