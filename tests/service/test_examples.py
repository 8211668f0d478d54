"""The README's examples, as written, through the service: `etrain serve` as the README
shows it (plus free ports and a data directory of its own), then
`etrain submit examples/<each>.yaml --watch` from the repository root, each SUCCEEDED."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.service.conftest import start_serve, stop_serve

pytestmark = pytest.mark.ray

EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))
# What the README says to run from the repository root; ../shared/data holds the MNIST
# files examples/demo.yaml names, and 4 logical CPUs fit the 4-worker examples.
SERVE_ARGS = ["--dataset-root", "../shared/data", "--num-cpus", "4"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    data = tmp_path_factory.mktemp("examples")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "ETRAIN_RAY_ADDRESS", "ETRAIN_TOKEN")}
    serve = start_serve(["--data-dir", str(data), *SERVE_ARGS], env, data / "serve.log")
    try:
        yield serve, data
    finally:
        stop_serve(serve)


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_succeeds_through_etrain_submit(served, example):
    serve, data = served
    done = subprocess.run([sys.executable, "-m", "service.cli", "submit", f"examples/{example}", "--watch",
                           "--url", serve.url, "--data-dir", str(data)],
                          cwd=ROOT, env=serve.env, capture_output=True, text=True, timeout=540)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "SUCCEEDED" in out and "Traceback" not in out
