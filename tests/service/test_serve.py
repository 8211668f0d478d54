"""`etrain serve` and `etrain demo` when they cannot start: one line that says why and
where the log is, never a traceback. A real subprocess each; Ray itself is stood in for
by a script that fails the way `ray start` does (the real thing is in test_fresh_home.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest

from service import embedded
from service.embedded import EmbeddedRay, HeadRecord, RayStartError, cause_of, not_ours
from service.procs import boot_id, describe, proc_cmdline, proc_stat
from tests.conftest import ROOT, free_port

# How `ray start` ended on a machine that never ran Ray (Ray 2.60, before ray_token.ensure()).
NO_TOKEN = textwrap.dedent("""\
    2026-12-03 07:35:12,815\tINFO usage_lib.py:448 -- Usage stats collection is disabled.
    Traceback (most recent call last):
      File "/venv/bin/ray", line 8, in <module>
        sys.exit(main())
                 ^^^^^^
      File "/venv/lib/python3.11/site-packages/ray/scripts/scripts.py", line 1072, in start
        ensure_token_if_auth_enabled(system_config, create_token_if_missing=False)
    ray.exceptions.AuthenticationError: Token authentication is enabled but no authentication token was found. \
Ensure that the token for the cluster is available in a local file (e.g., ~/.ray/auth_token or via \
RAY_AUTH_TOKEN_PATH) or as the `RAY_AUTH_TOKEN` environment variable. To generate a token for local development, \
use `ray get-auth-token --generate` For remote clusters, ensure that the token is propagated to all nodes.
    """)

CAUSES = [
    (NO_TOKEN, ("AuthenticationError: Token authentication is enabled but no authentication token was found. Ensure "
                "that the token for the cluster is available in a local file (e.g., ~/.ray/auth_token or via "
                "RAY_AUTH_TOKEN_PATH) or as the `RAY_AUTH_TOKEN` environment variable.")),
    (("2026-12-03 07:35:12,815\tINFO scripts.py:1 -- Local node IP: 127.0.0.1\n"
      "2026-12-03 07:35:13,001\tERROR node.py:9 -- \x1b[31mConnection refused\x1b[39m while joining 127.0.0.1:6379\n"
      "2026-12-03 07:35:13,002\tINFO scripts.py:2 -- bye\n"), "Connection refused while joining 127.0.0.1:6379"),
    ("starting\nsomething odd happened\n", "something odd happened"),
    ("", None),
]


@pytest.mark.parametrize(("log", "cause"), CAUSES, ids=["exception", "error-line", "last-line", "empty"])
def test_the_cause_of_a_failure_is_one_line_from_the_log(log, cause):
    assert cause_of(log) == cause


def fake_ray(tmp_path: Path) -> Path:
    """A `ray` that fails like `ray start` without a token."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    script = tmp_path / "bin" / "ray"
    script.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write({NO_TOKEN!r})\nsys.exit(1)\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.fixture
def ray_home(tmp_path, monkeypatch):
    """Ray's token under tmp_path, whatever ray_token.ensure() does to this process."""
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "ray" / "auth_token"))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)


def test_a_head_that_fails_raises_one_line_with_the_cause_and_the_log(tmp_path, ray_home):
    log = tmp_path / "head.log"
    head = EmbeddedRay(gcs_port=free_port(), dashboard_port=free_port(), num_cpus=1, log_path=str(log))
    head.cmd = [str(fake_ray(tmp_path)), *head.cmd[1:]]
    with pytest.raises(RayStartError) as failed:
        head.start(timeout=30)
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith("the local Ray head did not start: AuthenticationError: Token authentication is "
                              "enabled but no authentication token was found.")
    assert message.endswith(f"; see {log}")
    # The token was made before `ray start` ran: owner-only.
    token = tmp_path / "ray" / "auth_token"
    assert token.exists() and stat.S_IMODE(token.stat().st_mode) == 0o600


def test_the_head_and_so_every_job_gets_no_secret_of_the_service(monkeypatch, tmp_path):
    for name in ("ETRAIN_TOKEN", "DATABASE_URL", "ETRAIN_DATABASE_URL", "RAY_ADDRESS"):
        monkeypatch.setenv(name, "secret-" + name)
    head = EmbeddedRay(gcs_port=free_port(), dashboard_port=free_port(), num_cpus=1, log_path=str(tmp_path / "l"))
    env = head.child_env()
    assert not [v for v in env.values() if v.startswith("secret-")]
    assert env["RAY_AUTH_MODE"] == "token" and os.path.dirname(sys.executable) in env["PATH"]


def run_cli(args: list[str], tmp_path: Path, *, before: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    """`etrain ARGS` in a subprocess with its own HOME; `before` runs first (to stand in for Ray)."""
    env = {**os.environ, "HOME": str(tmp_path / "home"), "ETRAIN_DATA_DIR": str(tmp_path / "data")}
    for name in ("RAY_ADDRESS", "ETRAIN_RAY_ADDRESS", "ETRAIN_TOKEN", "RAY_AUTH_TOKEN_PATH", "XDG_CACHE_HOME"):
        env.pop(name, None)
    code = f"{before}\nfrom service.cli import main\nmain()"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("flag", ["--port", "--ray-port", "--dashboard-port"])
def test_serve_on_a_taken_port_says_which_in_one_line(tmp_path, taken_port, flag):
    ports = {"--port": free_port(), "--ray-port": free_port(), "--dashboard-port": free_port(), flag: taken_port}
    done = run_cli(["serve", *[a for k, v in ports.items() for a in (k, str(v))]], tmp_path)
    # A Ray port names what holds it (this test process), as it may be another Ray head.
    holder = "" if flag == "--port" else f" by pid {os.getpid()} ({describe(os.getpid())})"
    assert one_error_line(done) == (f"error: port {taken_port} on 127.0.0.1 is in use ({flag}){holder}; "
                                    f"{'stop what holds it or ' if flag == '--port' else ''}choose another port")


def test_serve_whose_ray_head_fails_prints_the_cause_and_the_log(tmp_path):
    ray = fake_ray(tmp_path)
    swap = f"import service.embedded as e; e._ray_bin = lambda: {str(ray)!r}"
    done = run_cli(["serve", "--port", str(free_port()), "--ray-port", str(free_port()), "--dashboard-port",
                    str(free_port())], tmp_path, before=swap)
    log = tmp_path / "data" / "ray-head.log"
    assert one_error_line(done) == (
        "error: the local Ray head did not start: AuthenticationError: Token authentication is enabled but no "
        "authentication token was found. Ensure that the token for the cluster is available in a local file (e.g., "
        "~/.ray/auth_token or via RAY_AUTH_TOKEN_PATH) or as the `RAY_AUTH_TOKEN` environment variable; "
        f"see {log}")
    assert "Traceback" in log.read_text()  # Ray's own traceback stays in its log


def test_serve_against_a_ray_that_is_down_starts_serves_reads_and_says_why_it_is_not_ready(tmp_path):
    from tests.service.conftest import TOKEN, terminate

    port, dead = free_port(), free_port()  # nothing listens on `dead`
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "ETRAIN_TOKEN")}
    env.update({"ETRAIN_RAY_ADDRESS": f"127.0.0.1:{dead}", "ETRAIN_DASHBOARD_URL": f"http://127.0.0.1:{dead}",
                "ETRAIN_TOKEN": TOKEN, "ETRAIN_RECONCILE_INTERVAL_S": "0.2"})
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--data-dir", str(tmp_path / "data"),
                                 "--port", str(port)], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {TOKEN}"}
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                    break
            time.sleep(0.3)
        ready = httpx.get(f"{url}/readyz", timeout=30)
        assert ready.status_code == 503 and ready.json()["ledger"] == "ok", ready.text
        assert ready.json()["ray"].startswith("unavailable: GatewayError") and str(dead) in ready.json()["ray"]
        r = httpx.post(f"{url}/v1/jobs", headers=auth, timeout=30,
                       json={"job_id": "waits", "workers": 1, "dataset": {"name": "synthetic", "size": 64}})
        assert r.status_code == 201 and r.json()["state"] == "QUEUED", r.text  # kept until Ray is back
        assert httpx.get(f"{url}/v1/jobs/waits", headers=auth, timeout=30).json()["state"] == "QUEUED"
        assert httpx.get(f"{url}/v1/jobs", headers=auth, timeout=30).json()["count"] == 1
    finally:
        terminate(proc, 30)


def test_demo_whose_service_fails_prints_the_cause_and_the_log(tmp_path, taken_port):
    data = tmp_path / "demo"
    done = run_cli(["demo", "--data-dir", str(data), "--port", str(taken_port), "--ray-port", str(free_port()),
                    "--dashboard-port", str(free_port())], tmp_path)
    assert one_error_line(done) == (f"error: the local service did not start: port {taken_port} on 127.0.0.1 is in "
                                    "use (--port); stop what holds it or choose another port "
                                    f"(full output in {data / 'serve.log'})")


# ---------------------------------------------------------------- the head's record: adopt only what is provably ours

# A stand-in for `ray start --head --block`, no Ray: in a session of its own it holds the
# GCS port, answers /api/version on the dashboard port like a Ray dashboard, and starts a
# "job driver" in a session of its own (as Ray's job supervisor does). With `orphan` it
# leaves a process of its session behind naming its temp dir, and exits (a head whose
# `ray start` died while its GCS lived on).
FAKE_HEAD = textwrap.dedent("""\
    import http.server, json, os, socket, subprocess, sys, time
    gcs, dashboard, temp_dir, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    if mode == "orphan":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", temp_dir])
        time.sleep(1)
        sys.exit(0)
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", gcs))
    held.listen()
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "driver"], start_new_session=True)

    class Dashboard(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"ray_version": "2.60.0", "version": "4"}).encode()
            self.send_response(200 if self.path == "/api/version" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", dashboard), Dashboard).serve_forever()
    """)


class FakeHead:
    def __init__(self, tmp_path: Path, mode: str = "serve"):
        self.gcs, self.dashboard = free_port(), free_port()
        self.temp_dir = tmp_path / "ray-temp"
        self.temp_dir.mkdir(exist_ok=True)
        script = tmp_path / "fake_head.py"
        script.write_text(FAKE_HEAD)
        self.proc = subprocess.Popen([sys.executable, str(script), str(self.gcs), str(self.dashboard),
                                      str(self.temp_dir), mode], start_new_session=True)
        self.pid = self.proc.pid
        self.stat = proc_stat(self.pid)

    def record(self, tmp_path: Path, **changes) -> HeadRecord:
        return HeadRecord(**{**asdict(HeadRecord(
            pid=self.pid, pgid=self.pid, start_time=self.stat.start_time, boot_id=boot_id(),
            cmdline=proc_cmdline(self.pid), gcs_address=f"127.0.0.1:{self.gcs}",
            dashboard_url=f"http://127.0.0.1:{self.dashboard}",
            ports={"--ray-port": self.gcs, "--dashboard-port": self.dashboard}, temp_dir=str(self.temp_dir),
            session_dir=None, log_path=str(tmp_path / "head.log"), owner_pid=12345, started_at=time.time())),
            **changes})

    def wait_up(self) -> None:
        from service.embedded import dashboard_answers

        deadline = time.time() + 30
        while not dashboard_answers(f"http://127.0.0.1:{self.dashboard}", timeout=2):
            assert self.proc.poll() is None and time.time() < deadline, "the fake head did not come up"
            time.sleep(0.1)

    def session(self) -> list[int]:
        """Its live processes: its own session and every descendant (the driver's session too)."""
        from service.procs import session_tree

        return sorted(session_tree(self.pid, self.stat.start_time))

    def kill(self) -> None:
        for pid in [*self.session(), self.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def fake_head(tmp_path, ray_home):
    heads: list[FakeHead] = []

    def make(mode: str = "serve") -> FakeHead:
        heads.append(FakeHead(tmp_path, mode))
        return heads[-1]

    yield make
    for head in heads:
        head.kill()


def owned_head(tmp_path: Path, notes: list[str], **ports) -> EmbeddedRay:
    """What `etrain serve` makes: a head recorded in (here) tmp_path/ray-head.json."""
    ports = {"gcs_port": free_port(), "dashboard_port": free_port(), **ports}
    return EmbeddedRay(**ports, num_cpus=1, log_path=str(tmp_path / "head.log"), record_path=tmp_path / "ray-head.json",
                       say=notes.append)


def test_a_record_of_a_live_process_with_its_start_time_and_command_line_is_ours(tmp_path, fake_head):
    head = fake_head()
    assert not_ours(head.record(tmp_path)) is None


def test_a_record_of_a_dead_or_reused_pid_or_another_command_is_not_ours(tmp_path, fake_head):
    head = fake_head()
    assert not_ours(head.record(tmp_path, start_time=head.stat.start_time - 1)) == (
        f"pid {head.pid} is another process now")
    assert "runs another command" in not_ours(head.record(tmp_path, cmdline=[*proc_cmdline(head.pid), "--other"]))
    assert "another process group" in not_ours(head.record(tmp_path, pgid=os.getpgrp()))
    assert "restarted" in not_ours(head.record(tmp_path, boot_id="not-this-boot"))
    record = head.record(tmp_path)
    head.kill()
    assert not_ours(record) == f"pid {head.pid} is gone"


def test_serve_adopts_the_head_its_record_proves_ours_and_stopping_stops_all_of_it(tmp_path, fake_head):
    fake = fake_head()
    fake.wait_up()
    record_path = tmp_path / "ray-head.json"
    fake.record(tmp_path).save(record_path)
    assert len(fake.session()) >= 2  # the head and its "job driver"
    notes: list[str] = []
    # Asked for other ports than it has (a new user repeating the command would not, but
    # the data directory's head is the one to use): it keeps its own.
    head = owned_head(tmp_path, notes)
    try:
        head.start(timeout=30)
        assert head.adopted and head.owned and head.proc is None
        assert head.dashboard_url == f"http://127.0.0.1:{fake.dashboard}"
        assert head.gcs_address == f"127.0.0.1:{fake.gcs}"
        assert notes[0] == (f"adopting the Ray head left by a previous run (pid {fake.pid}; dashboard "
                            f"http://127.0.0.1:{fake.dashboard}); its jobs go on")
        assert "keeps its own ports" in notes[1]
        assert HeadRecord.load(record_path).owner_pid == os.getpid()
        # One service owns a data directory's head at a time.
        with pytest.raises(RayStartError, match=rf"another `etrain serve` \(pid {os.getpid()}\) owns the Ray head"):
            owned_head(tmp_path, []).start(timeout=30)
    finally:
        head.stop(grace_s=2)
    assert fake.proc.wait(timeout=10) is not None
    assert fake.session() == [] and not record_path.exists()
    assert not head.owned


def test_a_stale_record_is_removed_and_the_port_it_named_is_refused_naming_who_holds_it(tmp_path, fake_head):
    other = fake_head()  # another Ray head on "our" ports, not ours: the record's pid is another process
    other.wait_up()
    record_path = tmp_path / "ray-head.json"
    other.record(tmp_path, start_time=other.stat.start_time + 7).save(record_path)
    notes: list[str] = []
    head = owned_head(tmp_path, notes, gcs_port=other.gcs, dashboard_port=other.dashboard)
    try:
        with pytest.raises(RayStartError) as refused:
            head.start(timeout=30)
    finally:
        head.stop()
    assert str(refused.value) == (f"port {other.gcs} on 127.0.0.1 is in use (--ray-port) by pid {other.pid} "
                                  f"({describe(other.pid)}); choose another port")
    assert notes == [f"removing the record of the Ray head of a previous run: pid {other.pid} is another process now"]
    assert not record_path.exists()
    assert other.proc.poll() is None and len(other.session()) >= 2  # not ours: untouched


def test_what_is_left_of_a_recorded_head_whose_ray_start_died_is_stopped(tmp_path, fake_head):
    fake = fake_head("orphan")
    record = fake.record(tmp_path)
    fake.proc.wait(timeout=30)  # its `ray start` is gone, a process of its session lives on
    deadline = time.time() + 30
    while not fake.session():
        assert time.time() < deadline
        time.sleep(0.1)
    left = fake.session()
    record.save(tmp_path / "ray-head.json")
    notes: list[str] = []
    head = owned_head(tmp_path, notes)
    head.cmd = [str(fake_ray(tmp_path)), *head.cmd[1:]]  # what starts next fails at once: no Ray here
    with pytest.raises(RayStartError, match="did not start"):
        head.start(timeout=30)
    head.stop()
    assert notes[:2] == [f"removing the record of the Ray head of a previous run: pid {fake.pid} is gone",
                         f"stopping what is left of it: pid(s) {', '.join(map(str, left))}"]
    assert all(proc_stat(pid) is None for pid in left)
    assert not (tmp_path / "ray-head.json").exists()


def stopped_head_dir(session: str) -> str:
    """A temp dir as a head that start() made leaves it: a session with logs, sockets."""
    temp_dir = tempfile.mkdtemp(prefix=embedded.TEMP_PREFIX)
    for part in ("logs", "sockets"):
        os.makedirs(os.path.join(temp_dir, session, part))
    Path(temp_dir, session, "logs", "raylet.out").write_text(session)
    os.symlink(os.path.join(temp_dir, session), os.path.join(temp_dir, "session_latest"))
    return temp_dir


def test_a_stopped_heads_temp_dir_goes_and_its_logs_are_kept_beside_the_heads_log(tmp_path):
    head = EmbeddedRay(gcs_port=free_port(), dashboard_port=free_port(), num_cpus=1,
                       log_path=str(tmp_path / "ray-head.log"))
    kept = tmp_path / embedded.RAY_LOGS
    sessions = [f"session_2026-12-0{i}_10-00-00_000000_{i}" for i in range(1, embedded.KEEP_SESSIONS + 3)]
    for session in sessions:
        head.temp_dir = temp_dir = stopped_head_dir(session)
        head._file_logs_away()
        assert not os.path.exists(temp_dir) and head.temp_dir is None
        assert (kept / session / "raylet.out").read_text() == session
    assert sorted(p.name for p in kept.iterdir()) == sessions[-embedded.KEEP_SESSIONS:]  # the newest


def test_a_temp_dir_start_did_not_make_is_left_alone(tmp_path):
    head = EmbeddedRay(gcs_port=free_port(), dashboard_port=free_port(), num_cpus=1,
                       log_path=str(tmp_path / "ray-head.log"))
    head.temp_dir = str(tmp_path / "ray-temp")  # a joining node's, a user's --temp-dir
    os.makedirs(os.path.join(head.temp_dir, "session_x", "logs"))
    head._file_logs_away()
    assert os.path.isdir(os.path.join(tmp_path, "ray-temp", "session_x", "logs"))
    assert not (tmp_path / embedded.RAY_LOGS).exists()


def test_an_unreadable_record_is_set_aside(tmp_path, ray_home):
    (tmp_path / "ray-head.json").write_text("{not json")
    notes: list[str] = []
    head = owned_head(tmp_path, notes)
    head.cmd = [str(fake_ray(tmp_path)), *head.cmd[1:]]
    with pytest.raises(RayStartError):
        head.start(timeout=30)
    head.stop()
    assert notes[0].startswith(f"removing an unreadable Ray head record {tmp_path / 'ray-head.json'}")
    assert not (tmp_path / "ray-head.json").exists()


# ---------------------------------------------------------------- acceptance: a crash, a restart, a stop


def _ours_left(record: dict) -> list[str]:
    """Live processes of the recorded head: in its process group or session (started no
    earlier than its `ray start`), or naming its temp dir (which holds its session dir:
    `ray start`, gcs_server, raylet, the dashboard). Zombies are dead (this machine's
    init may never reap them)."""
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = proc_stat(int(entry))
        argv = proc_cmdline(int(entry)) or []
        if stat is None or stat.start_time < record["start_time"]:
            continue
        if record["pgid"] in (stat.pgid, stat.sid) or any(record["temp_dir"] in a for a in argv):
            left.append(f"{stat.pid} (group {stat.pgid}): {' '.join(argv)[:200]}")
    return left


@pytest.mark.ray
def test_serve_killed_mid_job_adopts_its_head_on_restart_and_stopping_leaves_no_ray(tmp_path):
    from tests.helpers.paced import GATE_ENV
    from tests.service.conftest import TOKEN, start_serve, terminate, wait_for

    data = tmp_path / "data"
    data.mkdir()
    gate = tmp_path / "slow"
    gate.write_text("while this file exists, every training step takes 0.25 s")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "ETRAIN_RAY_ADDRESS", "ETRAIN_TOKEN")}
    # The head (so the job's workers) sees the gate, and imports the paced model from here.
    env.update({"ETRAIN_TOKEN": TOKEN, "ETRAIN_RECONCILE_INTERVAL_S": "0.5", "PYTHONPATH": str(ROOT),
                GATE_ENV: str(gate)})
    # The same command both times, as a user would run it again (the last --ray-port and
    # --dashboard-port win over start_serve's own).
    args = ["--data-dir", str(data), "--num-cpus", "2", "--ray-port", str(free_port()), "--dashboard-port",
            str(free_port())]
    record_path = data / "ray-head.json"
    spec = {"job_id": "outlives-serve", "model": {"name": "custom", "factory": "tests.helpers.paced:paced_linear"},
            "dataset": {"name": "synthetic", "size": 512, "image_size": 8}, "workers": 1,
            "training": {"max_steps": 60, "global_batch_size": 16, "seed": 3, "optimizer": "sgd", "lr": 0.05},
            "checkpoint": {"every_steps": 20}}
    record, first, second = None, None, None
    try:
        first = start_serve(args, env, data / "serve-1.log")
        record = json.loads(record_path.read_text())
        assert record["pgid"] == record["pid"] == first.head_pgid and record["session_dir"].startswith(
            record["temp_dir"]), record
        with httpx.Client(base_url=first.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as client:
            assert client.post("/v1/jobs", json=spec).status_code == 201
            wait_for(client, spec["job_id"], set(), timeout=300,
                     until=lambda job: job["state"] == "RUNNING" and (job["progress"].get("step") or 0) >= 1)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=30)
        assert not_ours(HeadRecord.load(record_path)) is None  # the head lives on, orphaned

        second = start_serve(args, env, data / "serve-2.log")
        assert (f"adopting the Ray head left by a previous run (pid {record['pid']};" in second.output()
                ), second.output()[-3000:]
        assert "starting a local Ray head" not in second.output()
        with httpx.Client(base_url=second.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as client:
            job = client.get(f"/v1/jobs/{spec['job_id']}").json()
            assert job["state"] == "RUNNING", job  # it went on while no service watched it
            gate.unlink()  # full speed from here
            job = wait_for(client, spec["job_id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, timeout=300)
        assert job["state"] == "SUCCEEDED" and job["resubmits"] == 0, job

        terminate(second.proc, 60)
        assert second.proc.returncode == 0, second.output()[-3000:]
        assert "stopping the local Ray head" in second.output()
        assert not record_path.exists()
        deadline = time.time() + 10  # a job driver's watcher may take a second after the head
        while _ours_left(record) and time.time() < deadline:
            time.sleep(0.5)
        assert _ours_left(record) == []
        # Its temp dir is gone; Ray's logs of that session are kept in the data directory.
        assert not os.path.exists(record["temp_dir"])
        assert (data / "ray-logs" / os.path.basename(record["session_dir"]) / "raylet.out").is_file(), \
            sorted(os.listdir(data))
    finally:
        for serve in (first, second):
            if serve is not None:
                terminate(serve.proc, 60)
        if record is not None:  # whatever of the head is left: its group, while that is still this test's
            leader = proc_stat(record["pid"])
            if leader is None or leader.start_time == record["start_time"]:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(record["pgid"], signal.SIGKILL)
