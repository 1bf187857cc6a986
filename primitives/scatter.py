"""scatter: one rank splits a list of tensors and hands entry r to rank r.

Before: rank s (the source) holds a list [x_0, ..., x_{N-1}] with x_r = 100*r + i
(made on s only); every rank holds an empty output tensor.  After scatter(out,
scatter_list, src=s): rank r's out holds x_r. Only src passes the list; others pass None.

    torchrun --nproc_per_node=4 primitives/scatter.py
    python primitives/scatter.py --nproc 3 --src 1

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.scatter
"""

import torch
import torch.distributed as dist
from launch.dist_setup import lesson_parser, print0, print_in_order, run


def main(args, ctx):
    ctx.require(
        0 <= args.src < ctx.world_size,
        f"--src {args.src} is not a rank of a {ctx.world_size}-rank world",
    )
    rank, world, n, src = ctx.rank, ctx.world_size, args.size, args.src

    scatter_list = None
    if rank == src:  # only the source has the data; entry r is meant for rank r
        scatter_list = [100 * r + torch.arange(n, device=ctx.device) for r in range(world)]
    out = torch.full((n,), -1, dtype=torch.int64, device=ctx.device)
    print_in_order(
        f"before: out {out.tolist()}"
        + (f", scatter_list {[x.tolist() for x in scatter_list]}" if rank == src else "")
    )
    dist.scatter(out, scatter_list, src=src)
    print_in_order(f"after scatter from rank {src}: out {out.tolist()}")

    # Independent check: the full data, split by hand; rank r must hold row r.
    full = 100 * torch.arange(world, device="cpu")[:, None] + torch.arange(n, device="cpu")[None, :]
    if not torch.equal(out.cpu(), full[rank]):
        raise RuntimeError(f"rank {rank} got {out.tolist()}, expected {full[rank].tolist()}")
    print0(f"OK: scatter from rank {src} gave each of {world} ranks its own row of the full data")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--size", type=int, default=3, help="elements per rank")
    parser.add_argument("--src", type=int, default=0, help="rank that holds the list")
    run(main, parser.parse_args())
