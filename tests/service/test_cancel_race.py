"""Cancel racing the reconciler, 50 times: every cancelled job ends CANCELLED and never
runs again. Real PostgreSQL, real Ray, two real `etrain serve` replicas on one ledger,
reconciling every 50 ms; every cancel goes through the replica that did not create the job.

(a) cancel vs the first submission: POST to one replica and cancel through the other
    while the POST is still submitting to Ray (retrying the cancel until the row exists),
    or the moment the POST answers.
(b) cancel vs a resubmission: the job's Ray driver is SIGKILLed while it starts, and
    the cancel comes the moment the driver dies, the moment Ray reports it FAILED, the
    moment a reconciler has claimed the next submission in the ledger, or the moment Ray
    has that next submission.

Every one ends CANCELLED. Then, for 3 s (60 reconcile intervals of each replica), none
of them has a PENDING or RUNNING Ray job and none gains a submission: not in the ledger's
fencing count, not in Ray's job list (which holds only submissions the ledger claimed).
None was handed to Ray after the ledger said CANCELLED, no driver of one wrote
`job_started` after that, and no driver process of one is left on the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from service.gateway import auth_headers
from tests.helpers.postgres import postgres_session_server, postgres_url  # noqa: F401 (fixtures)
from tests.service.conftest import TOKEN, start_api, stop_api
from workers import events

pytestmark = pytest.mark.ray

INTERVAL_S = 0.05         # each replica's reconcile interval
FIRST_RACES = 30          # (a)
RESUBMIT_RACES = 20       # (b)
AT_ONCE = 6               # races in flight: each starts a Ray supervisor and a driver, on 2 cores
QUIET_S = 3.0             # 60 reconcile intervals of each replica after the last CANCELLED
LIVE = {"PENDING", "RUNNING"}
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
# (a): seconds after the POST is sent that the cancel goes out (None: once the POST has answered)
FIRST_DELAYS = [0.0, 0.003, 0.01, 0.02, 0.04, 0.08, None]
# (b): when the cancel goes out after the driver is killed
LOST_TRIGGERS = ["killed", "ray_failed", "claimed", "ray_has_next"]


def tiny(job_id: str) -> dict:
    return {"job_id": job_id, "model": "simple_cnn", "workers": 1,
            "dataset": {"name": "synthetic", "size": 64},
            "training": {"max_steps": 20, "global_batch_size": 16, "seed": 1},
            "checkpoint": {"every_steps": 10}}


def workers_run_processes():
    """(pid, argv) of every `python -m workers.run` process on the machine (not the `sh -c`
    Ray may wrap one in, whose argv holds the command as one string)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"workers.run" in argv:
            yield int(entry.name), argv


def driver_pids(spec_paths: set[bytes]) -> dict[bytes, int]:
    """The driver process of each spec path found."""
    return {path: pid for pid, argv in workers_run_processes() for path in spec_paths.intersection(argv)}


def drivers_under(runs_dir: Path) -> dict[int, str]:
    """Every driver process running a spec under `runs_dir`: pid -> spec."""
    prefix = str(runs_dir).encode() + b"/"
    return {pid: a.decode() for pid, argv in workers_run_processes() for a in argv if a.startswith(prefix)}


class Race:
    """The test's clients: both replicas, Ray's Jobs API and the ledger itself."""

    def __init__(self, a_url: str, b_url: str, dashboard: str, db_url: str):
        auth = {"Authorization": f"Bearer {TOKEN}"}
        # Idle connections dropped well before uvicorn closes them (5 s): reusing one as the
        # server closes it is a ReadError, not an answer.
        limits = httpx.Limits(keepalive_expiry=1.0)
        self.a = httpx.AsyncClient(base_url=a_url, headers=auth, timeout=60, limits=limits)
        self.b = httpx.AsyncClient(base_url=b_url, headers=auth, timeout=60, limits=limits)
        self.ray = httpx.AsyncClient(base_url=dashboard, headers=auth_headers(), timeout=30, limits=limits)
        self.db = create_engine(db_url, pool_size=8)
        self.threads = ThreadPoolExecutor(8)
        self.cancelled: dict[str, dict] = {}  # job -> what was seen when it was first seen CANCELLED
        self.notes: dict[str, str] = {}
        self.cancelled_at: dict[str, float] = {}  # job -> when the ledger was first seen to hold it CANCELLED
        self.drivers: dict[bytes, asyncio.Future] = {}  # spec path -> its driver's pid, once seen

    async def watch_ledger(self) -> None:
        """Note when each job is first seen CANCELLED in the ledger (wall clock, as Ray's
        start_time is; read after the query, so never before it became CANCELLED)."""
        while True:
            ids = await self.blocking(self._cancelled_ids)
            now = time.time()
            for job_id in ids:
                self.cancelled_at.setdefault(job_id, now)
            await asyncio.sleep(0.02)

    async def watch_drivers(self) -> None:
        """One scan of /proc every 20 ms for the drivers the races wait for."""
        while True:
            waiting = {path for path, pid in self.drivers.items() if not pid.done()}
            if waiting:
                for path, pid in (await self.blocking(driver_pids, waiting)).items():
                    if not self.drivers[path].done():
                        self.drivers[path].set_result(pid)
            await asyncio.sleep(0.02)

    async def driver(self, spec_path: str) -> int:
        self.drivers[spec_path.encode()] = asyncio.get_running_loop().create_future()
        return await asyncio.wait_for(self.drivers[spec_path.encode()], 120)

    def _cancelled_ids(self) -> list[str]:
        with self.db.connect() as conn:
            return list(conn.execute(text("SELECT id FROM jobs WHERE state = 'CANCELLED'")).scalars())

    async def close(self) -> None:
        for c in (self.a, self.b, self.ray):
            await c.aclose()
        self.threads.shutdown(wait=False, cancel_futures=True)
        self.db.dispose()

    async def blocking(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.threads, fn, *args)

    # ------------------------------------------------------------ what the ledger and Ray hold

    def _rows(self, ids: list[str] | None) -> dict[str, dict]:
        with self.db.connect() as conn:
            rows = conn.execute(text("SELECT id, state, submissions, submission_id, pending_submission, "
                                     "cancel_requested, resubmits, updated_at FROM jobs")).mappings().all()
        return {r["id"]: dict(r) for r in rows if ids is None or r["id"] in ids}

    async def rows(self, ids: list[str] | None = None) -> dict[str, dict]:
        return await self.blocking(self._rows, ids)

    async def row(self, job_id: str) -> dict:
        return (await self.rows([job_id]))[job_id]

    async def ray_status(self, submission_id: str) -> str | None:
        r = await self.ray.get(f"/api/jobs/{submission_id}")
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()["status"]

    async def ray_jobs(self, ids: set[str]) -> dict[str, list[dict]]:
        """Ray's submissions of each of `ids`, by the etrain_job_id the service tags them with."""
        r = await self.ray.get("/api/jobs/")
        r.raise_for_status()
        out: dict[str, list[dict]] = {i: [] for i in ids}
        for info in r.json():
            owner = (info.get("metadata") or {}).get("etrain_job_id")
            if owner in out:
                out[owner].append({k: info.get(k) for k in ("submission_id", "status", "start_time", "end_time")})
        return out

    # ------------------------------------------------------------ the races

    async def cancel(self, job_id: str) -> httpx.Response:
        """POST .../cancel through replica B, again while B does not know the job yet."""
        deadline = time.monotonic() + 30
        while True:
            r = await self.b.post(f"/v1/jobs/{job_id}/cancel")
            if r.status_code != 404 or time.monotonic() > deadline:
                return r
            await asyncio.sleep(0.002)

    async def settle(self, job_id: str, timeout: float = 90) -> None:
        """Poll GET /v1/jobs/{id} (both replicas in turn) until the job has ended; note what
        the ledger and Ray held at that moment."""
        since = time.monotonic()
        deadline = since + timeout
        for n in range(10**9):
            try:
                job = (await (self.a if n % 2 else self.b).get(f"/v1/jobs/{job_id}")).raise_for_status().json()
            except httpx.TransportError:  # a read may be retried; a busy replica's dropped connection is no answer
                await asyncio.sleep(0.1)
                continue
            if job["state"] in TERMINAL:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"job {job_id} still {job['state']} {timeout:.0f}s after its cancel "
                            f"({self.notes.get(job_id)}): ledger {await self.row(job_id)}, "
                            f"Ray {(await self.ray_jobs({job_id}))[job_id]}")
            await asyncio.sleep(0.1)
        self.cancelled[job_id] = {"state": job["state"], "after_s": time.monotonic() - since,
                                  "ledger": await self.row(job_id),
                                  "ray": (await self.ray_jobs({job_id}))[job_id], "note": self.notes.get(job_id)}

    async def first_submission(self, job_id: str, delay: float | None) -> None:
        """(a): POST to A; cancel through B `delay` s after the POST went out, or once it answered."""
        post = asyncio.create_task(self.a.post("/v1/jobs", json=tiny(job_id)))
        if delay is None:
            created = await post
            cancelled = await self.cancel(job_id)
        else:
            await asyncio.sleep(delay)
            cancelled = await self.cancel(job_id)
            created = await post
        assert created.status_code == 201, created.text
        assert cancelled.status_code == 200, cancelled.text
        self.notes[job_id] = (f"cancel {'after the POST' if delay is None else f'{delay * 1000:g} ms into the POST'}"
                              f", POST answered {created.json()['state']}, cancel answered {cancelled.json()['state']}")
        await self.settle(job_id)

    async def resubmission(self, job_id: str, spec_path: str, trigger: str) -> None:
        """(b): POST to A; SIGKILL the job's driver as soon as it exists; cancel through B at `trigger`."""
        created = await self.a.post("/v1/jobs", json=tiny(job_id))
        assert created.status_code == 201, created.text
        try:
            pid = await self.driver(spec_path)
        except TimeoutError:
            pytest.fail(f"no driver of {job_id} started: {await self.row(job_id)}")
        os.kill(pid, signal.SIGKILL)
        first, second = f"etrain-{job_id}-1", f"etrain-{job_id}-2"
        deadline = time.monotonic() + 60
        while trigger != "killed":
            if trigger == "ray_failed" and await self.ray_status(first) not in LIVE:
                break
            if trigger == "claimed" and (await self.row(job_id))["submissions"] >= 2:
                break
            if trigger == "ray_has_next" and await self.ray_status(second) is not None:
                break
            assert time.monotonic() < deadline, f"{job_id}: never saw {trigger}: {await self.row(job_id)}"
            await asyncio.sleep(0.003)
        seen = await self.row(job_id)
        cancelled = await self.cancel(job_id)
        assert cancelled.status_code == 200, cancelled.text
        self.notes[job_id] = (f"driver {pid} killed, cancel at {trigger} (ledger then: {seen['state']}, "
                              f"submission {seen['submissions']}, pending {seen['pending_submission']})")
        await self.settle(job_id)


async def at_most(n: int, coros: list) -> None:
    """Run `coros`, `n` at a time, in order."""
    slots = asyncio.Semaphore(n)

    async def one(coro):
        async with slots:
            await coro

    await asyncio.gather(*map(one, coros))


def test_cancel_racing_the_reconciler_fifty_times(ray_cluster, postgres_url, tmp_path):  # noqa: F811
    env = {"DATABASE_URL": postgres_url, "ETRAIN_RECONCILE_INTERVAL_S": str(INTERVAL_S)}
    apis = []
    try:
        with ThreadPoolExecutor(2) as pool:  # both replicas start together: they share the ledger's upgrade
            starts = [pool.submit(start_api, ray_cluster, tmp_path, env=env) for _ in range(2)]
            for s in starts:
                apis.append(s.result())
        asyncio.run(_races(apis, ray_cluster, postgres_url, tmp_path))
    except BaseException:
        for log in sorted(tmp_path.glob("api-*.log")):
            print(f"--- {log.name} (tail)\n{log.read_text(errors='replace')[-4000:]}")
        raise
    finally:
        for api in apis:
            stop_api(api)
        for pid in drivers_under(tmp_path / "runs"):  # a driver Ray lost track of outlives its head
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def _races(apis, cluster, db_url: str, data_dir: Path) -> None:
    race = Race(apis[0].url, apis[1].url, cluster.dashboard, db_url)
    watchers = [asyncio.create_task(race.watch_ledger()), asyncio.create_task(race.watch_drivers())]
    try:
        started = time.monotonic()
        firsts = [f"first-{i:02d}" for i in range(FIRST_RACES)]
        lost = [f"lost-{i:02d}" for i in range(RESUBMIT_RACES)]
        a = iter([race.first_submission(job_id, FIRST_DELAYS[i % len(FIRST_DELAYS)])
                  for i, job_id in enumerate(firsts)])
        b = iter([race.resubmission(job_id, str(data_dir / "runs" / job_id / "spec.json"),
                                    LOST_TRIGGERS[i % len(LOST_TRIGGERS)]) for i, job_id in enumerate(lost)])
        # Interleaved, 2 of (b) in every 5: a lost driver's race waits on Ray more than on the CPUs.
        races = [next(b) if i % 5 in (0, 2) else next(a) for i in range(FIRST_RACES + RESUBMIT_RACES)]
        await at_most(AT_ONCE, races)
        ids = firsts + lost
        raced_s = time.monotonic() - started

        # Every cancelled job ended CANCELLED, through either replica.
        ended = {j: seen["state"] for j, seen in race.cancelled.items()}
        assert ended == {j: "CANCELLED" for j in ids}, \
            {j: race.cancelled[j] for j in ids if ended.get(j) != "CANCELLED"}

        # Nothing of theirs runs, and nothing is submitted again, for QUIET_S.
        before_rows, before_ray = await race.rows(ids), await race.ray_jobs(set(ids))
        live_seen: dict[str, list] = {}
        quiet_until = time.monotonic() + QUIET_S
        while time.monotonic() < quiet_until:
            for job_id, subs in (await race.ray_jobs(set(ids))).items():
                live = [s for s in subs if s["status"] in LIVE]
                if live:
                    live_seen.setdefault(job_id, []).append(live)
            await asyncio.sleep(0.25)
        after_rows, after_ray = await race.rows(ids), await race.ray_jobs(set(ids))

        # No driver process of theirs is left on this machine either: Ray's job list shows
        # only what its supervisors track, not a driver they lost hold of.
        left = await race.blocking(drivers_under, data_dir / "runs")
        assert not left, {pid: (spec, race.notes.get(Path(spec).parent.name),
                                race.cancelled.get(Path(spec).parent.name)) for pid, spec in left.items()}
        assert not live_seen, {j: {"Ray (live)": live[-1], "when first seen CANCELLED": race.cancelled[j],
                                   "ledger now": after_rows[j]} for j, live in live_seen.items()}
        for job_id in ids:
            seen, row = race.cancelled[job_id], after_rows[job_id]
            assert row["state"] == "CANCELLED", (job_id, row)
            # The ledger's fencing count never moves once a job is CANCELLED ...
            assert row["submissions"] == seen["ledger"]["submissions"] == before_rows[job_id]["submissions"], \
                (job_id, seen, row)
            # ... and Ray holds no submission the ledger did not claim, none new since.
            ray_ids = sorted(s["submission_id"] for s in after_ray[job_id])
            claimed = [f"etrain-{job_id}-{n}" for n in range(1, row["submissions"] + 1)]
            assert set(ray_ids) <= set(claimed), (job_id, ray_ids, row, seen)
            assert ray_ids == sorted(s["submission_id"] for s in before_ray[job_id]) \
                == sorted(s["submission_id"] for s in seen["ray"]), (job_id, seen, after_ray[job_id])
            assert all(s["status"] not in LIVE for s in after_ray[job_id]), (job_id, after_ray[job_id])
            # ... nor one Ray was handed after the ledger said CANCELLED (a driver started after it).
            late = [s for s in after_ray[job_id] if s["start_time"] / 1000 > race.cancelled_at[job_id]]
            assert not late, (f"{job_id}: Ray was handed {[s['submission_id'] for s in late]} after the ledger "
                              f"had it CANCELLED (seen at {race.cancelled_at[job_id]:.3f}): {after_ray[job_id]}; "
                              f"ledger {row}; {race.notes[job_id]}")
            # ... and no driver of it got going (its run record's job_started) once it was CANCELLED.
            went = [e for e in events.events(str(data_dir / "runs" / job_id), "job_started")
                    if e["time"] > race.cancelled_at[job_id]]
            assert not went, (job_id, went, race.cancelled_at[job_id], race.notes[job_id], after_ray[job_id])

        # (b) really raced resubmissions: some jobs were resubmitted before their cancel won.
        resubmitted = [j for j in lost if after_rows[j]["submissions"] >= 2]
        assert resubmitted, {j: race.notes[j] for j in lost}
        waits = sorted(race.cancelled[j]["after_s"] for j in ids)
        print(f"\n{len(ids)} cancels in {raced_s:.1f}s (cancel to CANCELLED: median {waits[len(waits) // 2]:.1f}s, "
              f"max {waits[-1]:.1f}s); {len(resubmitted)} of the {len(lost)} lost drivers "
              f"were resubmitted before the cancel won ({sum(len(after_ray[j]) >= 2 for j in lost)} reached Ray)")
        for job_id in ids:
            print(f"  {job_id}: {race.notes[job_id]}; Ray: "
                  f"{[(s['submission_id'].rsplit('-', 1)[1], s['status']) for s in after_ray[job_id]]}")
    finally:
        for watcher in watchers:
            watcher.cancel()
        await race.close()
