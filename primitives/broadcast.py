"""broadcast: one rank's tensor is copied into the same tensor on every rank.

Before: rank r holds 100*r + i.  After broadcast(t, src=s): every rank holds 100*s + i.
Every rank passes a tensor of the same shape and dtype: on src it is read, elsewhere
it is overwritten in place (nothing is allocated for you).

    torchrun --nproc_per_node=4 primitives/broadcast.py
    python primitives/broadcast.py --nproc 3 --src 2

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.broadcast
"""

import torch
import torch.distributed as dist
from launch.dist_setup import lesson_parser, print0, print_in_order, run


def main(args, ctx):
    ctx.require(
        0 <= args.src < ctx.world_size,
        f"--src {args.src} is not a rank of a {ctx.world_size}-rank world",
    )
    rank, n, src = ctx.rank, args.size, args.src

    t = 100 * rank + torch.arange(n, device=ctx.device)
    print_in_order(f"before: {t.tolist()}")
    dist.broadcast(t, src=src)
    print_in_order(f"after broadcast from rank {src}: {t.tolist()}")

    # Independent check: the full data (every rank's starting tensor), and the row of src.
    full = torch.stack([100 * r + torch.arange(n, device="cpu") for r in range(ctx.world_size)])
    if not torch.equal(t.cpu(), full[src]):
        raise RuntimeError(
            f"rank {rank} holds {t.tolist()}, expected rank {src}'s {full[src].tolist()}"
        )
    print0(f"OK: broadcast copied rank {src}'s tensor to all {ctx.world_size} ranks")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--size", type=int, default=4, help="elements per rank")
    parser.add_argument("--src", type=int, default=0, help="rank whose tensor is broadcast")
    run(main, parser.parse_args())
