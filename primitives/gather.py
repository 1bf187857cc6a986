"""gather: every rank's tensor collected, in rank order, into a list on one rank.

Before: rank r holds 100*r + i.  After gather(t, gather_list, dst=d): on rank d,
gather_list[r] holds rank r's tensor. Only dst passes a list (of pre-allocated tensors,
one per rank, all of the same shape); the other ranks pass None.

    torchrun --nproc_per_node=4 primitives/gather.py
    python primitives/gather.py --nproc 3 --dst 2

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.gather
"""

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    ctx.require(
        args.dst < ctx.world_size,
        f"--dst {args.dst} is not a rank of a {ctx.world_size}-rank world",
    )
    rank, world, dst = ctx.rank, ctx.world_size, args.dst

    t = 100 * rank + torch.arange(args.size, device=ctx.device)
    print_in_order(f"before: {t.tolist()}")
    gather_list = [torch.empty_like(t) for _ in range(world)] if rank == dst else None
    dist.gather(t, gather_list, dst=dst)
    if rank == dst:  # before the print, which every rank joins: a failure here stops them all
        check_rank_order(gather_list, world, args.size)
    print_in_order(
        f"after gather to rank {dst}: "
        + (str([g.tolist() for g in gather_list]) if rank == dst else "nothing (not dst)")
    )
    print0(f"OK: gather collected the tensors of {world} ranks, in rank order, on rank {dst}")


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_rank_order(gather_list, world, n):
    """Every rank's starting tensor, rebuilt here: entry r must be rank r's."""
    expected = torch.stack([100 * r + torch.arange(n, device="cpu") for r in range(world)])
    got = torch.stack(gather_list).cpu()
    if not torch.equal(got, expected):
        raise RuntimeError(f"gathered {got.tolist()}, expected {expected.tolist()}")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--size", type=int_in(1, 1_000_000), default=3, help="elements per rank")
    parser.add_argument(
        "--dst", type=int_in(0, 4095), default=0, help="rank that receives the list"
    )
    run(main, parser.parse_args())
