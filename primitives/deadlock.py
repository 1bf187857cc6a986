"""A deadlock with send/recv, shown under a short timeout, and three ways to avoid it.

Every rank sends to its right neighbour, then receives from its left. A blocking Gloo send
returns only once the peer has posted the matching recv, even for one element, so every rank
waits in send and none reaches its recv. Run on a side group with a timeout of a few seconds, it
ends in an error, not a hang. Then the fixes: rank-parity order, isend/irecv in that order,
batch_isend_irecv (the one to copy on GPUs: see each fix).

    torchrun --nproc_per_node=2 primitives/deadlock.py
    python primitives/deadlock.py --nproc 3 --demo-timeout 5

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#point-to-point-communication
      https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/p2p.html
"""

import datetime
import time

import torch
import torch.distributed as dist
from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run


def send_first_on_every_rank(rank, right, left, n, timeout_s):
    # A side group (new_group, process_groups.py) with a short timeout: this cannot hang.
    side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        dist.send(torch.full((n,), float(rank), device="cpu"), dst=right, group=side)
        dist.recv(torch.empty(n, device="cpu"), src=left, group=side)
        return "send and recv completed (the message was buffered: no deadlock)", False
    except RuntimeError as error:
        return f"send to rank {right} timed out: {timeout_line(error)}", True
    finally:
        dist.destroy_process_group(side)  # a group that timed out is unusable: throw it away


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    # Gloo's send and recv take CPU tensors only (docs: distributed.html#backends)
    ctx.require(
        ctx.backend != "gloo" or ctx.device.type == "cpu",
        "point-to-point on gloo needs CPU tensors: use --backend nccl or --device cpu",
    )
    rank, world = ctx.rank, ctx.world_size
    right, left = (rank + 1) % world, (rank - 1) % world

    start = time.perf_counter()
    outcome, stuck = send_first_on_every_rank(rank, right, left, args.demo_size, args.demo_timeout)
    stuck = explain(outcome, stuck, time.perf_counter() - start, args, ctx)

    mine = 100 * rank + torch.arange(args.size, dtype=torch.float32, device=ctx.device)
    got = [torch.empty(args.size, device=ctx.device) for _ in range(3)]
    # Fix 1: break the cycle by order. Even ranks send first, odd ranks receive first.
    if rank % 2 == 0:
        dist.send(mine, dst=right)
        dist.recv(got[0], src=left)
    else:
        dist.recv(got[0], src=left)
        dist.send(mine, dst=right)

    # Fix 2: isend/irecv, still in Fix 1's order: with device_id (run() passes it) NCCL runs
    #        unbatched sends and recvs in turn on one communicator (PR #132900, torch 2.5; #156748).
    if rank % 2 == 0:
        works = [dist.isend(mine, dst=right), dist.irecv(got[1], src=left)]
    else:
        works = [dist.irecv(got[1], src=left), dist.isend(mine, dst=right)]
    for work in works:
        work.wait()

    # Fix 3: one batch (ncclGroupStart/End), as NCCL's guide asks for sends and recvs that must
    #        progress together (Docs above). No order to get right.
    ops = [dist.P2POp(dist.isend, mine, right), dist.P2POp(dist.irecv, got[2], left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()

    check_fixes(got, mine, rank, left, args.size)
    print0(
        f"OK: send-first deadlocked {stuck} of {world} ranks ({args.demo_timeout:g}s timeout); "
        "parity order, isend/irecv and batch_isend_irecv each delivered the left neighbour's data"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def timeout_line(error):
    """The line of Gloo's error that says it timed out, without its source location."""
    lines = str(error).splitlines()
    return next((x for x in lines if "Timed out" in x), lines[0]).split("] ")[-1]


def explain(outcome, stuck, waited, args, ctx):
    """Say what happened on each rank, count the ranks that were stuck (on the healthy default
    group) and explain."""
    print_in_order(
        f"send({args.demo_size} elements) first, then recv: after {waited:.1f}s, {outcome}"
    )
    count = torch.tensor([int(stuck)], device=ctx.device)
    dist.all_reduce(count)
    count = int(count.item())
    if count:
        print0(
            "What happened: every rank sat in send waiting for its right neighbour to post a "
            "recv, and that neighbour sat in its own send: a cycle of waits. Only the "
            f"{args.demo_timeout:g}s timeout of the side group ended it. (NCCL queues a send on "
            "the GPU and returns: there the hang shows at the next synchronize, until the "
            "watchdog's timeout.)"
        )
    else:
        print0(
            "No rank was stuck: the sends were buffered. Do not rely on it: a larger message "
            "(--demo-size) or another backend can block, and then the same code deadlocks."
        )
    return count


def check_fixes(got, mine, rank, left, n):
    """Each fix must have delivered what the left neighbour holds."""
    expected = 100 * left + torch.arange(n, dtype=torch.float32, device="cpu")
    names = ["parity order", "isend/irecv", "batch_isend_irecv"]
    for name, received in zip(names, got):
        if not torch.equal(received.cpu(), expected):
            raise RuntimeError(
                f"{name}: got {received.tolist()} from rank {left}, expected {expected.tolist()}"
            )
    print_in_order(
        f"holds {mine.tolist()}, received from rank {left}: parity {got[0].tolist()}, "
        f"isend/irecv {got[1].tolist()}, batch {got[2].tolist()}"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument(
        "--size", type=int_in(1, 1_000_000), default=4, help="elements per message in the fixes"
    )
    parser.add_argument(
        "--demo-size",
        type=int_in(1, 100_000_000),
        default=1,
        help="elements per message in the deadlock",
    )
    parser.add_argument(
        "--demo-timeout",
        type=float_in(0, 600, low_open=True),
        default=2.0,
        help="seconds before the deadlock errors",
    )
    run(main, parser.parse_args())
