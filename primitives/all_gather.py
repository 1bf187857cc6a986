"""all_gather: every rank's tensor collected, in rank order, on every rank.

Before: rank r holds 100*r + i.  After: every rank holds all of them, in two forms:
  - list form, all_gather(list, t): list[r] receives rank r's tensor;
  - one tensor, all_gather_single(out, t): out is the concatenation along dim 0, with
    no Python list (what FSDP uses to un-shard parameters). Its older name is
    all_gather_into_tensor (deprecated in torch 2.13, still works). NCCL also accepts a
    stacked (world, n) output; Gloo wants the flat (world * n) one, so we view it after.

    torchrun --nproc_per_node=4 primitives/all_gather.py
    python primitives/all_gather.py --nproc 3

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_gather
      https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_gather_into_tensor
"""

import torch
import torch.distributed as dist
from launch.dist_setup import lesson_parser, print0, print_in_order, run


def main(args, ctx):
    rank, world, n = ctx.rank, ctx.world_size, args.size
    all_gather_single = (
        getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    )  # pre-2.13 name
    expected = torch.stack(
        [100 * r + torch.arange(n, device="cpu") for r in range(world)]
    )  # the full data, by hand

    t = 100 * rank + torch.arange(n, device=ctx.device)
    print_in_order(f"before: {t.tolist()}")

    # List form: one pre-allocated tensor per rank.
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    print_in_order(f"all_gather list:   {[p.tolist() for p in parts]}")
    if not torch.equal(torch.stack(parts).cpu(), expected):
        raise RuntimeError(
            f"all_gather gave {[p.tolist() for p in parts]}, expected {expected.tolist()}"
        )

    # Single-tensor form: rank r's data lands in out[r*n:(r+1)*n].
    out = torch.empty(world * n, dtype=t.dtype, device=ctx.device)
    all_gather_single(out, t)
    print_in_order(f"all_gather_single: {out.tolist()}")
    if not torch.equal(out.view(world, n).cpu(), expected):
        raise RuntimeError(
            f"all_gather_single gave {out.tolist()}, expected {expected.flatten().tolist()}"
        )

    print0(
        f"OK: all_gather (list) and all_gather_single gave all {world} ranks every rank's tensor, in rank order"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--size", type=int, default=3, help="elements per rank")
    run(main, parser.parse_args())
