"""Halo exchange on a ring: every rank swaps edge values with both neighbours in one batch.

A 1-D periodic array is split in equal chunks, one per rank. To apply a 3-point stencil
(x[i-1] + x[i] + x[i+1]) / 3 at its edges, a rank needs one value from each neighbour:
its right neighbour's first element and its left neighbour's last. Each rank sends its
last element right and its first element left, and receives both halos, in one
batch_isend_irecv. Works for any N >= 2 (with 2 ranks, left and right are the same rank:
messages between two ranks arrive in the order they were posted, so the halos do not mix).

    torchrun --nproc_per_node=3 primitives/ring_exchange.py
    python primitives/ring_exchange.py --nproc 4 --size 5

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.batch_isend_irecv
"""

import numpy as np
import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    # Gloo's send and recv take CPU tensors only (docs: distributed.html#backends)
    ctx.require(
        ctx.backend != "gloo" or ctx.device.type == "cpu",
        "point-to-point on gloo needs CPU tensors: use --backend nccl or --device cpu",
    )
    rank, world = ctx.rank, ctx.world_size
    right, left = (rank + 1) % world, (rank - 1) % world

    chunk = 100 * rank + torch.arange(args.size, dtype=torch.float32, device=ctx.device)
    from_left = torch.empty(1, device=ctx.device)  # left neighbour's last element
    from_right = torch.empty(1, device=ctx.device)  # right neighbour's first element
    ops = [
        dist.P2POp(dist.isend, chunk[-1:].contiguous(), right),
        dist.P2POp(dist.isend, chunk[:1].contiguous(), left),
        dist.P2POp(dist.irecv, from_left, left),
        dist.P2POp(dist.irecv, from_right, right),
    ]
    for work in dist.batch_isend_irecv(ops):  # all four posted together: no ordering to get wrong
        work.wait()

    padded = torch.cat([from_left, chunk, from_right])
    smoothed = (padded[:-2] + padded[1:-1] + padded[2:]) / 3
    print_in_order(
        f"chunk {chunk.tolist()}  halo from rank {left}: {from_left.item():g}, "
        f"from rank {right}: {from_right.item():g}  "
        f"stencil {[round(v, 2) for v in smoothed.tolist()]}"
    )
    check_against_numpy(smoothed, rank, world, args.size)
    print0(
        f"OK: halo exchange on a ring of {world} ranks in one batch_isend_irecv; "
        "the sharded 3-point stencil equals numpy's on the full periodic array"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_against_numpy(smoothed, rank, world, n):
    """The same stencil on the whole array, with numpy's periodic roll; this rank's slice of it."""
    full = np.concatenate([100 * r + np.arange(n, dtype=np.float32) for r in range(world)])
    expected = ((np.roll(full, 1) + full + np.roll(full, -1)) / 3)[rank * n : (rank + 1) * n]
    if not np.allclose(smoothed.cpu().numpy(), expected):
        raise RuntimeError(f"rank {rank}: stencil {smoothed.tolist()} != numpy {expected.tolist()}")


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument("--size", type=int_in(1, 1_000_000), default=3, help="elements per rank")
    run(main, parser.parse_args())
