"""reduce_scatter: reduce across ranks, then give each rank one slice of the result.

Every rank holds N pieces; after reduce_scatter rank r holds the sum over ranks of
piece r. It is the first half of a ring all_reduce (all_gather is the second half),
and what FSDP / ZeRO use to give each rank the gradient shard it owns.
Here rank s holds piece j = 100*s + 10*j + i, so rank r's result is
sum over s of (100*s + 10*r + i).
  - list form, reduce_scatter(out, [piece_0, ..., piece_{N-1}])
  - one tensor, reduce_scatter_single(out, inp): inp is the N pieces concatenated.
    Its older name is reduce_scatter_tensor, the only one before torch 2.13; it still works,
    and torch 2.13 and 2.14.1 warn that it is deprecated (distributed_c10d.py), 2.15.0 not.

    torchrun --nproc_per_node=4 primitives/reduce_scatter.py
    python primitives/reduce_scatter.py --nproc 3

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.reduce_scatter
      https://pytorch.org/docs/stable/distributed.html#torch.distributed.reduce_scatter_tensor
"""

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    rank, world, n = ctx.rank, ctx.world_size, args.size

    i = torch.arange(n, device=ctx.device)
    pieces = [100 * rank + 10 * j + i for j in range(world)]
    print_in_order(f"before: {[p.tolist() for p in pieces]}")

    out = torch.empty(n, dtype=torch.int64, device=ctx.device)
    dist.reduce_scatter(out, pieces, op=dist.ReduceOp.SUM)
    print_in_order(f"reduce_scatter (list):  piece {rank} summed over ranks = {out.tolist()}")
    check_own_piece_summed("reduce_scatter", out, rank, world, n)

    out = torch.empty(n, dtype=torch.int64, device=ctx.device)
    dist.reduce_scatter_single(out, torch.cat(pieces), op=dist.ReduceOp.SUM)
    print_in_order(f"reduce_scatter_single:  piece {rank} summed over ranks = {out.tolist()}")
    check_own_piece_summed("reduce_scatter_single", out, rank, world, n)

    print0(
        f"OK: reduce_scatter (list) and reduce_scatter_single gave each of {world} ranks "
        "the sum over ranks of its own piece"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_own_piece_summed(name, out, rank, world, n):
    """The full data, built here: full[s, j] is piece j on rank s; rank r must hold
    full[:, r].sum(0)."""
    i = torch.arange(n, device="cpu")
    full = torch.stack(
        [torch.stack([100 * s + 10 * j + i for j in range(world)]) for s in range(world)]
    )
    expected = full[:, rank].sum(dim=0)
    if not torch.equal(out.cpu(), expected):
        raise RuntimeError(f"{name} gave {out.tolist()}, expected {expected.tolist()}")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--size", type=int_in(1, 1_000_000), default=2, help="elements per piece")
    run(main, parser.parse_args())
