"""A task of its own: fit a noisy sine wave with a small MLP, under mean squared error.

elastic-train imports nothing here and this file imports nothing from elastic-train:
`make_task(config)` returns an object with model(), datasets() and loss(), plus the
optional hooks it supports (metrics, optimizer, fsdp_units).
"""

import math

import torch
from torch import nn


class Wave(torch.utils.data.Dataset):
    """x in [-pi, pi] with its first harmonics as features; the target is sin(freq * x) plus noise."""

    def __init__(self, samples: int, freq: float, noise: float, seed: int):
        g = torch.Generator().manual_seed(seed)
        x = torch.rand(samples, 1, generator=g) * 2 * math.pi - math.pi
        self.inputs = torch.cat([x, x**2 / 10, torch.cos(x)], dim=1)
        self.targets = torch.sin(freq * x) + noise * torch.randn(samples, 1, generator=g)

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return self.inputs[i], self.targets[i]


class Regressor(nn.Module):
    def __init__(self, hidden: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(3 if i == 0 else hidden, hidden), nn.Tanh()) for i in range(depth)]
        )
        self.out = nn.Linear(hidden, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class SineTask:
    def __init__(self, config: dict):
        self.samples = int(config.get("samples", 4096))
        self.freq = float(config.get("freq", 2.0))
        self.noise = float(config.get("noise", 0.05))
        self.hidden = int(config.get("hidden", 64))
        self.depth = int(config.get("depth", 3))
        self.seed = int(config.get("seed", 0))

    def model(self) -> nn.Module:
        return Regressor(self.hidden, self.depth)

    def datasets(self):
        return (Wave(self.samples, self.freq, self.noise, self.seed),
                Wave(self.samples // 8, self.freq, self.noise, self.seed + 1))

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)

    def metrics(self, output, target):
        return {"mae": (output - target).abs().mean().item()}

    def fsdp_units(self, model):
        return list(model.blocks)


def make_task(config: dict) -> SineTask:
    return SineTask(config)
