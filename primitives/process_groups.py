"""Process groups: collectives among a subset of the ranks.

- new_group(ranks): by default EVERY rank calls it, for every group, in the same order, members
  or not: a process names its groups by counting its calls (NCCL with device_id splits the
  world's communicator, a collective). With use_local_synchronization=True only the members call
  it (named by a hash of its ranks; new_group's docstring, torch 2.13; not with MPI; overlapping
  groups still in one global order). A non-member gets a placeholder: get_rank(group) is -1, and
  a collective on it does nothing (it warns). pg_options=: one backend's settings for a group.
- Two halves each sum their own data; then everyone learns both results through one MAX
  all_reduce over the world (a slot per group, -inf elsewhere). SUM would multiply each slot
  by its group size: every member adds it.
- new_subgroups(group_size): equal consecutive groups in one call; get_group_rank /
  get_global_rank translate between global and group ranks.

    torchrun --nproc_per_node=4 primitives/process_groups.py
    python primitives/process_groups.py --nproc 3

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#groups
"""

import warnings

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    rank, world, n, dev = ctx.rank, ctx.world_size, args.size, ctx.device
    halves = [list(range(world // 2)), list(range(world // 2, world))]  # 3 ranks: [0], [1, 2]
    # NCCL's options can run a group on high-priority CUDA streams; Gloo takes none (README)
    nccl = ctx.backend == dist.Backend("NCCL")  # Backend() parses any case: "NCCL" -> "nccl"
    opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True) if nccl else None
    groups = [dist.new_group(members, pg_options=opts) for members in halves]  # every rank: both
    mine = 0 if rank < world // 2 else 1
    group, members = check_backend(groups[mine], ctx), halves[mine]

    t = torch.arange(n, dtype=torch.float32, device=dev) - 100 * (rank + 1)  # sums < 0
    dist.all_reduce(t, group=group)  # within my half only
    where = [
        (dist.get_group_rank(group, g), dist.get_global_rank(group, i))
        for i, g in enumerate(members)
    ]
    check_half(t, where, members, n, mine, dist.get_rank(group))

    # Share both halves' results: a slot per group, -inf (not 0: sums < 0) elsewhere, MAX over all.
    slots = torch.full((2, n), float("-inf"), device=dev)
    slots[mine] = t
    by_max = slots.clone()
    dist.all_reduce(by_max, op=dist.ReduceOp.MAX)
    by_sum = torch.where(slots.isinf(), 0.0, slots)  # 0 instead of -inf, for SUM
    dist.all_reduce(by_sum, op=dist.ReduceOp.SUM)
    check_shared(by_max, by_sum, halves, n)

    # A rank outside a group: get_rank is -1 and a collective on the group is a no-op.
    other = groups[1 - mine]
    probe = torch.tensor([rank + 1.0], device=dev)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns "does not belong to the given group"
        dist.all_reduce(probe, group=other)
    check_non_member(dist.get_rank(other), probe, rank, 1 - mine)

    # new_subgroups: equal consecutive groups in one call (the world size must divide).
    k = args.subgroup_size
    if world % k == 0:
        sub, _ = dist.new_subgroups(group_size=k)
        s = torch.tensor([rank + 1.0], device=dev)
        dist.all_reduce(s, group=sub)
        check_subgroup(s, rank, k)
    else:
        print0(f"new_subgroups({k}): skipped, world size {world} is not a multiple of it")
    print0(
        f"OK: sums within the halves {halves} match plain torch; MAX shared them with all {world} "
        "ranks (SUM: times the group size); group/global rank maps and non-members checked"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def sum_of(members, n):
    """Negative sums (element 0 always): were the empty slots 0 instead of MAX's identity -inf, MAX
    would return 0 for them, which data >= 0 could not tell from the right answer."""
    return sum(torch.arange(n, dtype=torch.float32, device="cpu") - 100 * (r + 1) for r in members)


def check_backend(group, ctx):
    """The group runs the world's backend; on NCCL it took the options (.options of the backend
    object, ProcessGroupNCCL's binding in torch 2.13's _distributed_c10d.pyi)."""
    backend = dist.get_backend(group)
    high = ctx.backend != "nccl" or group._get_backend(ctx.device).options.is_high_priority_stream
    if backend != ctx.backend or backend not in dist.Backend.backend_list or not high:
        raise RuntimeError(
            f"group backend {backend!r} (world: {ctx.backend}), high priority {high}"
        )
    return group


def check_half(t, where, members, n, mine, group_rank):
    """The sum over my half's data, by hand; group rank i is global rank members[i] both ways."""
    if not torch.equal(t.cpu(), sum_of(members, n)):
        raise RuntimeError(f"sum over {members} gave {t.tolist()}, expected {sum_of(members, n)}")
    if where != list(enumerate(members)):
        raise RuntimeError(f"(group rank, global rank) maps gave {where} for members {members}")
    print_in_order(
        f"in half {mine} {members} as group rank {group_rank}: sum {t.tolist()}; "
        f"(group rank, global rank) of the members {where}"
    )


def check_shared(by_max, by_sum, halves, n):
    """Both halves' sums on every rank: exact by MAX, times the group size by SUM."""
    truth = torch.stack([sum_of(m, n) for m in halves])
    sizes = torch.tensor([[len(m)] for m in halves], dtype=torch.float32, device="cpu")
    if not torch.equal(by_max.cpu(), truth) or not torch.equal(by_sum.cpu(), truth * sizes):
        raise RuntimeError(
            f"sharing by MAX gave {by_max.tolist()}, by SUM {by_sum.tolist()}; "
            f"the halves' sums are {truth.tolist()}"
        )
    print0(
        f"both halves' sums via MAX: {by_max.tolist()} (right); via SUM: {by_sum.tolist()} "
        f"(each slot x its group size {sizes.flatten().int().tolist()})"
    )


def check_non_member(group_rank, probe, rank, other):
    if group_rank != -1 or probe.item() != rank + 1.0:
        raise RuntimeError("a non-member should see group rank -1 and an unchanged tensor")
    print_in_order(
        f"outside half {other}: get_rank(group) = {group_rank}; "
        f"all_reduce there left my {rank + 1.0} as {probe.item()}"
    )


def check_subgroup(s, rank, k):
    """Each rank gave its rank + 1 (rank 0's 0 would let MAX pass for SUM)."""
    first = rank - rank % k
    if s.item() != sum(range(first + 1, first + k + 1)):
        raise RuntimeError(
            f"subgroup sum {s.item()} is not the sum of ranks + 1 over {first}..{first + k - 1}"
        )
    print_in_order(f"new_subgroups({k}): my subgroup sums ranks + 1 to {s.item():g}")


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument("--size", type=int_in(1, 1_000_000), default=2, help="elements per rank")
    parser.add_argument(
        "--subgroup-size", type=int_in(1, 4096), default=2, help="ranks per group for new_subgroups"
    )
    run(main, parser.parse_args())
