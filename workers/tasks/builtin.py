"""The project's own models and datasets as tasks, through the same seam as a user's.

Their datasets are tensors in memory with a `batch(indices)` method, so a batch is one
indexing operation; a user's map-style dataset goes through a DataLoader instead.
"""

from __future__ import annotations

from torch import nn

from workers.data import Splits, load
from workers.models import build_model


class ImageTask:
    """An image classifier: model.name on dataset.name, cross-entropy, accuracy."""

    def __init__(self, spec):
        self.spec = spec
        self._splits: Splits | None = None

    def splits(self) -> Splits:
        if self._splits is None:
            self._splits = load(self.spec.dataset, self.spec.training.seed, context=self.spec.model.context)
        return self._splits

    def datasets(self):
        return self.splits().train, self.splits().val

    def model(self) -> nn.Module:
        s = self.splits()
        return build_model(self.spec.model, in_channels=s.in_channels, num_classes=s.num_classes,
                           image_size=s.image_size)

    def loss(self, output, target):
        """Cross-entropy over classes (images) or over every position's next token (text)."""
        return nn.functional.cross_entropy(output.flatten(0, -2).float(), target.flatten())

    def metrics(self, output, target) -> dict[str, float]:
        return {"accuracy": (output.argmax(-1) == target).float().mean().item()}


class TextTask(ImageTask):
    """A next-token model (gpt) on a token set; it can also be split by layers."""

    def tensor_plan(self, model: nn.Module) -> dict:
        return model.tensor_parallel_plan()

    def pipeline_stages(self, model: nn.Module, n: int) -> list[nn.Module]:
        return [model.stage(i, n) for i in range(n)]
