"""Several hosts that share no disk: a Ray head and three worker hosts of one CPU slot
each, every host its own network namespace with its own address and its own scratch
disk for Ray's temp dir and TMPDIR (tests/helpers/netns.py), the run record on a real S3-compatible server on the root side
(moto's server mode on the bridge's address), the spec read from there too. Nothing of a
run passes through a directory the hosts share.

1. A 2-worker job runs on two of the hosts; one of them is killed whole (every process
   in its namespace). The job is rescheduled onto the third host, resumes from the object
   store and ends with the undisturbed run's weights_sha256.
2. An elastic {min: 1, max: 3} job shrinks when a host dies and grows back when it
   returns, and trains every step of its undisturbed length."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import fsspec
import pytest
import yaml

from tests.conftest import ROOT, last_json_line, wait_while_running
from tests.helpers import netns
from tests.helpers.s3 import start_s3_server
from workers import events, metrics_read, ray_token, storage
from workers.events import Kind
from workers.run import START_TIMEOUT_ENV

pytestmark = [pytest.mark.ray, pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))]

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
GCS_PORT = 6379


class Hosts:
    def __init__(self, net: netns.Network, s3, logs):
        self.net, self.s3, self.logs = net, s3, logs
        path = ray_token.ensure()
        token = path.read_text().strip() if path else os.environ.get("RAY_AUTH_TOKEN", "")
        self.env = {**os.environ, **s3.env, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0",
                    "PYTHONPATH": str(ROOT), START_TIMEOUT_ENV: "8",
                    # Every namespace shares this machine's hostname, which resolves to a
                    # loopback address: name gloo the interface that reaches the other hosts,
                    # as a host whose name does not resolve to its own address needs.
                    "GLOO_SOCKET_IFNAME": "eth0"}
        if token:
            self.env["RAY_AUTH_TOKEN"] = token
        self.env.pop("RAY_ADDRESS", None)
        self.head = net.host("head")
        self.head_proc = self.head.start(
            [RAY, "start", "--head", "--block", "--temp-dir", f"{net.scratch}/ray", "--node-ip-address", self.head.ip,
             "--port", str(GCS_PORT),
             "--num-cpus", "0", "--dashboard-host", self.head.ip, "--disable-usage-stats"],
            env=self.env, log_path=str(logs / "head.log"))
        self.workers = [net.host(f"w{i}") for i in (1, 2, 3)]
        for host in self.workers:
            self.boot(host)
        self.wait_cpus(3)

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{GCS_PORT}"

    def boot(self, host: netns.Host) -> None:
        """`ray start` on a worker host: a fresh /tmp, as after a reboot."""
        host.start([RAY, "start", "--block", "--temp-dir", f"{self.net.scratch}/ray", "--address", self.address,
                    "--node-ip-address", host.ip, "--num-cpus", "1", "--disable-usage-stats"],
                   env=self.env, log_path=str(self.logs / f"{host.name}.log"))

    def wait_cpus(self, n: int, timeout: float = 120) -> None:
        """Until the cluster has `n` CPUs, every one of them free (a job before may still
        be releasing its workers)."""
        deadline, out = time.time() + timeout, ""
        while time.time() < deadline:
            proc = self.head.join(self.head_proc, [RAY, "status", "--address", self.address], env=self.env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            out = proc.communicate(timeout=60)[0]
            if f" 0.0/{n}.0 CPU" in out:
                return
            time.sleep(1)
        pytest.fail(f"the cluster did not reach {n} CPUs:\n{out[-2000:]}")

    def submit(self, spec_uri: str, log_path) -> subprocess.Popen:
        """The driver, on the head host (beside its node's session directory)."""
        with open(log_path, "w") as log:
            return self.head.join(self.head_proc, [sys.executable, "-m", "workers.run", spec_uri],
                                  env={**self.env, "RAY_ADDRESS": self.address}, cwd="/", stdout=log,
                                  stderr=subprocess.STDOUT)

    def host_of(self, pid: int) -> netns.Host:
        return next(h for h in self.workers if pid in h.pids())


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    logs = tmp_path_factory.mktemp("hosts")
    with netns.Network() as net:
        s3 = start_s3_server(str(logs / "moto.log"), host=net.gateway)
        try:
            # The test itself reads the run record through the same endpoint.
            saved = {k: os.environ.get(k) for k in s3.env}
            os.environ.update(s3.env)
            fsspec.filesystem("s3", skip_instance_cache=True).mkdir("runs")
            yield Hosts(net, s3, logs)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            net.close()
            s3.stop()


def put_spec(spec: dict) -> str:
    """The spec on the object store: no host reads it from a shared disk."""
    uri = f"s3://runs/specs/{spec['job_id']}.yaml"
    storage.write_bytes(uri, yaml.safe_dump(spec).encode())
    return uri


def paced_job(job_id: str, workers, steps: int) -> dict:
    return {
        "job_id": job_id,
        "model": {"name": "custom", "factory": "tests.helpers.paced:slow_linear"},  # 0.1 s a step at least
        "dataset": {"name": "synthetic", "size": 4000, "image_size": 8, "val_fraction": 0.1},
        "workers": workers,
        "resources": {"cpu": 1},
        "training": {"max_steps": steps, "global_batch_size": 30, "seed": 5, "optimizer": "sgd", "lr": 0.05},
        "checkpoint": {"every_steps": 10, "keep": 2},
        "failure": {"max_failures": 5, "collective_timeout_s": 10},
        "storage": "s3://runs/jobs",
    }


def finish(proc: subprocess.Popen, log, timeout: float = 300) -> dict:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the job did not finish in {timeout}s:\n{log.read_text()[-4000:]}")
    assert proc.returncode == 0, log.read_text()[-4000:]
    return last_json_line(log.read_text())


def current_workers(run_dir: str) -> list[dict]:
    started = events.events(run_dir, Kind.WORKER_STARTED)
    newest = max((e["attempt"] for e in started), default=0)
    return [e for e in started if e["attempt"] == newest]


def trained_at(run_dir: str, size: int) -> bool:
    attempts = events.events(run_dir, Kind.ATTEMPT_STARTED)
    if not attempts or attempts[-1]["world_size"] != size:
        return False
    latest = metrics_read.latest(run_dir)
    return latest is not None and latest.get("attempt") == attempts[-1]["attempt"]


def test_a_host_killed_whole_its_worker_resumes_on_the_third_host_from_the_object_store(hosts, tmp_path):
    twin = finish(hosts.submit(put_spec(paced_job("twin", 2, 150)), tmp_path / "twin.log"), tmp_path / "twin.log")
    assert twin["status"] == "succeeded" and twin["restarts"] == 0

    log = tmp_path / "job.log"
    proc = hosts.submit(put_spec(paced_job("host-lost", 2, 150)), log)
    run_dir = "s3://runs/jobs/host-lost"
    try:
        wait_while_running("step 40", lambda: (metrics_read.latest(run_dir) or {}).get("step", 0) >= 40, proc, log)
        before = current_workers(run_dir)
        used = {hosts.host_of(w["pid"]).name for w in before}
        assert len(used) == 2, before  # one worker on each of two hosts
        killed = hosts.host_of(before[0]["pid"])
        killed.kill()
        summary = finish(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert summary["status"] == "succeeded" and summary["restarts"] >= 1, summary
    assert summary["weights_sha256"] == twin["weights_sha256"]
    (spare,) = {h.name for h in hosts.workers} - used
    after = current_workers(run_dir)
    assert {w["node_id"] for w in after}.isdisjoint({before[0]["node_id"]})
    assert len({w["node_id"] for w in after}) == 2
    resumed = events.events(run_dir, Kind.RESUMED)
    assert resumed and resumed[0]["from_step"] >= 10, resumed  # from a checkpoint in the object store
    # The replacement worker ran on the spare host: a host that never held the job before.
    assert any(w["node_id"] not in {b["node_id"] for b in before} for w in after), (spare, after)
    hosts.boot(killed)  # back for the next test
    hosts.wait_cpus(3)


def test_an_elastic_job_shrinks_when_a_host_dies_and_grows_back_when_it_returns(hosts, tmp_path):
    steps = 700
    hosts.wait_cpus(3)
    log = tmp_path / "elastic.log"
    proc = hosts.submit(put_spec(paced_job("elastic", {"min": 1, "max": 3, "resize_check_s": 5}, steps)), log)
    run_dir = "s3://runs/jobs/elastic"
    try:
        wait_while_running("training on 3 workers", lambda: trained_at(run_dir, 3), proc, log)
        victim = hosts.host_of(current_workers(run_dir)[-1]["pid"])
        victim.kill()
        wait_while_running("training on 2 workers after a host died", lambda: trained_at(run_dir, 2), proc, log)
        hosts.boot(victim)
        wait_while_running("training on 3 workers after the host came back",
             lambda: trained_at(run_dir, 3) and len(events.events(run_dir, Kind.RESIZED)) >= 2, proc, log)
        summary = finish(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The host's death and return are the last two resizes. (Ray may also have started
    # the job on fewer workers than it has hosts, and grown it, before the host died.)
    resizes = [(r["old_size"], r["new_size"]) for r in summary["resizes"]]
    assert resizes[-2:] == [(3, 2), (2, 3)], summary
    assert any(r["cause"] != "resize" for r in summary["recoveries"]), summary  # the death was a failure
    assert summary["final_step"] == steps and summary["world_size"] == 3
    attempts = events.events(run_dir, Kind.ATTEMPT_STARTED)
    metrics = events.metrics(run_dir)
    covered = set()
    for a, b in zip(attempts, [*attempts[1:], None]):
        stop = b["from_step"] if b else steps
        covered |= {m["step"] for m in metrics if m["attempt"] == a["attempt"] and m["step"] <= stop}
    assert covered == set(range(1, steps + 1)), "every step of the final lineage was trained"
    print(json.dumps(summary["resizes"]))
