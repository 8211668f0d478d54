from torch import nn


def mlp(*, in_channels: int = 1, num_classes: int = 10, image_size: int = 28, hidden: int = 128) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_channels * image_size * image_size, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )
