"""Model registry: a name in the spec to a builder of an nn.Module.

Each builder takes the ModelSpec and what the data decides (in_channels, num_classes,
image_size), and picks the spec fields its architecture uses.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import nn

from workers.models.gpt import gpt
from workers.models.mlp import mlp
from workers.models.resnet import resnet18
from workers.models.simple_cnn import simple_cnn
from workers.spec import ModelSpec

Builder = Callable[..., nn.Module]


def _custom(spec: ModelSpec, **data) -> nn.Module:
    module, _, attr = spec.factory.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"model.factory {spec.factory!r} cannot be imported: {e}") from e
    return factory(**data)


REGISTRY: dict[str, Builder] = {
    "simple_cnn": lambda spec, **data: simple_cnn(**data),
    "resnet18": lambda spec, **data: resnet18(**data),
    "mlp": lambda spec, **data: mlp(hidden=spec.hidden, **data),
    "gpt": lambda spec, **data: gpt(layers=spec.layers, width=spec.width, heads=spec.heads, context=spec.context,
                                    **data),
    "custom": _custom,  # model.factory: a user's model on a built-in dataset and loss
}


def build_model(spec: ModelSpec, *, in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    return REGISTRY[spec.name](spec, in_channels=in_channels, num_classes=num_classes, image_size=image_size)
