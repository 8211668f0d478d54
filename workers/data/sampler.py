"""Which samples each rank trains on, resumable mid-epoch.

torch's DistributedSampler cannot start in the middle of an epoch. This one can: the
data position (epoch, batch) is all it needs, so it is what the checkpoint stores.
Step k of an epoch takes samples perm[k*G:(k+1)*G] of one seeded permutation and rank
r the r-th of W near-equal slices of those, so the global batch is the same whatever
the world size, even one that does not divide it (an elastic job's).
"""

from __future__ import annotations

import torch


class ResumableDistributedSampler:
    def __init__(self, num_samples: int, global_batch: int, *, rank: int, world_size: int, seed: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        if global_batch < world_size:
            raise ValueError(f"training.global_batch_size ({global_batch}) is smaller than the {world_size} data-parallel "
                             "ranks that share it")
        if num_samples < global_batch:
            raise ValueError(f"the training split has {num_samples} samples, fewer than one global batch "
                             f"(training.global_batch_size = {global_batch}): use more data or a smaller batch")
        self.num_samples = num_samples
        self.global_batch = global_batch
        # r*G//W, not r*(G//W): slices differ by at most one sample when W does not divide G.
        self.lo, self.hi = rank * global_batch // world_size, (rank + 1) * global_batch // world_size
        self.local_batch = self.hi - self.lo
        self.max_local_batch = -(-global_batch // world_size)
        self.rank = rank
        self.seed = seed

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch  # the ragged tail is dropped, as drop_last does

    def permutation(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))

    def batches(self, epoch: int, start: int = 0):
        """Yield (batch_index, this rank's sample indices) from batch `start` of `epoch`."""
        perm = self.permutation(epoch)
        for k in range(start, self.steps_per_epoch):
            base = k * self.global_batch
            yield k, perm[base + self.lo : base + self.hi]
