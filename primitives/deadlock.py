"""A deadlock with send/recv, shown under a short timeout, and three ways to avoid it.

Every rank sends to its right neighbour, then receives from its left (with 2 ranks:
both send first). A blocking Gloo send returns only once the peer has posted the
matching recv, even for a single element, so every rank waits in send and none reaches
its recv. We run that on a side group whose timeout is a few seconds, so it ends as an
error instead of a hang. Then the fixes: order by rank parity, isend/irecv posted in that
order, batch_isend_irecv.

On GPUs, Fix 3 is the one to copy. NCCL's guide asks that sends and recvs that must progress
together be grouped, or they may deadlock ("Point-to-point communication",
https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/p2p.html); batch_isend_irecv
is that group. And with device_id passed to init_process_group (launch/dist_setup.py does),
NCCL runs a group's unbatched sends and recvs one after another on one communicator (pytorch
PR #154132), so isend does not free you from ordering: posted send-first on every rank, the
isends wait on each other as the blocking sends did. Hence Fix 2 keeps Fix 1's parity order.

    torchrun --nproc_per_node=2 primitives/deadlock.py
    python primitives/deadlock.py --nproc 3 --demo-timeout 5

Docs: https://pytorch.org/docs/stable/distributed.html#point-to-point-communication
"""

import datetime
import time

import torch
import torch.distributed as dist
from launch.dist_setup import lesson_parser, print0, print_in_order, run


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    ctx.require(args.demo_timeout > 0, "--demo-timeout must be positive")
    ctx.require_point_to_point()
    rank, world = ctx.rank, ctx.world_size
    right, left = (rank + 1) % world, (rank - 1) % world

    # 1. The deadlock. A side group (new_group: a second process group, see process_groups.py; always
    #    Gloo, CPU tensors) with a short timeout, so that the demonstration cannot hang. Every
    #    collective below uses the default group.
    side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.demo_timeout))
    out = torch.empty(args.demo_size, device="cpu")
    start = time.perf_counter()
    try:
        dist.send(torch.full((args.demo_size,), float(rank), device="cpu"), dst=right, group=side)
        dist.recv(out, src=left, group=side)
        outcome, timed_out = "send and recv completed (the message was buffered: no deadlock)", 0
    except RuntimeError as error:
        line = next(
            (l for l in str(error).splitlines() if "Timed out" in l), str(error).splitlines()[0]
        )
        outcome, timed_out = f"send to rank {right} timed out: {line.split('] ')[-1]}", 1
    waited = time.perf_counter() - start
    dist.destroy_process_group(side)  # a group that timed out is unusable: throw it away
    print_in_order(
        f"send({args.demo_size} elements) first, then recv: after {waited:.1f}s, {outcome}"
    )
    stuck = torch.tensor([timed_out], device=ctx.device)
    dist.all_reduce(stuck)  # how many ranks were stuck, counted on the (healthy) default group
    stuck = int(stuck.item())
    if stuck:
        print0(
            f"What happened: every rank sat in send waiting for its right neighbour to post a recv, "
            f"and that neighbour sat in its own send: a cycle of waits. Only the {args.demo_timeout:g}s "
            "timeout of the side group ended it. (NCCL queues a send on the GPU and returns: there the "
            "hang shows at the next synchronize, until the watchdog's timeout.)"
        )
    else:
        print0(
            "No rank was stuck: the sends were buffered. Do not rely on it: a larger message "
            "(--demo-size) or another backend can block, and then the same code deadlocks."
        )

    n = args.size
    mine = 100 * rank + torch.arange(n, dtype=torch.float32, device=ctx.device)
    expected = 100 * left + torch.arange(
        n, dtype=torch.float32, device="cpu"
    )  # what the left neighbour holds

    def check(name, got):
        if not torch.equal(got.cpu(), expected):
            raise RuntimeError(
                f"{name}: got {got.tolist()} from rank {left}, expected {expected.tolist()}"
            )
        return got.tolist()

    # Fix 1: break the cycle by order. Even ranks send first, odd ranks receive first.
    got = torch.empty(n, device=ctx.device)
    if rank % 2 == 0:
        dist.send(mine, dst=right)
        dist.recv(got, src=left)
    else:
        dist.recv(got, src=left)
        dist.send(mine, dst=right)
    fix1 = check("parity order", got)

    # Fix 2: post both without blocking (the rank may compute meanwhile), then wait for both. isend/irecv
    #        return at once with a Work whose wait() blocks until done (async_point_to_point.py).
    #        Posted in the parity order of Fix 1: on NCCL the posts run in order (see the docstring).
    got = torch.empty(n, device=ctx.device)
    if rank % 2 == 0:
        works = [dist.isend(mine, dst=right), dist.irecv(got, src=left)]
    else:
        works = [dist.irecv(got, src=left), dist.isend(mine, dst=right)]
    for work in works:
        work.wait()
    fix2 = check("isend/irecv", got)

    # Fix 3: hand the whole exchange to the backend at once: NCCL runs it as one group
    #        (ncclGroupStart/End), in which no call waits on another. No order to get right.
    got = torch.empty(n, device=ctx.device)
    ops = [dist.P2POp(dist.isend, mine, right), dist.P2POp(dist.irecv, got, left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    fix3 = check("batch_isend_irecv", got)

    print_in_order(
        f"holds {mine.tolist()}, received from rank {left}: parity {fix1}, isend/irecv {fix2}, "
        f"batch {fix3}"
    )
    print0(
        f"OK: send-first deadlocked {stuck} of {world} ranks (ended by a {args.demo_timeout:g}s timeout); "
        "parity order, isend/irecv in parity order and batch_isend_irecv each delivered the left neighbour's data"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument("--size", type=int, default=4, help="elements per message in the fixes")
    parser.add_argument(
        "--demo-size", type=int, default=1, help="elements per message in the deadlock"
    )
    parser.add_argument(
        "--demo-timeout", type=float, default=2.0, help="seconds before the deadlock errors"
    )
    run(main, parser.parse_args())
