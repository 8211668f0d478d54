"""The exact-mode backend config keeps torch out of the driver and the controller, and
does on the workers what Ray's torch backend does."""

from __future__ import annotations

import subprocess
import sys

import pytest

from workers import torch_backend
from workers.torch_backend import TorchBackend, TorchConfig


def test_the_driver_builds_its_trainer_and_the_controller_reads_its_config_without_torch(tmp_path):
    # As the driver: the whole trainer for an exact-mode spec. As the controller: the
    # pickled backend config and callbacks, in a fresh process.
    code = f"""
import pickle, subprocess, sys
from workers.run import _trainer
from workers.spec import JobSpec, absolute_paths
spec = absolute_paths(JobSpec.model_validate({{"job_id": "j", "storage": {str(tmp_path)!r}, "workers": 2}}))
trainer = _trainer(spec, spec.run_dir, own_cluster=True)
assert 'torch' not in sys.modules, 'the driver imported torch'
import ray.cloudpickle
blob = ray.cloudpickle.dumps((trainer.backend_config, trainer.run_config.callbacks))
child = "import pickle, sys; pickle.loads(sys.stdin.buffer.read()); print('torch' in sys.modules)"
done = subprocess.run([sys.executable, '-c', child], input=blob, capture_output=True, check=True)
print(done.stdout.decode().strip())
"""
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "the controller would import torch"


def test_live_mode_keeps_rays_torchft_config(tmp_path):
    from ray.train.v2.torch.torchft_config import TorchftConfig

    from workers.run import _torch_config
    from workers.spec import JobSpec

    spec = JobSpec.model_validate({"job_id": "j", "storage": str(tmp_path), "workers": 3,
                                   "failure": {"mode": "live"}})
    assert isinstance(_torch_config(spec, use_gpu=False), TorchftConfig)


def test_an_unknown_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="'mpi'.*gloo, nccl"):
        TorchConfig(backend="mpi")
    assert TorchConfig(backend="nccl", timeout_s=30).to_dict() == {"backend": "nccl", "init_method": "env",
                                                                   "timeout_s": 30}


class Group:
    """What the backend asks of Ray Train's worker group, recorded."""

    def __init__(self, n: int):
        self.n, self.calls = n, []

    def __len__(self):
        return self.n

    def execute_single(self, rank, fn, **kw):
        self.calls.append(("single", rank, fn.__name__, kw))
        return "10.0.0.7", 29500

    def execute(self, fn, **kw):
        self.calls.append(("all", None, fn.__name__, kw))

    def execute_single_async(self, rank, fn, **kw):
        self.calls.append(("single_async", rank, fn.__name__, kw))
        return rank

    def execute_async(self, fn, **kw):
        self.calls.append(("all_async", None, fn.__name__, kw))
        return []


def test_on_start_hands_every_rank_rank_0s_address_then_its_own_rank(monkeypatch):
    monkeypatch.setattr(torch_backend.ray, "get", lambda refs, **kw: refs)
    group = Group(3)
    TorchBackend().on_start(group, TorchConfig(backend="gloo", timeout_s=45))
    assert group.calls[0] == ("single", 0, "get_address_and_port", {})
    assert group.calls[1] == ("all", None, "_set_env", {"addr": "10.0.0.7", "port": 29500})
    assert group.calls[2:] == [
        ("single_async", i, "_init_process_group", {"backend": "gloo", "world_rank": i, "world_size": 3,
                                                    "init_method": "env://", "timeout_s": 45})
        for i in range(3)
    ]
    group.calls.clear()
    TorchBackend().on_shutdown(group, TorchConfig())
    assert group.calls == [("all_async", None, "_shutdown", {"destroy_process_group": True})]
