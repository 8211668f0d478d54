from torch import nn


def resnet18(*, in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> nn.Module:
    """torchvision's ResNet-18, untrained, with its stem adapted to the input channels."""
    # Imported here: torchvision.models takes ~1.4 s to import, paid by every worker that
    # trains anything else.
    from torchvision.models import resnet18 as tv_resnet18

    model = tv_resnet18(weights=None, num_classes=num_classes)
    if in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model
