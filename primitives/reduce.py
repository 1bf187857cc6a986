"""reduce: combine one tensor from every rank (sum, max...) into the tensor of one rank.

Before: rank r holds 100*r + i.  After reduce(t, dst=d, op=SUM): rank d holds the
element-wise sum over ranks.  The other ranks' tensors are NOT defined afterwards
(Gloo may leave partial sums in them, as printed below): only dst may read its result.
Use all_reduce when every rank needs the result.

    torchrun --nproc_per_node=4 primitives/reduce.py
    python primitives/reduce.py --nproc 3 --dst 1

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.reduce
"""

import torch
import torch.distributed as dist
from launch.dist_setup import lesson_parser, print0, print_in_order, run


def main(args, ctx):
    ctx.require(
        0 <= args.dst < ctx.world_size,
        f"--dst {args.dst} is not a rank of a {ctx.world_size}-rank world",
    )
    rank, world, n, dst = ctx.rank, ctx.world_size, args.size, args.dst
    full = torch.stack(
        [100 * r + torch.arange(n, device="cpu") for r in range(world)]
    )  # every rank's data, for checks

    for name, expected in [("SUM", full.sum(dim=0)), ("MAX", full.max(dim=0).values)]:
        t = 100 * rank + torch.arange(n, device=ctx.device)
        before = t.tolist()
        dist.reduce(t, dst=dst, op=getattr(dist.ReduceOp, name))
        note = "<- the result" if rank == dst else "(undefined: do not use)"
        print_in_order(f"{name}: before {before}  after {t.tolist()} {note}")
        if rank == dst and not torch.equal(t.cpu(), expected):
            raise RuntimeError(
                f"reduce {name} gave {t.tolist()}, plain torch gives {expected.tolist()}"
            )
    print0(f"OK: reduce SUM and MAX over {world} ranks landed on rank {dst} and match plain torch")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--size", type=int, default=4, help="elements per rank")
    parser.add_argument("--dst", type=int, default=0, help="rank that receives the result")
    run(main, parser.parse_args())
