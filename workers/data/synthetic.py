from __future__ import annotations

import torch


def synthetic(*, size: int, num_classes: int, channels: int, image_size: int, noise: float, seed: int):
    """A learnable class-conditional image set: each class is a fixed random prototype,
    each sample its prototype plus Gaussian noise. Same seed, same data, on any machine."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(num_classes, channels, image_size, image_size, generator=g)
    labels = torch.randint(0, num_classes, (size,), generator=g)
    images = prototypes[labels] + noise * torch.randn(size, channels, image_size, image_size, generator=g)
    return images, labels
