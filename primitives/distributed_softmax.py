"""Softmax, log-sum-exp and L2 normalisation of one vector sharded across ranks.

Each rank holds a slice of x (uneven slices are fine). Softmax needs two numbers about
the whole vector, each one all_reduce away:
  m = max(x)                   all_reduce(MAX) of the local maxima
  s = sum(exp(x - m))          all_reduce(SUM) of the local sums
  softmax(x)_i = exp(x_i - m) / s,    logsumexp(x) = m + log(s)
Subtracting m first keeps every exp() <= 1: without it, exp(1000) overflows to inf and
softmax becomes nan (shown below). L2 normalisation is the same idea with one SUM of
squares. This is how vocabulary-parallel cross-entropy computes its loss.

    torchrun --nproc_per_node=3 primitives/distributed_softmax.py
    python primitives/distributed_softmax.py --nproc 4 --size 1000000 --offset 0

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce
"""

import torch
import torch.distributed as dist
from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run


def full_vector(args):
    """The whole vector, the same on every rank (same seed); each rank keeps its slice."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.size, generator=gen, dtype=torch.float64, device="cpu")
    return args.offset + args.scale * x


def main(args, ctx):
    ctx.require(
        args.size >= ctx.world_size,
        f"--size {args.size} leaves a rank with no element: use at least {ctx.world_size}",
    )
    x = torch.tensor_split(full_vector(args), ctx.world_size)[ctx.rank].to(ctx.device)

    m = x.max().clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    e = torch.exp(x - m)
    s = e.sum()
    dist.all_reduce(s, op=dist.ReduceOp.SUM)
    softmax, logsumexp = e / s, m + torch.log(s)

    sq = (x * x).sum()
    dist.all_reduce(sq, op=dist.ReduceOp.SUM)
    unit = x / torch.sqrt(sq)

    # Naive, unshifted: what the shift protects against (float32, as in most models).
    naive_s = torch.exp(x.float()).sum()
    dist.all_reduce(naive_s, op=dist.ReduceOp.SUM)
    naive = torch.exp(x.float()) / naive_s

    print_in_order(
        f"{x.numel()} elements {first3(x)}: softmax {first3(softmax)} unit {first3(unit)} "
        f"naive softmax {first3(naive)}"
    )
    check_against_unsharded(args, ctx, m, softmax, logsumexp, unit, naive)
    print0(
        f"OK: softmax, log-sum-exp and L2 normalisation of a {args.size}-element vector sharded "
        f"over {ctx.world_size} ranks (MAX then SUM all_reduce) match torch on the unsharded vector"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def first3(t):
    return [round(v, 3) for v in t[:3].tolist()] + (["..."] if t.numel() > 3 else [])


def check_against_unsharded(args, ctx, m, softmax, logsumexp, unit, naive):
    """The unsharded computation in plain torch, compared slice by slice."""
    full, rank, world = full_vector(args), ctx.rank, ctx.world_size
    want_softmax = torch.tensor_split(torch.softmax(full, 0), world)[rank]
    want_unit = torch.tensor_split(full / full.norm(), world)[rank]
    if not torch.allclose(softmax.cpu(), want_softmax) or not torch.allclose(unit.cpu(), want_unit):
        raise RuntimeError(
            f"rank {rank}: sharded softmax / L2 norm differ from torch on the full vector"
        )
    if m.item() != full.max().item():  # softmax hides a wrong shift (it cancels out): check m
        raise RuntimeError(f"global max {m.item()} != torch {full.max().item()}")
    want_lse = torch.logsumexp(full, 0)
    if not torch.allclose(logsumexp.cpu(), want_lse):
        raise RuntimeError(f"logsumexp {logsumexp.item()} != torch {want_lse.item()}")
    total = softmax.sum()
    dist.all_reduce(total)
    print0(
        f"logsumexp {logsumexp.item():.6f} (torch on the full vector: {want_lse.item():.6f}); "
        f"softmax sums to {total.item():.6f}; naive softmax has nan: "
        f"{bool(torch.isnan(naive).any())} on rank 0"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--size", type=int_in(1, 100_000_000), default=10, help="length of the whole vector"
    )
    parser.add_argument(
        "--scale", type=float_in(0, 1e6, low_open=True), default=1.0, help="spread of the logits"
    )
    parser.add_argument(
        "--offset",
        type=float_in(-1e6, 1e6),
        default=1000.0,
        help="added to every logit (exp(1000) overflows)",
    )
    run(main, parser.parse_args())
