"""Ray Train's torch backend (`ray.train.torch.TorchConfig`) as the controller and the
driver see it, without importing torch there.

Ray's `ray/train/torch/config.py` imports torch at module level, and the controller
unpickles the trainer's backend config, so every controller process imported torch
(~1.3 CPU-s here) only to call `dist.is_available()` and hand the workers functions
that live in that module. It did so while the workers' processes imported torch for
real, on the same cores, on the way to the first step. This config keeps the controller's
half of Ray's backend (an address and a port from rank 0, the environment, one
`init_process_group` per rank, the teardown) and hands the workers Ray's own functions
through thin wrappers that import them there, where torch is loaded anyway.

Exact mode only: live mode's `TorchftConfig` extends Ray's `TorchConfig` (torch in the
controller stays there). Ray is pinned to 2.60.0 in pyproject.toml; the worker-side
functions named here are private to it."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import ray
from ray._private import ray_constants
from ray.exceptions import GetTimeoutError
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
from ray.train.v2._internal.util import TrainingFramework

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


@dataclass
class TorchConfig(BackendConfig):
    """Ray's `TorchConfig` with `init_method="env"`: the one this project uses."""

    backend: str = "gloo"
    timeout_s: int = 1800

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r}: expected one of {', '.join(BACKENDS)}")

    @property
    def backend_cls(self):
        return TorchBackend

    @property
    def train_func_context(self):
        return CudaDevice

    @property
    def framework(self):
        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class CudaDevice:
    """Around the train function on each worker: Ray's (it sets the worker's CUDA device)."""

    def __enter__(self):
        from ray.train.torch.config import TorchConfigContextManager

        self._inner = TorchConfigContextManager()
        return self._inner.__enter__()

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


class TorchBackend(Backend):
    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group, backend_config: TorchConfig):
        addr, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(_set_env, addr=addr, port=port)
        ray.get([
            worker_group.execute_single_async(i, _init_process_group, backend=backend_config.backend, world_rank=i,
                                              world_size=len(worker_group), init_method="env://",
                                              timeout_s=backend_config.timeout_s)
            for i in range(len(worker_group))
        ])

    def on_shutdown(self, worker_group, backend_config: TorchConfig):
        futures = worker_group.execute_async(_shutdown, destroy_process_group=len(worker_group) > 1)
        timeout_s = ray_constants.env_integer(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
                                              DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
        try:
            ray.get(futures, timeout=timeout_s)
        except GetTimeoutError:
            logger.warning(f"Torch process group shutdown timed out after {timeout_s} seconds")


# On the workers, which import torch in any case: Ray's own functions.

def _set_env(addr: str, port: int) -> None:
    from ray.train.torch.config import _set_torch_distributed_env_vars

    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)
    _set_torch_distributed_env_vars()  # LOCAL_RANK, RANK, WORLD_SIZE, ...: before the process group


def _init_process_group(**kwargs) -> None:
    from ray.train.torch.config import _setup_torch_process_group

    _setup_torch_process_group(**kwargs)


def _shutdown(destroy_process_group: bool) -> None:
    from ray.train.torch.config import _shutdown_torch

    _shutdown_torch(destroy_process_group=destroy_process_group)
