"""The small task every ddp_basics lesson trains: data and model built in code, no download.

Points in 2-D are labelled by which of 4 interleaved spirals they lie on; a 3-layer MLP
learns it in a few hundred steps on a CPU. make_data is deterministic in its seed, so every
rank builds the same full data set; DistributedSampler gives each rank its share of it.
The rest is for the lessons' checks: `global_batches` rebuilds, by hand, what every rank's
sampler handed out (the single-process reference trains on it), `flat` and `spread`.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def make_data(n, seed=0, classes=4, noise=0.15):
    """n points (x: float32 [n, 2], y: int64 [n]) on `classes` spirals."""
    # on the CPU: the same data on every device; callers .to(device)
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g, device="cpu")
    t = torch.rand(n, generator=g, device="cpu") * 2.5 + 0.25  # radius and angle grow together
    angle = t * 2.0 + y.float() * (2 * math.pi / classes)
    x = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1)
    return x + noise * torch.randn(n, 2, generator=g, device="cpu"), y


class MLP(nn.Module):
    """2 -> width, `depth` hidden width x width layers, -> classes; tanh between them."""

    def __init__(self, width=64, classes=4, depth=1):
        super().__init__()
        layers = [nn.Linear(2, width)]
        for _ in range(depth):
            layers += [nn.Tanh(), nn.Linear(width, width)]
        self.net = nn.Sequential(*layers, nn.Tanh(), nn.Linear(width, classes))

    def forward(self, x):
        return self.net(x)


def fp32_tolerance(tol):
    """`tol` for two float32 trainings on one device, widened if float32 matmuls are not IEEE.

    Both runs round alike only up to summation order (a few ulp per step), which `tol` covers at
    torch's default precision "highest" (IEEE float32 matmuls on CPU and GPU). With TF32 switched on
    ("high": torch.backends.cuda.matmul.fp32_precision = "tf32" or set_float32_matmul_precision)
    a matmul rounds its inputs to 10 mantissa bits, 2**13 times coarser than float32's 23 ("medium",
    bfloat16: 7 bits, 2**16), and a difference that starts as rounding grows in proportion to it
    (to first order): the bound scales the same way. Source: torch.get_float32_matmul_precision and
    https://pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices
    """
    widen = {"highest": 1, "high": 2**13, "medium": 2**16}
    return tol * widen[torch.get_float32_matmul_precision()]


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def sampler_order(n, world_size, rank, seed, epoch):
    """What DistributedSampler(shuffle=True, seed=seed, drop_last=False) hands `rank` in `epoch`,
    by hand (torch/utils/data/distributed.py, torch 2.13): a permutation seeded with seed + epoch,
    padded by wrapping to a multiple of world_size, then every world_size-th index from `rank`
    on."""
    g = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(n, generator=g, device="cpu").tolist()
    order += order[: -(-n // world_size) * world_size - n]
    return order[rank::world_size]


def global_batches(n, world_size, seed, epoch, batch):
    """Index lists, one per step: every rank's batch of that step (`batch` of its sampler order),
    concatenated. The ranks' batches have equal sizes, so the mean loss over the concatenation is
    the mean of the ranks' mean losses: what DDP's averaged gradient is the gradient of."""
    orders = [sampler_order(n, world_size, r, seed, epoch) for r in range(world_size)]
    return [
        [i for order in orders for i in order[lo : lo + batch]]
        for lo in range(0, len(orders[0]), batch)
    ]


def flat(model):
    """All parameters as one vector (a copy, detached)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def spread(values):
    """max over elements of (max over ranks - min over ranks): 0.0 iff every rank holds the same
    values (two all_reduces, MAX and MIN; every rank must call it)."""
    high, low = values.clone(), values.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return (high - low).abs().max().item()


def check_matches_single_process(model, x, y, sampler, args, ctx):
    """Independent reference: one process on ctx.device, seeded as rank 0 was (so rank 0's weights
    must have reached every rank), at each step the concatenation of every rank's batch rebuilt by
    hand (toy.global_batches). Same device and float32 arithmetic, so the runs differ by summation
    order only: a few ulp per step, measured 1-2e-6 after 3 epochs (113 steps with momentum) on
    CPU; --tol 1e-5, widened only if TF32 matmuls are on (toy.fp32_tolerance)."""
    torch.manual_seed(0)
    single = MLP(args.width).to(ctx.device)
    opt = torch.optim.SGD(single.parameters(), lr=args.lr, momentum=0.9)
    xd, yd = x.to(ctx.device), y.to(ctx.device)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        if list(sampler) != sampler_order(len(x), ctx.world_size, ctx.rank, args.seed, epoch):
            raise RuntimeError("the hand-computed order differs from DistributedSampler's")
        for idx in global_batches(len(x), ctx.world_size, args.seed, epoch, args.batch):
            opt.zero_grad()
            F.cross_entropy(single(xd[idx]), yd[idx]).backward()
            opt.step()
    return (flat(model) - flat(single)).abs().max().item(), fp32_tolerance(args.tol)
