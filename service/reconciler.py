"""Keeps the ledger in step with Ray and the run directories.

Stateless between ticks: everything it needs is in the ledger, Ray's job table and the
run directory, so after an API restart the next tick simply picks up where things are.
"""

from __future__ import annotations

import asyncio
import logging
import time

from sqlalchemy.orm import Session, sessionmaker

from service import jobs, ledger, rundir
from service.gateway import Gateway, GatewayError
from service.lifecycle import IllegalTransition, JobState
from service.settings import Settings

log = logging.getLogger("etrain.reconciler")

# Phases of a live Ray job to its state: RUNNING only once a worker of the newest
# attempt has completed a step; while starting, the state stays as it is.
_LIVE = {rundir.TRAINING: JobState.RUNNING, rundir.RECOVERING: JobState.RECOVERING}
QUEUED_GRACE_S = 2.0  # leave a fresh job to the request that created it


class Reconciler:
    def __init__(self, sessions: sessionmaker[Session], settings: Settings, gateway: Gateway, metrics=None):
        self.sessions, self.settings, self.gateway, self.metrics = sessions, settings, gateway, metrics

    def tick(self) -> None:
        for job in ledger.active_jobs(self.sessions):
            try:
                self.reconcile(job)
            except (GatewayError, IllegalTransition) as e:
                log.warning("job %s: %s", job.id, e)
            except Exception:
                log.exception("job %s: reconcile failed", job.id)

    def reconcile(self, job: ledger.Job) -> None:
        state = JobState(job.state)
        if state == JobState.QUEUED and not job.cancel_requested:  # cancelled: never start it; stop it below
            if time.time() - job.updated_at > QUEUED_GRACE_S:
                jobs.submit(self.sessions, self.settings, self.gateway, job)
            return
        rd = rundir.run_dir(self.settings.runs_dir, job.id)
        status = self.gateway.status(job.submission_id)
        info = rundir.summary(rd)
        if self.metrics is not None:
            self.metrics.observe_job(job.id, info)
        update = {"restarts": info["restarts"]}
        phase = jobs.phase(job, info)
        finished = phase in (rundir.FINISHED, jobs.FINISHING)

        if job.cancel_requested:
            if status in ("PENDING", "RUNNING"):
                self.gateway.stop(job.submission_id)
            else:
                target = JobState.SUCCEEDED if finished else JobState.CANCELLED
                self._set(job, target, **update)
            return
        if status in ("PENDING", "RUNNING"):
            target = _LIVE.get(phase)
            if target is not None and (target != state):
                self._set(job, target, **update)
            elif job.restarts != info["restarts"]:
                ledger.update_job(self.sessions, job_id=job.id, **update)
            return
        # The Ray job has ended (or Ray no longer knows it).
        if finished:
            self._set(job, JobState.SUCCEEDED, **update)
        elif phase == rundir.FAILED:
            self._set(job, JobState.FAILED, error=(info.get("error") or {}).get("message"), **update)
        elif job.resubmits < self.settings.max_resubmits:
            # The driver died without a verdict: run it again; it resumes from its checkpoint.
            log.warning("job %s: Ray job %s ended %s without a verdict; resubmitting", job.id, job.submission_id, status)
            if state != JobState.RECOVERING:
                self._set(job, JobState.RECOVERING, **update)
            jobs.submit(self.sessions, self.settings, self.gateway, ledger.get_job(self.sessions, job_id=job.id),
                        resubmit=True)
        else:
            self._set(job, JobState.FAILED, error=f"the job's Ray driver was lost {job.resubmits + 1} times "
                      f"(last Ray status {status}); giving up", **update)

    def _set(self, job: ledger.Job, target: JobState, **fields) -> None:
        ledger.update_job(self.sessions, job_id=job.id, state=target, **fields)
        log.info("job %s: %s -> %s", job.id, job.state, target.value)

    async def run_forever(self) -> None:
        while True:
            await asyncio.to_thread(self.tick)
            await asyncio.sleep(self.settings.reconcile_interval_s)
