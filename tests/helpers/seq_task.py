"""A user's task as plain torch: an nn.Sequential regressor with its own split hooks.
Its pipeline stages are new Sequentials over the model's layers, so their parameter
names ("0.weight") are not the model's ("2.weight"): the case strategies must map."""

import torch
from torch import nn


class SeqTask:
    def __init__(self, config):
        self.samples = int(config.get("samples", 512))

    def model(self):
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def datasets(self):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(self.samples, 8, generator=g)
        y = x[:, :4].sum(1, keepdim=True) - x[:, 4:].prod(1, keepdim=True)
        return torch.utils.data.TensorDataset(x, y), torch.utils.data.TensorDataset(x[:64], y[:64])

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)

    def tensor_plan(self, model):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"0": ColwiseParallel(), "2": RowwiseParallel()}

    def pipeline_stages(self, model, n):
        layers = list(model)
        cut = [round(i * len(layers) / n) for i in range(n + 1)]
        return [nn.Sequential(*layers[cut[i]:cut[i + 1]]) for i in range(n)]


def make_task(config):
    return SeqTask(config)
