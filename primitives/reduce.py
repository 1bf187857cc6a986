"""reduce: combine one tensor from every rank (sum, max...) into the tensor of one rank.

Before: rank r holds 100*r + i.  After reduce(t, dst=d, op=SUM): rank d holds the
element-wise sum over ranks.  The other ranks' tensors are NOT defined afterwards
(Gloo may leave partial sums in them, as printed below): only dst may read its result.
Use all_reduce when every rank needs the result.

    torchrun --nproc_per_node=4 primitives/reduce.py
    python primitives/reduce.py --nproc 3 --dst 1

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.reduce
"""

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    ctx.require(
        args.dst < ctx.world_size,
        f"--dst {args.dst} is not a rank of a {ctx.world_size}-rank world",
    )
    rank, dst = ctx.rank, args.dst

    for name in ["SUM", "MAX"]:
        t = 100 * rank + torch.arange(args.size, device=ctx.device)
        before = t.tolist()
        dist.reduce(t, dst=dst, op=getattr(dist.ReduceOp, name))
        if rank == dst:  # before the print, which every rank joins: a failure stops them all
            check_against_torch(name, t, ctx.world_size, args.size)
        note = "<- the result" if rank == dst else "(undefined: do not use)"
        print_in_order(f"{name}: before {before}  after {t.tolist()} {note}")
    print0(
        f"OK: reduce SUM and MAX over {ctx.world_size} ranks landed on rank {dst} "
        "and match plain torch"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_against_torch(name, t, world, n):
    """The reduction of every rank's data, rebuilt here, in plain torch."""
    full = torch.stack([100 * r + torch.arange(n, device="cpu") for r in range(world)])
    expected = full.sum(dim=0) if name == "SUM" else full.max(dim=0).values
    if not torch.equal(t.cpu(), expected):
        raise RuntimeError(
            f"reduce {name} gave {t.tolist()}, plain torch gives {expected.tolist()}"
        )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--size", type=int_in(1, 1_000_000), default=4, help="elements per rank")
    parser.add_argument(
        "--dst", type=int_in(0, 4095), default=0, help="rank that receives the result"
    )
    run(main, parser.parse_args())
