from __future__ import annotations

import pytest


@pytest.fixture
def one_rank_group(tmp_path):
    """A process group of this process alone: what FSDP and DCP need to run in a unit test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'one-rank-store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
