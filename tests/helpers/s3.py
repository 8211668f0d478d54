"""A real S3-compatible server for tests: moto in server mode (`python -m moto.server`),
its own process on 127.0.0.1 and a free port, spoken to over HTTP by the same clients a
user's job uses (s3fs/botocore, torch.distributed.checkpoint through fsspec).

    def test_x(s3_bucket):      # s3://<fresh bucket>, with AWS_ENDPOINT_URL and keys set
        ...

The endpoint and keys reach the code under test the way a user's do: the standard AWS_*
environment variables, never an argument.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    endpoint: str
    process: subprocess.Popen

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_s3_server(log_path: str, host: str = "127.0.0.1") -> S3Server:
    """`host`: the address to listen on (a test's bridge to its network namespaces)."""
    port = _free_port()
    endpoint = f"http://{host}:{port}"
    with open(log_path, "ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = S3Server(endpoint, process)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the S3 server exited with {process.returncode}; see {log_path}")
        try:
            httpx.get(f"{endpoint}/moto-api/", timeout=1)
            return server
        except httpx.HTTPError:
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"the S3 server did not answer on {endpoint} within 60 s; see {log_path}")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    server = start_s3_server(str(tmp_path_factory.mktemp("s3") / "moto.log"))
    try:
        yield server
    finally:
        server.stop()


_buckets = itertools.count()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch) -> str:
    """A fresh, empty bucket as s3://name, with the environment pointing at the server."""
    import fsspec

    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    name = f"etrain-test-{os.getpid()}-{next(_buckets)}"
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(name)
    fsspec.filesystem("s3").invalidate_cache()
    return f"s3://{name}"
