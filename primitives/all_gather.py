"""all_gather: every rank's tensor collected, in rank order, on every rank.

Before: rank r holds 100*r + i.  After: every rank holds all of them, in two forms:
  - list form, all_gather(list, t): list[r] receives rank r's tensor;
  - one tensor, all_gather_single(out, t): out is the concatenation along dim 0, with
    no Python list (what FSDP uses to un-shard parameters). Its older name is
    all_gather_into_tensor, the only one before torch 2.13; it still works, and torch 2.13
    and 2.14.1 warn that it is deprecated (distributed_c10d.py), 2.15.0 no longer does.
    NCCL also accepts a stacked (world, n) output; Gloo wants the flat (world * n) one.

    torchrun --nproc_per_node=4 primitives/all_gather.py
    python primitives/all_gather.py --nproc 3

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_gather
      https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_gather_into_tensor
"""

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    world, n = ctx.world_size, args.size

    t = 100 * ctx.rank + torch.arange(n, device=ctx.device)
    print_in_order(f"before: {t.tolist()}")

    # List form: one pre-allocated tensor per rank.
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    print_in_order(f"all_gather list:   {[p.tolist() for p in parts]}")
    check_rank_order("all_gather", torch.stack(parts), world, n)

    # Single-tensor form: rank r's data lands in out[r*n:(r+1)*n].
    out = torch.empty(world * n, dtype=t.dtype, device=ctx.device)
    dist.all_gather_single(out, t)
    print_in_order(f"all_gather_single: {out.tolist()}")
    check_rank_order("all_gather_single", out.view(world, n), world, n)

    print0(
        f"OK: all_gather (list) and all_gather_single gave all {world} ranks every rank's "
        "tensor, in rank order"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_rank_order(name, got, world, n):
    """Every rank's starting tensor, rebuilt here: row r must be rank r's."""
    expected = torch.stack([100 * r + torch.arange(n, device="cpu") for r in range(world)])
    if not torch.equal(got.cpu(), expected):
        raise RuntimeError(f"{name} gave {got.tolist()}, expected {expected.tolist()}")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--size", type=int_in(1, 1_000_000), default=3, help="elements per rank")
    run(main, parser.parse_args())
