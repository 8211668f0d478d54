"""workers/models: the registry and its builders."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from workers.models import REGISTRY, build_model
from workers.models.simple_cnn import simple_cnn
from workers.spec import ModelSpec


def test_simple_cnn_has_the_classic_layout():
    model = simple_cnn()
    layers = list(model.children())
    assert [type(m) for m in layers] == [nn.Conv2d, nn.ReLU, nn.Flatten, nn.Linear]
    conv, _, _, linear = layers
    assert (conv.in_channels, conv.out_channels, conv.kernel_size) == (1, 32, (3, 3))
    assert conv.stride == (1, 1) and conv.padding == (0, 0)
    assert (linear.in_features, linear.out_features) == (32 * 26 * 26, 10)
    assert sum(p.numel() for p in model.parameters()) == (32 * 9 + 32) + (32 * 26 * 26 * 10 + 10)


def test_simple_cnn_maps_mnist_images_to_ten_logits():
    model = build_model(ModelSpec(name="simple_cnn"), in_channels=1, num_classes=10, image_size=28)
    out = model(torch.randn(5, 1, 28, 28))
    assert out.shape == (5, 10)
    assert torch.isfinite(out).all()


def test_simple_cnn_follows_channels_classes_and_size():
    model = build_model(ModelSpec(name="simple_cnn"), in_channels=3, num_classes=4, image_size=16)
    assert model[0].in_channels == 3
    assert model[-1].in_features == 32 * 14 * 14 and model[-1].out_features == 4
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 4)


@pytest.mark.parametrize("channels, classes", [(1, 10), (3, 100), (2, 7)])
def test_resnet18_accepts_other_channels_and_classes(channels, classes):
    model = build_model(ModelSpec(name="resnet18"), in_channels=channels, num_classes=classes, image_size=32)
    assert model.conv1.in_channels == channels
    assert model.fc.out_features == classes
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(2, channels, 32, 32)).shape == (2, classes)


def test_mlp_uses_the_hidden_width():
    model = build_model(ModelSpec(name="mlp", hidden=24), in_channels=1, num_classes=10, image_size=28)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(784, 24), (24, 10)]
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 10)


def test_registry_holds_the_builtin_models():
    assert set(REGISTRY) == {"simple_cnn", "resnet18", "mlp", "gpt", "custom"}


def test_custom_factory_is_imported_and_called():
    model = build_model(ModelSpec(name="custom", factory="tests.helpers.bad_model:build"),
                        in_channels=1, num_classes=6, image_size=28)
    assert type(model).__name__ == "Broken"
    assert model.head.out_features == 6


@pytest.mark.parametrize("factory", ["no_such_module_for_etrain:build", "tests.helpers.bad_model:no_such_function"])
def test_custom_with_a_bad_factory_path_names_it(factory):
    with pytest.raises(ValueError, match="cannot be imported") as info:
        build_model(ModelSpec(name="custom", factory=factory), in_channels=1, num_classes=10, image_size=28)
    assert repr(factory) in str(info.value)


def test_custom_factory_must_look_like_module_colon_function():
    with pytest.raises(ValidationError) as info:
        ModelSpec(name="custom", factory="os.system('true')")
    assert info.value.errors()[0]["loc"] == ("factory",)
