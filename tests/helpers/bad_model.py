"""A user model with a bug: it raises on its first forward."""

from torch import nn


class Broken(nn.Module):
    def __init__(self, num_classes: int):
        super().__init__()
        self.head = nn.Linear(4, num_classes)

    def forward(self, x):
        raise ValueError("shape bug in Broken.forward: expected 4 features")


def build(*, in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    return Broken(num_classes)


def unbuildable(*, in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    raise RuntimeError("cannot build: the config asks for 3 heads on a width of 128")
