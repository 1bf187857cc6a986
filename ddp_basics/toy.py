"""The small task every ddp_basics lesson trains: data and model built in code, no download.

Points in 2-D are labelled by which of 4 interleaved spirals they lie on; a 3-layer MLP
learns it in a few hundred steps on a CPU. make_data is deterministic in its seed, so every
rank builds the same full data set and takes its own share of it.
"""
import math

import torch
from torch import nn


def make_data(n, seed=0, classes=4, noise=0.15):
    """n points (x: float32 [n, 2], y: int64 [n]) on `classes` spirals."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    t = torch.rand(n, generator=g) * 2.5 + 0.25  # radius and angle grow together
    angle = t * 2.0 + y.float() * (2 * math.pi / classes)
    x = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1)
    return x + noise * torch.randn(n, 2, generator=g), y


class MLP(nn.Module):
    def __init__(self, width=64, classes=4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                 nn.Linear(width, classes))

    def forward(self, x):
        return self.net(x)


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()
