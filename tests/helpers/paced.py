"""A tiny model that trains slowly while a gate file exists, so a test can remove and
add Ray nodes mid-run and then let the job finish at full speed."""

from __future__ import annotations

import os
import time

from torch import nn

GATE_ENV = "ETRAIN_TEST_PACE_FILE"


class Paced(nn.Module):
    def __init__(self, in_features: int, num_classes: int, step_s: float):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, num_classes))
        self.step_s = step_s

    def forward(self, x):
        gate = os.environ.get(GATE_ENV)
        if self.training and gate and os.path.exists(gate):
            time.sleep(self.step_s)
        return self.net(x)


def paced_linear(in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    return Paced(in_channels * image_size * image_size, num_classes, step_s=0.25)


class Slow(nn.Module):
    """Every training step takes at least `step_s`: a job that lasts long enough to be
    disturbed mid-run, whatever the machine's speed."""

    def __init__(self, in_features: int, num_classes: int, step_s: float):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, num_classes))
        self.step_s = step_s

    def forward(self, x):
        if self.training:
            time.sleep(self.step_s)
        return self.net(x)


def slow_linear(in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    return Slow(in_channels * image_size * image_size, num_classes, step_s=0.1)
