"""Batches of a split, for the lists of indices the sampler hands out.

The built-in sets are tensors with `batch(indices)`: one indexing operation. A task's
map-style dataset goes through torch's DataLoader, whose worker processes
(dataset.loader_workers) read ahead. It is rebuilt from the sampler's position on
every attempt, so resuming mid-epoch needs no loader state: torchdata's
StatefulDataLoader would snapshot per-rank iterators, which cannot be re-split when
an elastic job resumes on a different number of workers; the position can.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader


def read(dataset, index_batches: list[torch.Tensor], *, workers: int = 0,
         seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    if callable(getattr(dataset, "batch", None)):
        return (dataset.batch(indices) for indices in index_batches)
    loader = DataLoader(dataset, batch_sampler=[indices.tolist() for indices in index_batches], num_workers=workers,
                        # Its own generator: loader workers' seeds come from the position, and
                        # the training RNG that checkpoints restore is left untouched.
                        generator=torch.Generator().manual_seed(seed))
    return iter(loader)
