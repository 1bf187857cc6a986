"""scatter: one rank splits a list of tensors and hands entry r to rank r.

Before: rank s (the source) holds a list [x_0, ..., x_{N-1}] with x_r = 100*r + i
(made on s only); every rank holds an empty output tensor.  After scatter(out,
scatter_list, src=s): rank r's out holds x_r. Only src passes the list; others pass None.

    torchrun --nproc_per_node=4 primitives/scatter.py
    python primitives/scatter.py --nproc 3 --src 1

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.scatter
"""

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    ctx.require(
        args.src < ctx.world_size,
        f"--src {args.src} is not a rank of a {ctx.world_size}-rank world",
    )
    rank, world, n, src = ctx.rank, ctx.world_size, args.size, args.src

    scatter_list = None
    if rank == src:  # only the source has the data; entry r is meant for rank r
        scatter_list = [100 * r + torch.arange(n, device=ctx.device) for r in range(world)]
    out = torch.full((n,), -1, dtype=torch.int64, device=ctx.device)  # -1: nothing received yet
    print_in_order(
        f"before: out {out.tolist()}"
        + (f", scatter_list {[x.tolist() for x in scatter_list]}" if rank == src else "")
    )
    dist.scatter(out, scatter_list, src=src)
    print_in_order(f"after scatter from rank {src}: out {out.tolist()}")
    check_own_row(out, rank, world, n)
    print0(f"OK: scatter from rank {src} gave each of {world} ranks its own row of the full data")


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_own_row(out, rank, world, n):
    """The full data, split by hand: rank r must hold row r."""
    full = 100 * torch.arange(world, device="cpu")[:, None] + torch.arange(n, device="cpu")
    if not torch.equal(out.cpu(), full[rank]):
        raise RuntimeError(f"rank {rank} got {out.tolist()}, expected {full[rank].tolist()}")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--size", type=int_in(1, 1_000_000), default=3, help="elements per rank")
    parser.add_argument("--src", type=int_in(0, 4095), default=0, help="rank that holds the list")
    run(main, parser.parse_args())
