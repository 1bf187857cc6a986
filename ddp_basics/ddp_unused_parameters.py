"""Parameters that get no gradient in a step: the error DDP gives, and the two fixes.

DDP all_reduces a bucket once every parameter in it has its gradient. A branch that the
forward pass did not use never produces one, so the step never finishes; DDP notices at the
next forward and raises (on every rank, so nothing hangs). The fixes:
  find_unused_parameters=True  walks the autograd graph after each forward and marks the
                               parameters that were not used as ready (costs a traversal per step);
  static_graph=True            for a model whose set of used parameters is the same every step:
                               DDP records it in the first step and reuses it.

    torchrun --nproc_per_node=3 ddp_basics/ddp_unused_parameters.py
    python ddp_basics/ddp_unused_parameters.py --nproc 2

Docs: https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.dist_setup import lesson_parser, print0, run
from toy import fp32_tolerance, make_data


class TwoHeads(nn.Module):
    """A trunk and two heads; each forward uses one head, chosen by the caller."""

    def __init__(self, width):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(2, width), nn.Tanh())
        self.head_a = nn.Linear(width, 4)
        self.head_b = nn.Linear(width, 4)

    def forward(self, x, use_b=False):
        return (self.head_b if use_b else self.head_a)(self.trunk(x))


def uses_b(step, branch):
    return branch and step % 2 == 1  # "alternate": head_b on odd steps only; else head_a always


def train(model, args, ctx, x, y, branch, rank_share=True):
    """SGD for args.steps; under DDP each rank takes its slice of every global batch."""
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    n = ctx.world_size if rank_share else 1
    per = args.batch // n
    for step in range(args.steps):
        lo = step * args.batch + (ctx.rank * per if rank_share else 0)
        xb, yb = x[lo : lo + per].to(ctx.device), y[lo : lo + per].to(ctx.device)
        F.cross_entropy(model(xb, use_b=uses_b(step, branch)), yb).backward()
        opt.step()
        opt.zero_grad()
    return model


def check(name, ddp, single):
    """Both trained on ctx.device in float32: they differ by summation order only (shard means
    averaged vs one mean), measured 3e-8 after 6 steps on CPU; bound 1e-5."""
    worst = max(
        (p.detach() - q.detach()).abs().max().item()
        for p, q in zip(ddp.module.parameters(), single.parameters())
    )
    tol = fp32_tolerance(1e-5)  # widened only if TF32 matmuls are on (see toy.py)
    print0(f"{name}: max |param - single-process param| = {worst:.2e} (tolerance {tol:g})")
    if not worst <= tol:  # `not <=`: a NaN fails too
        raise RuntimeError(
            f"{name}: DDP training differs from single-process training by {worst:.2e}"
        )


def main(args, ctx):
    ctx.require(
        args.batch % ctx.world_size == 0,
        f"--batch {args.batch} must divide by {ctx.world_size} ranks",
    )
    ctx.require(
        args.steps >= 2, "--steps must be at least 2 (the error shows at the second forward)"
    )
    x, y = make_data(args.batch * args.steps, seed=0)
    torch.manual_seed(0)
    start = TwoHeads(args.width).to(
        ctx.device
    )  # initialised on the CPU, the same everywhere, then moved

    # 1. Plain DDP, head_b used on odd steps only: step 0 leaves head_b without gradients.
    try:
        train(DDP(copy.deepcopy(start)), args, ctx, x, y, branch=True)
        raise RuntimeError("plain DDP with an unused branch was expected to fail and did not")
    except RuntimeError as error:
        first = str(error).strip().splitlines()[0].split(". ")[0] + "."
        if "finished reduction" not in first:
            raise
        print0(
            f"plain DDP, a head unused in step 0 -> RuntimeError at the next forward:\n  {first}"
        )

    # Independent reference: one process on ctx.device, the whole batch, the same head schedule.
    single = train(copy.deepcopy(start), args, ctx, x, y, branch=True, rank_share=False)
    ddp = DDP(copy.deepcopy(start), find_unused_parameters=True)
    check(
        "find_unused_parameters=True, heads alternate",
        train(ddp, args, ctx, x, y, branch=True),
        single,
    )

    # static_graph: the same parameters are used (and head_b unused) at every step.
    single = train(copy.deepcopy(start), args, ctx, x, y, branch=False, rank_share=False)
    ddp = DDP(copy.deepcopy(start), static_graph=True)
    check("static_graph=True, head_b never used", train(ddp, args, ctx, x, y, branch=False), single)
    print0(
        "OK: an unused branch makes plain DDP raise at the next forward; find_unused_parameters=True "
        "and static_graph=True both train it and match single-process training"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--batch", type=int, default=48, help="global batch (divisible by the world size)"
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.5)
    run(main, parser.parse_args())
