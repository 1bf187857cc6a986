"""The small task every fsdp_basics lesson trains, and the skeleton they share.

The data are the spirals of ddp_basics/toy.py; the model is made of blocks, because FSDP
shards (and gathers) one block at a time. Every lesson trains the same way: the same seed,
the same global batch per step (`rank_batch` gives each rank its equal share of it), Adam,
and the same loop, so that `diff` between two lessons shows what the second one adds. The
checks compare with `train_one_process`: the same model and Adam in one process, each step
on the whole global batch, which is what data parallelism must reproduce.
"""

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def make_data(n, seed=0, classes=4, noise=0.15):
    """n points (x: float32 [n, 2], y: int64 [n]) on `classes` interleaved spirals."""
    g = torch.Generator().manual_seed(
        seed
    )  # on the CPU: the same data on every device; callers .to(device)
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
    """Input layer, `depth` blocks of width x width (almost all the parameters), head."""

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


def rank_batch(x, y, step, batch, ctx):
    """This rank's share of step `step`'s global batch of `batch` rows (N divides `batch`): the
    global batch of a step is the same at any world size, so runs at N and M ranks compare."""
    per_rank = batch // ctx.world_size
    lo = step * batch + ctx.rank * per_rank
    return x[lo : lo + per_rank], y[lo : lo + per_rank]


def train_one_process(model, x, y, batch, steps, lr):
    """The reference: `model` trained in this process alone, each step on the whole global batch.
    Returns the loss of each step. Equal shares averaged over N ranks have the same mean loss, so
    the same gradient: a data-parallel run must match it up to float32 rounding."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = F.cross_entropy(
            model(x[step * batch : (step + 1) * batch]), y[step * batch : (step + 1) * batch]
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def storage_bytes(tensors):
    """Bytes of the storages behind `tensors`: a storage several tensors share counts once, a
    DTensor (FSDP's sharded parameter) counts its local shard. Read from the tensors: works on any
    device."""
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()
    )


def step_bytes(model, opt, x, y):
    """One more training step on (x, y); returns [parameters, gradients, optimizer state]: the bytes
    this process holds at the end of the step (Adam's state exists from its first step on)."""
    F.cross_entropy(model(x).float(), y).backward()
    opt.step()
    params = list(model.parameters())
    held = [
        storage_bytes(params),
        storage_bytes(p.grad for p in params),
        storage_bytes(t for s in opt.state.values() for t in s.values()),
    ]
    opt.zero_grad()
    return held


@contextlib.contextmanager
def record_collectives(log):
    """Append (name, ranks of its group) to `log` for each call FSDP2 makes: in torch 2.13 it calls
    these three through the torch.distributed module
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), so wrapping the module's attributes
    sees them. (CommDebugMode in torch.distributed.tensor.debug counts them too, but does not say on
    which group.) Used by hsdp.py."""
    saved = {
        name: getattr(dist, name)
        for name in ("all_gather_single", "reduce_scatter_single", "all_reduce")
    }

    def recorded(name, call):
        def wrapper(*a, group=None, **kw):
            log.append((name, tuple(dist.get_process_group_ranks(group or dist.group.WORLD))))
            return call(*a, group=group, **kw)

        return wrapper

    try:
        for name, call in saved.items():
            setattr(dist, name, recorded(name, call))
        yield log
    finally:
        for name, call in saved.items():
            setattr(dist, name, call)
