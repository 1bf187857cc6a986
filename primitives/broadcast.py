"""broadcast: one rank's tensor is copied into the same tensor on every rank.

Before: rank r holds 100*r + i.  After broadcast(t, src=s): every rank holds 100*s + i.
Every rank passes a tensor of the same shape and dtype: on src it is read, elsewhere
it is overwritten in place (nothing is allocated for you).

    torchrun --nproc_per_node=4 primitives/broadcast.py
    python primitives/broadcast.py --nproc 3 --src 2

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.broadcast
"""

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    ctx.require(
        args.src < ctx.world_size,
        f"--src {args.src} is not a rank of a {ctx.world_size}-rank world",
    )
    t = 100 * ctx.rank + torch.arange(args.size, device=ctx.device)
    print_in_order(f"before: {t.tolist()}")
    dist.broadcast(t, src=args.src)
    print_in_order(f"after broadcast from rank {args.src}: {t.tolist()}")
    check_holds_row_of_src(t, ctx.rank, ctx.world_size, args.src, args.size)
    print0(f"OK: broadcast copied rank {args.src}'s tensor to all {ctx.world_size} ranks")


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_holds_row_of_src(t, rank, world, src, n):
    """The full data (every rank's starting tensor), rebuilt here: every rank must hold row src."""
    full = torch.stack([100 * r + torch.arange(n, device="cpu") for r in range(world)])
    if not torch.equal(t.cpu(), full[src]):
        raise RuntimeError(
            f"rank {rank} holds {t.tolist()}, expected rank {src}'s {full[src].tolist()}"
        )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--size", type=int_in(1, 1_000_000), default=4, help="elements per rank")
    parser.add_argument(
        "--src", type=int_in(0, 4095), default=0, help="rank whose tensor is broadcast"
    )
    run(main, parser.parse_args())
