"""Model registry: a name in the spec to a builder of an nn.Module."""

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

REGISTRY: dict[str, Builder] = {"simple_cnn": simple_cnn, "resnet18": resnet18, "mlp": mlp, "gpt": gpt}


def _custom(factory: str) -> Builder:
    module, _, attr = factory.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"model.factory {factory!r} cannot be imported: {e}") from e


def build_model(spec: ModelSpec, *, in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    builder = _custom(spec.factory) if spec.name == "custom" else REGISTRY[spec.name]
    kwargs = {"in_channels": in_channels, "num_classes": num_classes, "image_size": image_size}
    if spec.name == "mlp":
        kwargs["hidden"] = spec.hidden
    if spec.name == "gpt":
        kwargs.update(layers=spec.layers, width=spec.width, heads=spec.heads, context=spec.context)
    return builder(**kwargs)
