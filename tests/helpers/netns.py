"""Several hosts on one machine for tests: each host a network namespace with its own
address on a bridge (loopback and these namespaces only, nothing else), and its own
scratch disk (a tmpfs mounted at net.scratch in a mount namespace of its own: the same
path on every host, different files), so hosts share neither a network stack nor the
disk they write to. Processes on a host get TMPDIR there; give Ray `--temp-dir` there
too. Only the scratch is private: the code and the interpreter (which may live under
/tmp, as in a CI clone) stay visible. Needs root (`ip netns`), as on the project's machines.

    with Network("etr") as net:             # the bridge, at net.gateway (10.77.N.1)
        head = net.host("head")             # a namespace, at head.ip
        head.start(["ray", "start", "--temp-dir", f"{net.scratch}/ray", ...])
        head.kill()                         # the host dies whole: SIGKILL to every process in it

A test's root-side servers (an S3 server) listen on net.gateway, which every host reaches.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

# Each host's process runs in a private mount namespace with a fresh tmpfs on the scratch
# path: what Ray and the job write there on one host is not seen by another, as on real
# machines. $0 is the scratch path.
_PRIVATE_SCRATCH = 'mount -t tmpfs -o size=4g,mode=1777 tmpfs "$0" && mkdir -p "$0/tmp" && exec "$@"'


def available() -> str | None:
    """Why hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


@dataclass
class Host:
    name: str  # the namespace's name
    ip: str
    scratch: str = ""
    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(self, cmd: list[str], *, env: dict[str, str], log_path: str, cwd: str | None = None) -> subprocess.Popen:
        """A process on this host, with a scratch disk of its own (a new one after each kill)."""
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(["ip", "netns", "exec", self.name, "unshare", "--mount", "--propagation", "private",
                                     "sh", "-c", _PRIVATE_SCRATCH, self.scratch, *cmd],
                                    env={**env, "TMPDIR": f"{self.scratch}/tmp"}, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def join(self, of: subprocess.Popen, cmd: list[str], *, env: dict[str, str], cwd: str | None = None,
             **popen) -> subprocess.Popen:
        """A process in the namespaces (network and mount: the same /tmp) of process `of`
        of this host: a Ray driver must see its node's session directory."""
        pid = self._inner_pid(of)
        proc = subprocess.Popen(["nsenter", "--target", str(pid), "--net", "--mount", *cmd],
                                env={**env, "TMPDIR": f"{self.scratch}/tmp"}, cwd=cwd,
                                start_new_session=True, **popen)
        self.procs.append(proc)
        return proc

    def _inner_pid(self, of: subprocess.Popen) -> int:
        """`ip netns exec`, `unshare` (no --fork) and `sh -c ... exec` each exec in turn:
        the command runs as the very process started, inside both namespaces."""
        if of.poll() is not None:
            raise RuntimeError(f"the process {of.pid} on {self.name} has ended")
        return of.pid

    def pids(self) -> list[int]:
        return [int(p) for p in _run("ip", "netns", "pids", self.name, check=False).stdout.split()]

    def kill(self) -> None:
        """The host dies: every process in its namespace gets SIGKILL, at once."""
        for _ in range(20):  # processes that fork while being killed: until none is left
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()


class Network:
    """A bridge in the root namespace and hosts attached to it by veth pairs."""

    def __init__(self, prefix: str = "etr"):
        tag = os.getpid() % 10000
        self.prefix = f"{prefix}{tag}"  # interface names are 15 characters at most
        self.subnet = f"10.{77 + tag % 100 // 50}.{tag % 250}"
        self.gateway = f"{self.subnet}.1"
        self.bridge = f"{self.prefix}br"
        self.scratch = ""  # made by __enter__
        self.hosts: list[Host] = []

    def __enter__(self) -> Network:
        self.close()  # what a killed run of this pid left behind
        self.scratch = tempfile.mkdtemp(prefix=f"{self.prefix}-scratch-")  # each host mounts its own over it
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        return self

    def host(self, name: str) -> Host:
        n = len(self.hosts) + 1
        ns, veth = f"{self.prefix}-{name}", f"{self.prefix}v{n}"
        host = Host(ns, f"{self.subnet}.{10 + n}", self.scratch)
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "link", "set", veth, "master", self.bridge, "up")
        _run("ip", "-n", ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        self.hosts.append(host)
        return host

    def close(self) -> None:
        for host in self.hosts:
            host.kill()
        for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
            ns = line.split()[0] if line.split() else ""
            if ns.startswith(f"{self.prefix}-"):
                Host(ns, "").kill()
                _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        self.hosts = []
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.close()
