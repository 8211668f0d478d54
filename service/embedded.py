"""A local Ray head for `etrain serve` when no RAY_ADDRESS is given."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from service.procs import (all_procs, boot_id, describe, group_alive, kill_all, listeners, proc_cmdline,
                           proc_stat, same_process, session_tree, with_descendants)
from service.settings import without_secrets

RECORD_VERSION = 1
HEAD_RECORD = "ray-head.json"  # in the data directory of `etrain serve`
TEMP_PREFIX = "etrain-ray-"  # a head's temp dir, made by start() in the system's temp dir
RAY_LOGS = "ray-logs"  # beside the head's own log: the Ray logs of its stopped heads
KEEP_SESSIONS = 5


class RayStartError(RuntimeError):
    """Ray did not start; the message is one line: the cause from its log, and the log's path."""


@dataclass
class HeadRecord:
    """What `etrain serve` writes to <data dir>/ray-head.json about the head it owns, so a
    later run can tell that head (and only that one) from any other Ray on its ports."""

    pid: int  # of `ray start --head --block`: the leader of its own session and process group
    pgid: int
    start_time: int | None  # /proc/<pid>/stat field 22 (clock ticks after boot): a reused pid differs
    boot_id: str | None  # /proc/sys/kernel/random/boot_id: start times count from this boot
    cmdline: list[str]  # /proc/<pid>/cmdline as it started
    gcs_address: str
    dashboard_url: str
    ports: dict[str, int]  # flag: port (--ray-port, --dashboard-port)
    temp_dir: str
    session_dir: str | None  # <temp_dir>/session_<time>_<pid>, once the head is up
    log_path: str
    owner_pid: int  # the `etrain serve` that started or last adopted it (for people: the lock decides)
    started_at: float  # wall clock, for people
    version: int = RECORD_VERSION

    @classmethod
    def load(cls, path: Path) -> HeadRecord | None:
        """The record at `path`; None when there is none. ValueError when it is unreadable."""
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        try:
            data = json.loads(text)
            if data.get("version") != RECORD_VERSION:
                raise ValueError(f"version {data.get('version')!r}, not {RECORD_VERSION}")
            record = cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})
        except (TypeError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(str(e)) from None
        if not isinstance(record.pid, int) or record.pid <= 1 or not isinstance(record.cmdline, list):
            raise ValueError(f"no usable pid/command line in {path}")
        return record

    def save(self, path: Path) -> None:
        """Written whole or not at all (a temporary file, fsynced and renamed), owner-only."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


class EmbeddedRay:
    """`ray start --head --block` in its own session and process group, so stopping the
    group stops every process the head started (Ray's own `ray stop` would end every Ray on
    the host).

    With `record_path` (what `etrain serve` passes, <data dir>/ray-head.json) the head is
    owned explicitly: start() records it there, a later start() adopts the head a record
    proves to be ours (a crashed `etrain serve` left it running: its jobs go on) or removes
    a stale record, and stop() stops the head, adopted or started, and removes the record.
    A lock next to the record keeps a second `etrain serve` off a head that is in use."""

    def __init__(self, *, gcs_port: int, dashboard_port: int, num_cpus: int | None, log_path: str,
                 extra_env: dict[str, str] | None = None, record_path: str | Path | None = None,
                 say: Callable[[str], None] | None = None):
        self._reset(record_path, say)
        self.gcs_address = f"127.0.0.1:{gcs_port}"
        self.dashboard_url = f"http://127.0.0.1:{dashboard_port}"
        self.ports = {"--ray-port": gcs_port, "--dashboard-port": dashboard_port}
        self.cmd = [_ray_bin(), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs_port),
                    "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port),
                    "--disable-usage-stats", *(["--num-cpus", str(num_cpus)] if num_cpus else []),
                    # Its default port (52365) is taken when another Ray runs on this machine.
                    "--dashboard-agent-listen-port", str(_free_port())]
        self.log_path = log_path
        from workers.run import POLL_ENV, POLL_S

        # What the head and so every job it runs sees on top of this process's environment.
        self.env = {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token"), POLL_ENV: POLL_S,
                    # Job entrypoints run with the head's environment: give them this interpreter.
                    "PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}", **(extra_env or {})}

    def _reset(self, record_path: str | Path | None, say: Callable[[str], None] | None) -> None:
        self.record_path = Path(record_path) if record_path else None
        self.say = say or (lambda message: None)
        self.temp_dir: str | None = None  # made by start()
        self.proc: subprocess.Popen | None = None  # the `ray start` this process started
        self.pid: int | None = None  # the `ray start` it owns, started or adopted
        self.start_time: int | None = None
        self.adopted = False
        self._started_at = 0.0
        self._lock_fd: int | None = None

    @classmethod
    def worker_node(cls, gcs_address: str, *, num_cpus: int, resources: dict[str, float], log_path: str,
                    env: dict[str, str]) -> EmbeddedRay:
        """Another node joining the head at `gcs_address`, on this machine: what a
        multi-node test adds and removes (stopping its process group is that node dying)."""
        node = cls.__new__(cls)
        node._reset(None, None)
        node.gcs_address, node.dashboard_url, node.log_path, node.env = gcs_address, None, log_path, env
        node.ports = {}
        node.cmd = [_ray_bin(), "start", "--block", "--address", gcs_address, "--node-ip-address", "127.0.0.1",
                    "--num-cpus", str(num_cpus), "--resources", json.dumps(resources), "--disable-usage-stats",
                    # Nodes on one machine must not share ports: left to Ray, two clash.
                    *[arg for flag in ("--dashboard-agent-listen-port", "--metrics-export-port",
                                       "--runtime-env-agent-port", "--node-manager-port", "--object-manager-port",
                                       "--dashboard-agent-grpc-port")
                      for arg in (flag, str(_free_port()))]]
        return node

    @property
    def owned(self) -> bool:
        """Whether this object has a head to stop (started or adopted)."""
        return self.pid is not None

    def child_env(self) -> dict[str, str]:
        """This process's environment for `ray start`, less what jobs must not see."""
        env = without_secrets({**os.environ, **self.env})
        env.pop("RAY_ADDRESS", None)
        return env

    # ------------------------------------------------------------ start, or adopt

    def start(self, timeout: float = 120) -> None:
        """Start the head; with a record, adopt the head it proves ours instead."""
        from workers import ray_token

        # `ray start` refuses to start without a token where none was ever made.
        ray_token.ensure()
        if self.record_path is not None:
            self._lock()
            if self._claim():
                return
        for flag, port in self.ports.items():
            # Said plainly before Ray is asked: its own report of a taken port is a C++ check failure.
            if not port_free("127.0.0.1", port):
                raise RayStartError(f"port {port} on 127.0.0.1 is in use ({flag}){_held_by(port)}; "
                                    "choose another port")
        cmd = self.cmd
        if self.dashboard_url:
            # A Ray job's driver joins "the latest cluster" recorded in <temp dir>/ray_current_cluster
            # (Ray's job supervisor sets its RAY_ADDRESS so): in the shared /tmp/ray, this head's
            # jobs joined whichever Ray had started last on the machine. A temp dir of its own
            # (short, as it holds unix sockets; owner-only) keeps them here. Joining nodes take the head's.
            self.temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX)
            cmd = [*cmd, "--temp-dir", self.temp_dir]
        self.say(f"starting a local Ray head (dashboard {self.dashboard_url}) ...")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.child_env(),
                                         start_new_session=True)
        self.pid, self._started_at = self.proc.pid, time.time()
        stat = proc_stat(self.pid)
        self.start_time = stat.start_time if stat else None
        if self.record_path is not None:
            # Recorded before it is ready: a crash while it starts still leaves it findable.
            self._record(proc_cmdline(self.pid) or cmd).save(self.record_path)
        if self.dashboard_url:
            self._wait_ready(timeout)
        else:
            self._wait_joined(timeout)
        if self.record_path is not None:
            self._record(proc_cmdline(self.pid) or cmd).save(self.record_path)  # now with its session dir

    def _record(self, cmdline: list[str]) -> HeadRecord:
        return HeadRecord(
            pid=self.pid, pgid=self.pid, start_time=self.start_time, boot_id=boot_id(), cmdline=cmdline,
            gcs_address=self.gcs_address, dashboard_url=self.dashboard_url, ports=dict(self.ports),
            temp_dir=self.temp_dir, session_dir=_session_dir(self.temp_dir), log_path=self.log_path,
            owner_pid=os.getpid(), started_at=self._started_at)

    def _lock(self) -> None:
        """One `etrain serve` at a time owns a data directory's head; the kernel drops the
        lock when its holder dies, however it dies (the head never inherits it)."""
        path = self.record_path.with_suffix(".lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            raise RayStartError(f"another `etrain serve`{f' (pid {holder})' if holder.isdigit() else ''} owns the "
                                f"Ray head of {self.record_path.parent}; stop it first, or choose another "
                                "--data-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None

    def _claim(self, answer_timeout: float = 30) -> bool:
        """Adopt the head the record proves ours (True); else clear the way for a new one:
        remove a stale record, and stop what is left of a head that was ours."""
        try:
            record = HeadRecord.load(self.record_path)
        except ValueError as e:
            self.say(f"removing an unreadable Ray head record {self.record_path} ({e})")
            self.record_path.unlink(missing_ok=True)
            return False
        if record is None:
            return False
        why = not_ours(record)
        if why is None:
            why = _answers(record, answer_timeout)
            if why is None:
                self._adopt(record)
                return True
            # Ours (the very process we started) but of no use: stop it rather than leave it.
            self.say(f"stopping the Ray head left by a previous run (pid {record.pid}): {why}")
            self.pid, self.start_time = record.pid, record.start_time
            self.stop(grace_s=5, keep_lock=True)
            return False
        self.say(f"removing the record of the Ray head of a previous run: {why}")
        left = _leftovers(record)
        if left:
            self.say(f"stopping what is left of it: pid(s) {', '.join(map(str, sorted(left)))}")
            kill_all(left, grace_s=5)
        self.record_path.unlink(missing_ok=True)
        return False

    def _adopt(self, record: HeadRecord) -> None:
        self.pid, self.start_time, self.adopted = record.pid, record.start_time, True
        self.gcs_address, self.dashboard_url, self.temp_dir = record.gcs_address, record.dashboard_url, record.temp_dir
        self.say(f"adopting the Ray head left by a previous run (pid {record.pid}; dashboard {record.dashboard_url}); "
                 "its jobs go on")
        asked, self.ports = self.ports, dict(record.ports)
        if asked != self.ports:
            self.say(f"it keeps its own ports ({_ports(self.ports)}), not those asked for ({_ports(asked)}), "
                     "until it is stopped")
        record.owner_pid = os.getpid()
        if record.session_dir is None:  # recorded while it started, by a run that died then
            record.session_dir = _session_dir(record.temp_dir)
        record.save(self.record_path)

    def _failed(self, what: str) -> RayStartError:
        cause = (log_cause(self.log_path) or "").rstrip(".")
        return RayStartError(f"{what}: {cause}; see {self.log_path}" if cause else f"{what}; see {self.log_path}")

    def _wait_joined(self, timeout: float) -> None:
        """`ray start` says so once the node has registered with the head."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            with open(self.log_path, "rb") as log:
                if b"Ray runtime started" in log.read():
                    return
            if self.proc.poll() is not None:
                raise self._failed(f"Ray node exited with code {self.proc.returncode}")
            time.sleep(0.5)
        self.stop()
        raise self._failed(f"Ray node did not join in {timeout:.0f}s")

    def _wait_ready(self, timeout: float) -> None:
        """The head answers once its job agent takes submissions, not when the GCS is up."""
        from ray.job_submission import JobSubmissionClient

        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                self.stop()  # what it left, and its record
                raise self._failed("the local Ray head did not start")
            try:
                JobSubmissionClient(self.dashboard_url).submit_job(entrypoint="true")
                return
            except Exception:
                if time.time() > deadline:
                    self.stop()
                    raise self._failed(f"the local Ray head was not ready after {timeout:.0f}s") from None
                time.sleep(1)

    # ------------------------------------------------------------ stop

    def stop(self, grace_s: float = 10, *, keep_lock: bool = False) -> None:
        """Stop the head (or node) this object started or adopted: SIGTERM to its process
        group, SIGKILL after `grace_s`; then what left the group but is still the head's
        (Ray workers in groups of their own, in its session; job drivers, sessions of their
        own under its job supervisors). Once nothing is left, its record goes too."""
        try:
            if self.pid is None:
                return
            leader, floor = self.pid, self.start_time
            if not self._still_ours():
                self._forget()
                return
            tree = session_tree(leader, floor)
            for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5)):
                if not group_alive(leader):
                    break
                try:
                    os.killpg(leader, sig)
                except ProcessLookupError:
                    break
                deadline = time.time() + wait
                while time.time() < deadline and group_alive(leader):
                    self._reap()
                    time.sleep(0.2)
            # Whatever of it is left (the session's members started meanwhile included).
            left = {pid: start for pid, start in {**tree, **session_tree(leader, floor)}.items() if same_process(pid, start)}
            kill_all(left, grace_s=0)
            self._reap()
            if not group_alive(leader):
                self._forget()
                self._file_logs_away()
        finally:
            if not keep_lock:
                self._unlock()

    def _still_ours(self) -> bool:
        """The leader we started or adopted is still that process, or gone (then its
        group and session may still hold our processes); not a new one on its pid."""
        if self.proc is not None and self.proc.returncode is None:
            return True  # our child, not reaped yet: its pid is not reused before we reap it
        stat = proc_stat(self.pid)
        return stat is None or stat.start_time == self.start_time

    def _file_logs_away(self) -> None:
        """A stopped head's temp dir holds its sockets and Ray's logs of the session, and
        Ray never removes it (nor /tmp/ray/session_*): every start of `etrain serve` and
        of the test suite's cluster left 4-36 MB in /tmp. The logs move beside the head's
        own log (`ray-logs/<session>`, the newest KEEP_SESSIONS kept) for a post-mortem;
        the temp dir goes. Only a temp dir start() made: a joining node's is its head's."""
        temp_dir, self.temp_dir = self.temp_dir, None
        if not temp_dir or not os.path.basename(temp_dir).startswith(TEMP_PREFIX) \
                or os.path.dirname(temp_dir) != tempfile.gettempdir():
            return
        session = _session_dir(temp_dir)
        kept = Path(self.log_path).parent / RAY_LOGS
        try:
            if session and os.path.isdir(os.path.join(session, "logs")):
                kept.mkdir(exist_ok=True)
                shutil.move(os.path.join(session, "logs"), kept / os.path.basename(session))
                for old in sorted(kept.glob("session_*"))[:-KEEP_SESSIONS]:
                    shutil.rmtree(old, ignore_errors=True)
        except OSError as e:  # the logs are a courtesy: the temp dir goes in any case
            self.say(f"could not keep the Ray head's logs ({e}); removing them with its temp dir")
        shutil.rmtree(temp_dir, ignore_errors=True)

    def _reap(self) -> None:
        if self.proc is not None:
            self.proc.poll()

    def _forget(self) -> None:
        if self.record_path is not None:
            try:
                record = HeadRecord.load(self.record_path)
            except ValueError:
                record = None
            if record is None or record.pid == self.pid:
                self.record_path.unlink(missing_ok=True)
        self.pid, self.adopted = None, False


def _session_dir(temp_dir: str | None) -> str | None:
    """The session directory of the head with this temp dir, once Ray has made it."""
    latest = os.path.join(temp_dir, "session_latest") if temp_dir else None
    return os.path.realpath(latest) if latest and os.path.islink(latest) else None


# ---------------------------------------------------------------- a log's cause in one line

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LOG_PREFIX = re.compile(r"^\[?\d{4}-\d\d-\d\d[ T][\d:.,]+\]?\s+(?:[A-Z]+\s+\S+ -- |\S+\s+)?")
_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Exit)): (.+)")
_ERROR_WORDS = re.compile(r"error|refused|failed|fatal|cannot|could not|denied", re.IGNORECASE)
MAX_CAUSE = 300


def log_cause(path: str, tail_bytes: int = 64_000) -> str | None:
    """The line of a log that says why a process failed: the last exception raised, else
    the last line that names an error, else the last line; shortened to one line."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return cause_of(text)


def cause_of(text: str) -> str | None:
    lines = [_LOG_PREFIX.sub("", _ANSI.sub("", line)).strip() for line in text.splitlines()]
    # Traceback frames name files and code, not causes.
    lines = [line for line in lines if line and not line.startswith(("File \"", "Traceback", "^", "~"))]
    if not lines:
        return None
    for line in reversed(lines):
        match = _EXCEPTION.match(line)
        if match:
            return _shorten(f"{match.group(1)}: {match.group(2)}")
    hit = next((line for line in reversed(lines) if _ERROR_WORDS.search(line)), lines[-1])
    return _shorten(hit)


def _shorten(line: str) -> str:
    """The first sentences of a long message, up to MAX_CAUSE characters."""
    line = " ".join(line.split())
    if len(line) <= MAX_CAUSE:
        return line
    cut = line.rfind(". ", 0, MAX_CAUSE)
    return line[:cut + 1] if cut > 40 else line[:MAX_CAUSE - 3] + "..."


# ---------------------------------------------------------------- is a recorded head ours?

def not_ours(record: HeadRecord) -> str | None:
    """None when the recorded `ray start` is alive and provably that process: same boot,
    same start time, same process group and session, same user, same command line. Else
    why not, in a few words."""
    if record.start_time is None or record.boot_id is None:
        return f"pid {record.pid} cannot be told from another process here (no /proc)"
    if boot_id() != record.boot_id:
        return "the machine has restarted since it was recorded"
    stat = proc_stat(record.pid)
    if stat is None:
        return f"pid {record.pid} is gone"
    if stat.start_time != record.start_time:
        return f"pid {record.pid} is another process now"
    if stat.pgid != record.pgid or stat.sid != record.pid or stat.uid != os.getuid():
        return f"pid {record.pid} is not the recorded head (another process group, session or user)"
    if proc_cmdline(record.pid) != record.cmdline:
        return f"pid {record.pid} runs another command than the recorded head"
    return None


def _answers(record: HeadRecord, timeout: float) -> str | None:
    """None once the dashboard at the recorded URL answers and the recorded ports are
    held by the head's own processes; else why not (after up to `timeout`: it may have
    been killed while it started)."""
    deadline = time.time() + timeout
    while True:
        why = _foreign_port(record) or (None if dashboard_answers(record.dashboard_url)
                                        else f"its dashboard at {record.dashboard_url} does not answer")
        if why is None or not_ours(record) is not None or time.time() > deadline:
            return why
        time.sleep(1)


def _foreign_port(record: HeadRecord) -> str | None:
    for flag, port in record.ports.items():
        holders = listeners(port)
        if not holders:
            return f"nothing listens on its port {port} ({flag})"
        stats = [proc_stat(pid) for pid in holders]
        if not any(s is not None and s.sid == record.pid for s in stats):
            return f"its port {port} ({flag}) is held by another process{_held_by(port)}"
    return None


def dashboard_answers(url: str, timeout: float = 5) -> bool:
    """Whether a Ray dashboard answers at `url` (its version, with this machine's Ray token)."""
    import httpx

    from workers import ray_token

    headers = {}
    token = os.environ.get(ray_token.TOKEN_ENV)
    if not token:
        try:
            token = ray_token.token_path().read_text().strip()
        except OSError:
            token = None
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        response = httpx.get(f"{url.rstrip('/')}/api/version", headers=headers, timeout=timeout)
        return response.status_code == 200 and "ray_version" in response.json()
    except (httpx.HTTPError, ValueError):
        return False


def _leftovers(record: HeadRecord) -> dict[int, int]:
    """Processes of a recorded head whose `ray start` is dead: members of its session
    (its pid, so its session id, cannot be reused while one lives) that started after it
    and name its temp dir (the GCS, raylet, dashboard, ...), and their descendants (the
    workers). Nothing when its pid is another process now or the machine restarted."""
    if record.start_time is None or boot_id() != record.boot_id or proc_stat(record.pid) is not None:
        return {}
    procs = all_procs()
    roots = [p for p in procs.values() if p.sid == record.pid and p.start_time >= record.start_time
             and p.uid == os.getuid() and record.temp_dir and any(record.temp_dir in a for a in proc_cmdline(p.pid) or [])]
    return with_descendants(roots, procs)


# ---------------------------------------------------------------- ports

def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now (SO_REUSEADDR, as uvicorn and Ray bind)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _held_by(port: int) -> str:
    holders = listeners(port)
    return f" by pid {holders[0]} ({describe(holders[0])})" if holders else ""


def _ports(ports: dict[str, int]) -> str:
    return ", ".join(f"{flag} {port}" for flag, port in ports.items())


def _ray_bin() -> str:
    return shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
