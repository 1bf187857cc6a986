"""The small task every fsdp_basics lesson trains: the spirals of ddp_basics/toy.py, and a
model made of blocks, because FSDP shards (and gathers) one block at a time.

make_data is deterministic in its seed, so every rank builds the same full data set and
takes its own share. It draws on the CPU (a CPU generator gives the same numbers on every
machine); a lesson moves the data to ctx.device. BlockMLP keeps almost all its parameters in `blocks` (width x width
each), so the per-rank memory of fsdp_memory.py is close to the ideal 1/N.
"""
import math

import torch
from torch import nn


def make_data(n, seed=0, classes=4, noise=0.15):
    """n points (x: float32 [n, 2], y: int64 [n]) on `classes` interleaved spirals."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g, device="cpu")
    t = torch.rand(n, generator=g, device="cpu") * 2.5 + 0.25  # radius and angle grow together
    angle = t * 2.0 + y.float() * (2 * math.pi / classes)
    x = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1)
    return x + noise * torch.randn(n, 2, generator=g, device="cpu"), y


class Block(nn.Module):
    """x + tanh(W x + b): residual, so a deep stack still trains."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class BlockMLP(nn.Module):
    def __init__(self, width=64, depth=2, classes=4):
        super().__init__()
        self.inp = nn.Linear(2, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)

