"""`etrain serve` and `etrain demo` when they cannot start: one line that says why and
where the log is, never a traceback. A real subprocess each; Ray itself is stood in for
by a script that fails the way `ray start` does (the real thing is in test_fresh_home.py)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from service.embedded import EmbeddedRay, RayStartError, cause_of
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
    assert one_error_line(done) == (f"error: port {taken_port} on 127.0.0.1 is in use ({flag}); "
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


def test_demo_whose_service_fails_prints_the_cause_and_the_log(tmp_path, taken_port):
    data = tmp_path / "demo"
    done = run_cli(["demo", "--data-dir", str(data), "--port", str(taken_port), "--ray-port", str(free_port()),
                    "--dashboard-port", str(free_port())], tmp_path)
    assert one_error_line(done) == (f"error: the local service did not start: port {taken_port} on 127.0.0.1 is in "
                                    "use (--port); stop what holds it or choose another port "
                                    f"(full output in {data / 'serve.log'})")
