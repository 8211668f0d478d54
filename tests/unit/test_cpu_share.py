"""bench/cpu_share.py: the workers' and the background's shares of the machine."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location("cpu_share", os.path.join(ROOT, "bench", "cpu_share.py"))
cpu_share = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("cpu_share", cpu_share)  # a dataclass looks its module up there
_spec.loader.exec_module(cpu_share)


def test_shares_come_from_the_samples_inside_the_window_and_a_process_born_inside_counts_from_zero():
    sampler = cpu_share.CpuSampler()
    sampler.samples = [
        (0.0, {1: (False, "raylet", 0.0)}),  # before the window: not used
        (10.0, {1: (False, "raylet", 1.0), 2: (True, "ray::RayTrainWorker", 5.0)}),
        (15.0, {1: (False, "raylet", 1.5), 2: (True, "ray::RayTrainWorker", 10.0),
                4: (True, "ray::RayTrainWorker", 2.0)}),
        # 4 ended before the last sample: it keeps the 2 s it showed
        (20.0, {1: (False, "raylet", 2.0), 2: (True, "ray::RayTrainWorker", 15.0), 3: (False, "gcs_server", 3.0)}),
    ]
    share = sampler.share(5.0, 25.0, cores=2)
    assert share["window_s"] == 10.0
    assert share["workers"] == (10.0 + 2.0) / 20.0
    assert share["background"] == (1.0 + 3.0) / 20.0
    assert share["background_top"] == {"gcs_server": 3.0 / 20.0, "raylet": 1.0 / 20.0}
    assert sampler.share(5.0, 12.0, cores=2) is None  # one sample inside is no interval


def test_a_real_process_tree_is_sampled_and_told_apart_by_its_command_line():
    # The parent sleeps; its child names the worker script and burns CPU.
    child = "import time; t = time.time()\nwhile time.time() - t < 2: pass"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1], 'torchrun_worker.py'])"), child])
    sampler = cpu_share.CpuSampler(interval_s=0.1)
    started = time.time()
    sampler.start(parent.pid)
    try:
        parent.wait(timeout=30)
    finally:
        sampler.stop()
    share = sampler.share(started, time.time(), cores=1)
    assert share is not None
    assert share["workers"] > 0.3
    assert share["background"] < share["workers"]
