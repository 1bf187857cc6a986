"""Parameters that get no gradient in a step: the error DDP gives, and the two fixes.

DDP all_reduces a bucket once every parameter in it has its gradient. A branch that the forward
pass did not use never produces one, so the step never finishes; DDP notices at the next forward
and raises on every rank (plain_ddp_raises, below the divider, shows it). The fixes:
  find_unused_parameters=True  walks the autograd graph after each forward and marks the
                               parameters that were not used as ready (costs a traversal per step);
  static_graph=True            for a model whose set of used parameters is the same every step:
                               DDP records it in the first step and reuses it.

    torchrun --nproc_per_node=3 ddp_basics/ddp_unused_parameters.py
    python ddp_basics/ddp_unused_parameters.py --nproc 2

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.dist_setup import float_in, int_in, lesson_parser, print0, run
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


def train(model, args, ctx, x, y, alternate, rank_share=True):
    """SGD for args.steps; under DDP each rank takes its slice of every global batch. alternate:
    head_b on odd steps only, else head_a always."""
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    per = args.batch // ctx.world_size if rank_share else args.batch
    for step in range(args.steps):
        lo = step * args.batch + (ctx.rank * per if rank_share else 0)
        xb, yb = x[lo : lo + per].to(ctx.device), y[lo : lo + per].to(ctx.device)
        F.cross_entropy(model(xb, use_b=alternate and step % 2 == 1), yb).backward()
        opt.step()
        opt.zero_grad()
    return model


def main(args, ctx):
    ctx.require(
        args.batch % ctx.world_size == 0,
        f"--batch {args.batch} must divide by {ctx.world_size} ranks",
    )
    x, y = make_data(args.batch * args.steps, seed=0)
    torch.manual_seed(0)
    start = TwoHeads(args.width).to(ctx.device)  # made on the CPU, the same everywhere, then moved

    plain_ddp_raises(start, x, y, args, ctx)  # 1. plain DDP, the heads alternating: an error
    # 2. find_unused_parameters=True: after each forward DDP marks the unused head's grads ready
    ddp = DDP(copy.deepcopy(start), find_unused_parameters=True)
    train(ddp, args, ctx, x, y, alternate=True)
    trained = {"find_unused_parameters=True, heads alternate": (ddp, True)}
    # 3. static_graph=True: the same parameters are used (head_b never) at every step
    ddp = DDP(copy.deepcopy(start), static_graph=True)
    train(ddp, args, ctx, x, y, alternate=False)
    trained["static_graph=True, head_b never used"] = (ddp, False)
    check(trained, start, x, y, args, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


def plain_ddp_raises(start, x, y, args, ctx):
    """Plain DDP, head_b used on odd steps only: step 0 leaves head_b without gradients, and the
    next forward raises, on every rank."""
    try:
        train(DDP(copy.deepcopy(start)), args, ctx, x, y, alternate=True)
    except RuntimeError as error:
        first = str(error).strip().splitlines()[0].split(". ")[0] + "."
        if "finished reduction" not in first:
            raise
        print0(
            f"plain DDP, a head unused in step 0 -> RuntimeError at the next forward:\n  {first}"
        )
        return
    raise RuntimeError("plain DDP with an unused branch was expected to fail and did not")


def check(trained, start, x, y, args, ctx):
    """One process on ctx.device, the whole batch, the same head schedule. Both in float32 on one
    device: they differ by summation order only (shard means averaged vs one mean), measured 3e-8
    after 6 steps on CPU; bound 1e-5."""
    tol = fp32_tolerance(1e-5)  # widened only if TF32 matmuls are on (see toy.py)
    for name, (ddp, alternate) in trained.items():
        single = train(copy.deepcopy(start), args, ctx, x, y, alternate, rank_share=False)
        worst = max(
            (p.detach() - q.detach()).abs().max().item()
            for p, q in zip(ddp.module.parameters(), single.parameters())
        )
        print0(f"{name}: max |param - single-process param| = {worst:.2e} (tolerance {tol:g})")
        if not worst <= tol:  # `not <=`: a NaN fails too
            raise RuntimeError(
                f"{name}: DDP training differs from single-process training by {worst:.2e}"
            )
    print0(
        "OK: an unused branch makes plain DDP raise at the next forward; "
        "find_unused_parameters=True and static_graph=True both train it and match single-process "
        "training"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--batch",
        type=int_in(1, 10**5),
        default=48,
        help="global batch (divisible by the world size)",
    )
    parser.add_argument(
        "--steps",
        type=int_in(2, 1000),
        default=6,
        help="steps (2 or more: the error shows at the second forward)",
    )
    parser.add_argument("--width", type=int_in(1, 16384), default=32, help="hidden width")
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.5)
    run(main, parser.parse_args())
