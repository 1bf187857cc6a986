"""all_to_all: every rank sends a different piece to every rank (a transpose across ranks).

Rank s holds one piece per destination d, valued 100*s + 10*d + i (i: 0, 1, ... along it).
After all_to_all, rank d holds, in rank order, the piece every s addressed to it. With pieces
at most 10 long (--size <= 10 and up to 4 ranks: the uneven pieces below are s + 2d + 1 long),
the digits read: the tens digit is d everywhere on rank d, the hundreds digit says where a piece
came from; larger runs carry into the next digit.
This is the exchange of expert parallelism (tokens to experts) and of Ulysses sequence
parallelism.
  - list form, all_to_all(out_list, in_list)
  - one tensor, all_to_all_single(out, inp), even splits
  - uneven: input_split_sizes[d] = how much this rank sends to d,
            output_split_sizes[s] = how much it receives from s (both must agree pairwise).
    Here rank s sends s + 2*d + 1 elements to rank d.

    torchrun --nproc_per_node=4 primitives/all_to_all.py
    python primitives/all_to_all.py --nproc 3

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_to_all
      https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_to_all_single
"""

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def piece(s, d, length, device):
    """What rank s sends to rank d: readable from its digits."""
    return 100 * s + 10 * d + torch.arange(length, device=device)


def split_size(s, d):
    """How many elements rank s sends to rank d in the uneven exchange."""
    return s + 2 * d + 1


def main(args, ctx):
    rank, world, n, dev = ctx.rank, ctx.world_size, args.size, ctx.device

    # 1. List form.
    inputs = [piece(rank, d, n, dev) for d in range(world)]
    outputs = [torch.empty(n, dtype=torch.int64, device=dev) for _ in range(world)]
    print_in_order(f"before: sends {[t.tolist() for t in inputs]}")
    dist.all_to_all(outputs, inputs)
    print_in_order(f"all_to_all (list): {[t.tolist() for t in outputs]}")
    check_received("all_to_all", torch.cat(outputs), rank, world, lambda s: n)

    # 2. One tensor, even splits: piece d is inp[d*n:(d+1)*n].
    out = torch.empty(world * n, dtype=torch.int64, device=dev)
    dist.all_to_all_single(out, torch.cat(inputs))
    print_in_order(f"all_to_all_single: {out.tolist()}")
    check_received("all_to_all_single", out, rank, world, lambda s: n)

    # 3. Uneven splits: both sides must know the sizes (exchange them first if the data decides).
    in_splits = [split_size(rank, d) for d in range(world)]
    out_splits = [split_size(s, rank) for s in range(world)]
    inp = torch.cat([piece(rank, d, split_size(rank, d), dev) for d in range(world)])
    out = torch.empty(sum(out_splits), dtype=torch.int64, device=dev)
    dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits)
    print_in_order(
        f"uneven: sends {in_splits} -> receives {out_splits}: "
        f"{[p.tolist() for p in out.cpu().split(out_splits)]}"
    )
    check_received("uneven all_to_all_single", out, rank, world, lambda s: split_size(s, rank))

    print0(
        f"OK: all_to_all (list), all_to_all_single and its uneven splits transposed the pieces "
        f"of {world} ranks as computed by hand"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_received(name, got, rank, world, length_from):
    """Built by hand: rank d must hold, in rank order, the piece each rank s addressed to d."""
    expected = torch.cat([piece(s, rank, length_from(s), "cpu") for s in range(world)])
    if not torch.equal(got.cpu(), expected):
        raise RuntimeError(f"{name} gave {got.tolist()}, expected {expected.tolist()}")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--size", type=int_in(1, 1_000_000), default=2, help="elements per piece (even forms)"
    )
    run(main, parser.parse_args())
