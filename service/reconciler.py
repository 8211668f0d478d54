"""Keeps the ledger in step with Ray and the run directories.

Stateless between ticks: everything it needs is in the ledger, Ray's job table and the
run directory, so after an API restart the next tick simply picks up where things are
(it keeps the events it parsed only so as not to parse them again).
Each tick observes a job, asks service.decide what to do, and does it; every change to
a job's row is a compare-and-set, so any number of API replicas may reconcile one ledger.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from sqlalchemy.orm import Session, sessionmaker

from service import decide, jobs, ledger, rundir
from service.decide import Action, Do, Seen
from service.gateway import Gateway, GatewayError
from service.lifecycle import TERMINAL, IllegalTransition, JobState
from service.settings import Settings
from workers import events

log = logging.getLogger("etrain.reconciler")

QUEUED_GRACE_S = decide.QUEUED_GRACE_S
SEND_WINDOW_S = decide.SEND_WINDOW_S
MAX_BACKOFF_S = 30.0


class Health:
    """Whether ticks complete, for /readyz: a reconciler that keeps failing (the database
    down) or hangs (a call that never returns) must not look ready."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.last_ok: float | None = None
        self.failing_since: float | None = None
        self.error: str | None = None

    def ok(self) -> None:
        self.last_ok, self.failing_since, self.error = time.time(), None, None

    def failed(self, e: BaseException) -> None:
        self.failing_since = self.failing_since or time.time()
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        self.error = f"{type(e).__name__}: {first}"[:300]

    def problem(self, now: float | None = None) -> str | None:
        now = now or time.time()
        if self.failing_since is not None:
            return f"ticks failing for {now - self.failing_since:.0f}s: {self.error}"
        if self.last_ok is not None and now - self.last_ok > max(60.0, 20 * self.interval_s):
            return f"no tick completed for {now - self.last_ok:.0f}s"
        return None


class Reconciler:
    def __init__(self, sessions: sessionmaker[Session], settings: Settings, gateway: Gateway, metrics=None):
        self.sessions, self.settings, self.gateway, self.metrics = sessions, settings, gateway, metrics
        self.health = Health(settings.reconcile_interval_s)
        self.histories = events.Histories()

    def tick(self) -> None:
        active = ledger.active_jobs(self.sessions)
        # Ray's statuses in one call per tick, not one per job; fetched only when a job needs them.
        statuses = self.gateway.job_statuses() if any(self._asks_ray(job) for job in active) else {}
        # Oldest first (active_jobs' order): a queued job takes the room a job ahead of it left.
        on_ray = sum(job.state != JobState.QUEUED.value for job in active)
        self.histories.keep_only({rundir.run_dir(self.settings.runs_dir, job.id) for job in active})
        for job in active:
            room = self.settings.max_active_jobs is None or on_ray < self.settings.max_active_jobs
            try:
                action = self.reconcile(job, statuses, room)
                if action.do == Do.SUBMIT:
                    on_ray += 1
                elif action.state in TERMINAL and job.state != JobState.QUEUED.value:
                    on_ray -= 1
            except (GatewayError, IllegalTransition, ledger.Conflict) as e:
                log.warning("job %s: %s", job.id, e)
            except Exception:
                log.exception("job %s: reconcile failed", job.id)

    def reconcile(self, job: ledger.Job, statuses: dict[str, str] | None = None, room: bool = True) -> Action:
        """`statuses`: Ray's, from this tick's one call (None: ask Ray for this job's);
        `room`: whether ETRAIN_MAX_ACTIVE_JOBS lets one more job go to Ray now."""
        seen, info = self.observe(job, statuses, room)
        action = decide.decide(seen)
        self.carry_out(job, action, info)
        return action

    @staticmethod
    def _asks_ray(job: ledger.Job) -> bool:
        return bool(job.submission_id) and (job.state != JobState.QUEUED.value or job.cancel_requested)

    def observe(self, job: ledger.Job, statuses: dict[str, str] | None = None,
                room: bool = True) -> tuple[Seen, dict | None]:
        state = JobState(job.state)
        now = time.time()
        if not self._asks_ray(job) and state == JobState.QUEUED:  # nothing to ask of Ray or storage yet
            return Seen(state=state, idle_s=now - job.updated_at, room=room), None
        if not job.submission_id:
            status = None
        elif statuses is not None:
            status = statuses.get(job.submission_id)
        else:
            status = self.gateway.status(job.submission_id)
        rd = rundir.run_dir(self.settings.runs_dir, job.id)
        info = rundir.summary(rd, self.histories.of(rd))
        if self.metrics is not None:
            self.metrics.observe_job(job.id, info)
        phase = jobs.phase(job, info)
        starting = phase == rundir.STARTING and job.waiting_since is not None
        timeout = (job.spec_dict.get("resources") or {}).get("scheduling_timeout_s")
        return Seen(state=state, cancel_requested=job.cancel_requested, ray_status=status, phase=phase,
                    pending_submission=job.pending_submission, resubmits=job.resubmits,
                    max_resubmits=self.settings.max_resubmits, idle_s=now - job.updated_at,
                    waiting_s=now - job.waiting_since if starting else None, scheduling_timeout_s=timeout,
                    sending_s=now - job.sending_since if job.sending_since is not None else None,
                    run_error=(info.get("error") or {}).get("message"),
                    restarts_changed=job.restarts != info["restarts"]), info

    def carry_out(self, job: ledger.Job, action: Action, info: dict | None) -> None:
        fields = {"restarts": info["restarts"]} if info is not None else {}
        if info is not None and info["phase"] != rundir.STARTING and job.waiting_since is not None:
            fields["waiting_since"] = None  # a worker has stepped: it no longer waits for resources
        match action.do:
            case Do.NOTHING:
                pass
            case Do.SUBMIT:
                jobs.submit(self.sessions, self.settings, self.gateway, job)
            case Do.RESUBMIT:
                log.warning("job %s: Ray job %s ended without a verdict; resubmitting", job.id, job.submission_id)
                jobs.resubmit(self.sessions, self.settings, self.gateway, job)
            case Do.RETRY_SUBMIT:
                jobs.send(self.sessions, self.settings, self.gateway, job)
            case Do.CONFIRM:
                jobs.accepted(self.sessions, self.gateway, job)
            case Do.STOP:
                self.gateway.stop(job.submission_id)
                if action.state is not None:
                    self._set(job, action.state, error=action.error, **fields)
            case Do.SET_STATE:
                extra = {"error": action.error} if action.error else {}
                self._set(job, action.state, **extra, **fields)
            case Do.SYNC:
                ledger.update_job(self.sessions, job_id=job.id, **fields)
        if info is not None:
            self._keep_summary(job, info)

    def _keep_summary(self, job: ledger.Job, info: dict) -> None:
        """The job's view, kept in the ledger: GET /v1/jobs reads no run record."""
        if job.summary_dict != json.loads(json.dumps(info, default=str)):
            ledger.save_summary(self.sessions, job_id=job.id, summary=info)

    def _set(self, job: ledger.Job, target: JobState, **fields) -> None:
        # Compare-and-set on what this tick saw: a cancel recorded since wins over it, and
        # so does any other change to the row since (the creating request's submission
        # landing, a resubmission claimed or confirmed). Else a tick that saw a cancelled
        # QUEUED job Ray did not know yet would mark it CANCELLED after the request had
        # made it SUBMITTED, leaving that Ray job running; the next tick sees it afresh.
        expect = {"state": job.state, "submission_id": job.submission_id,
                  "pending_submission": job.pending_submission, "sending_since": job.sending_since}
        if not job.cancel_requested:
            expect["cancel_requested"] = False
        ledger.update_job(self.sessions, job_id=job.id, state=target, expect=expect, **fields)
        log.info("job %s: %s -> %s", job.id, job.state, target.value)

    async def run_forever(self) -> None:
        """Tick until cancelled. A failing tick (the ledger or Ray down) is logged and
        retried with a growing pause; nothing ends the loop but its cancellation."""
        interval = delay = self.settings.reconcile_interval_s
        while True:
            try:
                await asyncio.to_thread(self.tick)
                self.health.ok()
                delay = interval
            except Exception as e:
                self.health.failed(e)
                log.error("reconciler tick failed (retrying in %.0fs): %s", delay, self.health.error)
                delay = min(delay * 2, MAX_BACKOFF_S)
            await asyncio.sleep(delay)
