from torch import nn


def simple_cnn(*, in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> nn.Module:
    """The classic MNIST CNN: one 3x3 conv to 32 channels, ReLU, flatten, one linear layer."""
    side = image_size - 2
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, kernel_size=3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * side * side, num_classes),
    )
