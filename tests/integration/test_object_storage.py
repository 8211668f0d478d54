"""Jobs whose storage is an object store (a real S3-compatible server, moto's server mode,
over HTTP) on a real Ray cluster: a crash injected, resumed from the object store, and
bit-identical to the same job on local storage; the service reading the run record from
there. Nothing of a run is written to local disk."""

from __future__ import annotations

import os
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from service.embedded import EmbeddedRay
from tests.conftest import ROOT, Cluster, free_port, recovery_spec, run_job
from tests.service.conftest import start_api, stop_api, wait_for
from workers import checkpoint, events, storage
from workers.events import Kind

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def s3_ray(s3_server, tmp_path_factory):
    """A head whose processes have the S3 endpoint and keys in their environment, as a
    user's nodes would (never the spec: it is not a place for credentials)."""
    log = tmp_path_factory.mktemp("s3-ray") / "head.log"
    head = EmbeddedRay(gcs_port=free_port(), dashboard_port=free_port(), num_cpus=8, log_path=str(log),
                       extra_env={"RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT), **s3_server.env})
    try:
        head.start()
        yield Cluster(address=head.gcs_address, dashboard=head.dashboard_url,
                      env={**os.environ, **head.env, **s3_server.env, "RAY_ADDRESS": head.gcs_address})
    finally:
        head.stop()


def run_on(cluster, spec: dict, bucket: str, tmp_path):
    outcome = run_job(cluster, {**spec, "storage": f"{bucket}/runs"}, tmp_path)
    assert outcome.rc == 0, outcome.output[-4000:]
    return outcome, f"{bucket}/runs/{spec['job_id']}"


def nothing_local(tmp_path) -> None:
    """Only the spec file the test wrote: no run directory, no `s3:` directory."""
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in tmp_path.glob("*.yaml")), \
        list(tmp_path.iterdir())


def test_ddp_on_s3_recovers_from_a_crash_bit_identical_to_its_local_twin(s3_ray, twin, s3_bucket, tmp_path):
    faults = [{"at_step": 14, "rank": 1, "kind": "crash"}]
    outcome, run_dir = run_on(s3_ray, recovery_spec("s3-ddp", faults), s3_bucket, tmp_path)
    summary = outcome.summary
    assert summary["status"] == "succeeded" and summary["restarts"] == 1
    assert summary["weights_sha256"] == twin.summary["weights_sha256"]
    nothing_local(tmp_path)

    (resumed,) = events.events(run_dir, Kind.RESUMED)
    assert resumed["from_step"] == 10 and resumed["failed_rank"] == 1
    assert checkpoint.latest(run_dir)[0] == 40
    assert storage.exists(f"{run_dir}/spec.json") and storage.exists(f"{run_dir}/final/model.pt")
    (log,) = events.driver_logs(run_dir)
    assert '"status": "succeeded"' in storage.read_bytes(log).decode()  # the driver's output, to its last line
    # TensorBoard reads the bucket: one loss point per step, the recomputed ones once, and the recovery.
    board = EventAccumulator(f"{run_dir}/tensorboard", size_guidance={"scalars": 0})
    board.Reload()
    assert [p.step for p in board.Scalars("loss")] == list(range(1, 41))
    assert [p.step for p in board.Scalars("recovery_s")] == [10]


def test_fsdp_on_s3_crashed_while_a_checkpoint_is_written_never_loads_it_and_ends_as_its_twin(
        ray_cluster, s3_ray, s3_bucket, tmp_path):
    spec = {**recovery_spec("fsdp-twin"), "strategy": "fsdp"}
    (tmp_path / "local").mkdir()
    (tmp_path / "s3").mkdir()
    local = run_job(ray_cluster, spec, tmp_path / "local")
    assert local.rc == 0, local.output[-3000:]

    faults = [{"at_step": 20, "rank": 1, "kind": "crash", "phase": "checkpoint"}]
    outcome, run_dir = run_on(s3_ray, {**spec, "job_id": "s3-fsdp", "faults": faults}, s3_bucket, tmp_path / "s3")
    assert outcome.summary["status"] == "succeeded"
    assert outcome.summary["weights_sha256"] == local.summary["weights_sha256"]
    nothing_local(tmp_path / "s3")
    attempts = events.events(run_dir, Kind.ATTEMPT_STARTED)
    assert [a["from_step"] for a in attempts] == [0, 10]  # step 20 was half-written: never loaded
    assert any(n.endswith(".distcp") for n in storage.listdir(f"{run_dir}/checkpoints/step-000040"))


def test_the_service_on_s3_serves_a_jobs_record_from_there_and_deletes_it(s3_ray, s3_bucket, tmp_path):
    api = start_api(s3_ray, tmp_path, env={"ETRAIN_STORAGE": f"{s3_bucket}/svc"})
    try:
        with api.client() as c:
            job = {**recovery_spec("svc-s3", [{"at_step": 14, "rank": 0, "kind": "crash"}])}
            r = c.post("/v1/jobs", json=job)
            assert r.status_code == 201, r.text
            done = wait_for(c, "svc-s3", {"SUCCEEDED", "FAILED"})
            assert done["state"] == "SUCCEEDED", (done, c.get("/v1/jobs/svc-s3/logs").text[-3000:])
            assert done["progress"]["step"] == 40 and done["restarts"] == 1
            assert done["latest_checkpoint"]["step"] == 40
            assert c.get("/v1/jobs/svc-s3/metrics", params={"since_step": 30}).json()["count"] == 10
            assert c.get("/v1/jobs/svc-s3/checkpoints").json()["data"][0]["step"] == 40
            # Events by offset hold only those settled (events.SETTLE_S) on an object store.
            deadline, kinds = time.time() + 30, []
            while Kind.FINISHED not in kinds and time.time() < deadline:
                time.sleep(1)
                kinds = [e["event"] for e in c.get("/v1/jobs/svc-s3/events").json()["data"]]
            assert Kind.RESUMED in kinds and Kind.FINISHED in kinds
            assert '"status": "succeeded"' in c.get("/v1/jobs/svc-s3/logs").text
            assert storage.exists(f"{s3_bucket}/svc/svc-s3/spec.json")
            assert c.delete("/v1/jobs/svc-s3").status_code == 204
            assert storage.listdir(f"{s3_bucket}/svc/svc-s3") == []
    finally:
        stop_api(api)
    assert not (tmp_path / "runs").exists()
