"""Process groups: collectives among a subset of the ranks.

- new_group(ranks): by default EVERY rank must call it, for every group, in the same order,
  even the ranks that are not members: a process names its groups by counting its new_group
  calls, so the counts must agree (and NCCL with device_id splits the world's communicator, a
  collective call). With use_local_synchronization=True a group is named by a hash of its ranks
  and only its members call new_group (its docstring and code, torch 2.13; not with MPI; groups
  that overlap must still be created in one global order, or it can deadlock). By default a
  non-member gets a placeholder: get_rank(group) is -1, and a collective on it does nothing (it warns).
- Two halves of the world each sum their own data; then everyone learns both results
  through one MAX all_reduce over the world (a slot per group, -inf elsewhere). With SUM
  instead, each slot would come out multiplied by the group size: every member adds it.
- new_subgroups(group_size): cut the world into equal consecutive groups in one call.
- get_group_rank / get_global_rank: translate between global and group ranks.

    torchrun --nproc_per_node=4 primitives/process_groups.py
    python primitives/process_groups.py --nproc 3

Docs: https://pytorch.org/docs/stable/distributed.html#groups
"""

import warnings

import torch
import torch.distributed as dist
from launch.dist_setup import lesson_parser, print0, print_in_order, run


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    rank, world, n = ctx.rank, ctx.world_size, args.size
    half = world // 2
    halves = [list(range(0, half)), list(range(half, world))]  # with 3 ranks: [0] and [1, 2]
    groups = [dist.new_group(members) for members in halves]  # every rank creates both
    mine = 0 if rank < half else 1
    group, members = groups[mine], halves[mine]

    # Sum within my half only.
    t = 100 * rank + torch.arange(n, dtype=torch.float32, device=ctx.device)
    dist.all_reduce(t, group=group)
    expected = sum(100 * r + torch.arange(n, dtype=torch.float32, device="cpu") for r in members)
    if not torch.equal(t.cpu(), expected):
        raise RuntimeError(f"sum over {members} gave {t.tolist()}, expected {expected.tolist()}")
    where = [
        (dist.get_group_rank(group, g), dist.get_global_rank(group, dist.get_group_rank(group, g)))
        for g in members
    ]
    print_in_order(
        f"in half {mine} {members} as group rank {dist.get_rank(group)}: sum {t.tolist()}; "
        f"(group rank, global rank) of the members {where}"
    )

    # Share both halves' results with everyone: one slot per group, MAX over the world.
    slots = torch.full((2, n), float("-inf"), device=ctx.device)
    slots[mine] = t
    by_max = slots.clone()
    dist.all_reduce(by_max, op=dist.ReduceOp.MAX)
    by_sum = torch.where(slots.isinf(), torch.zeros_like(slots), slots)  # 0 instead of -inf for SUM
    dist.all_reduce(by_sum, op=dist.ReduceOp.SUM)
    truth = torch.stack(
        [
            sum(100 * r + torch.arange(n, dtype=torch.float32, device="cpu") for r in m)
            for m in halves
        ]
    )
    sizes = torch.tensor([[len(m)] for m in halves], dtype=torch.float32, device="cpu")
    if not torch.equal(by_max.cpu(), truth) or not torch.equal(by_sum.cpu(), truth * sizes):
        raise RuntimeError(
            f"MAX gave {by_max.tolist()}, SUM gave {by_sum.tolist()}, truth {truth.tolist()}"
        )
    print0(
        f"both halves' sums via MAX: {by_max.tolist()} (right); via SUM: {by_sum.tolist()} "
        f"(each slot x its group size {sizes.flatten().int().tolist()})"
    )

    # A rank outside a group: get_rank is -1 and a collective on the group is a no-op.
    other = groups[1 - mine]
    probe = torch.tensor([rank + 1.0], device=ctx.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns "does not belong to the given group"
        dist.all_reduce(probe, group=other)
    print_in_order(
        f"outside half {1 - mine}: get_rank(group) = {dist.get_rank(other)}; "
        f"all_reduce there left my {rank + 1.0} as {probe.item()}"
    )
    if dist.get_rank(other) != -1 or probe.item() != rank + 1.0:
        raise RuntimeError("a non-member should see group rank -1 and an unchanged tensor")

    # new_subgroups: equal consecutive groups in one call (the world size must divide).
    if world % args.subgroup_size == 0:
        sub, _ = dist.new_subgroups(group_size=args.subgroup_size)
        s = torch.tensor([float(rank)], device=ctx.device)
        dist.all_reduce(s, group=sub)
        first = rank - rank % args.subgroup_size
        if s.item() != sum(range(first, first + args.subgroup_size)):
            raise RuntimeError(f"subgroup sum {s.item()} is wrong")
        print_in_order(
            f"new_subgroups({args.subgroup_size}): my subgroup sums ranks to {s.item():g}"
        )
    else:
        print0(
            f"new_subgroups({args.subgroup_size}): skipped, world size {world} is not a multiple of it"
        )
    print0(
        f"OK: sums within two halves {halves} match plain torch; MAX shared them with all {world} ranks "
        "(SUM multiplied each by its group size); group/global rank maps and non-members checked"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument("--size", type=int, default=2, help="elements per rank")
    parser.add_argument(
        "--subgroup-size", type=int, default=2, help="ranks per group for new_subgroups"
    )
    run(main, parser.parse_args())
