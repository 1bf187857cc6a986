"""The ring all-reduce of ring_all_reduce.py, pipelined: communication hidden behind the reduction.

Each of the N segments is cut further into C chunks, and one (step, chunk) pair is a job. The plain ring
waits for a whole segment, adds it, and only then sends the next: the wire sits idle while the adds run.
Here the next jobs' sends and receives are posted (batch_isend_irecv, non-blocking) before job k is
waited on and reduced, in both phases. A job sends what the job C earlier received (the same chunk, one
step before), so up to C jobs can be in flight, each with a receive buffer of its own; with C = 1
nothing can go ahead: that is the plain ring.
Checked bit for bit against a plain sum and dist.all_reduce (integer-valued floats), then timed against
the plain ring and dist.all_reduce, with where each rank's time went (posting, waiting, adding).

    torchrun --nproc_per_node=4 primitives/ring_all_reduce_pipelined.py
    python primitives/ring_all_reduce_pipelined.py --nproc 4 --sizes 1048576,4194304 --chunks 1,2,4,8 --iters 10

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.batch_isend_irecv
"""

import time

import torch
import torch.distributed as dist
from launch.dist_setup import lesson_parser, print0, print_in_order, run, test_flags
from ring_all_reduce import (
    check_matches_plain_sum_and_library,
    data_of,
    library_all_reduce,
    ring_all_reduce,
    sizes_ok,
)


def pipelined_ring_all_reduce(tensor, rank, world, chunks, spent=None, reduce_before_wait=False):
    """Sum tensor over all ranks in place, each segment in `chunks` pieces; spent: {what: seconds} to add to."""
    right, left = (rank + 1) % world, (rank - 1) % world
    pieces = [
        segment.tensor_split(chunks) for segment in tensor.view(-1).tensor_split(world)
    ]  # views
    steps = [
        ((rank - s) % world, (rank - s - 1) % world, True) for s in range(world - 1)
    ]  # reduce-scatter
    steps += [
        ((rank + 1 - s) % world, (rank - s) % world, False) for s in range(world - 1)
    ]  # all-gather
    jobs = [
        (pieces[i][c], pieces[j][c], add) for i, j, add in steps for c in range(chunks)
    ]  # (send, recv, add?)
    spare = torch.empty(
        chunks, pieces[0][0].numel(), dtype=tensor.dtype, device=tensor.device
    )  # [0][0]: longest
    clock = {"post": 0.0, "wait": 0.0, "add": 0.0}

    def post(k):
        send, recv, add = jobs[k]
        into = spare[k % chunks, : recv.numel()] if add else recv  # all-gather: straight into place
        ops = (
            [dist.P2POp(dist.isend, send, right)] if send.numel() else []
        )  # every rank skips the same
        ops += [dist.P2POp(dist.irecv, into, left)] if into.numel() else []  # empty pieces
        return into, dist.batch_isend_irecv(ops) if ops else []

    posted = []
    for k, (_, recv, add) in enumerate(jobs):
        t0 = time.perf_counter()
        while len(posted) < min(
            k + chunks, len(jobs)
        ):  # job k+C needs job k added: C in flight at most
            posted.append(
                post(len(posted))
            )  # the next jobs' transfers start now, before this one is added
        into, works = posted[k]
        t1 = time.perf_counter()
        if (
            add and reduce_before_wait
        ):  # the bug: may add a buffer that is still being received into
            recv.add_(into)
        for work in works:
            work.wait()
        t2 = time.perf_counter()
        if add and not reduce_before_wait:
            recv.add_(into)  # the overlap: the next jobs' bytes move while this add runs
        clock["post"] += t1 - t0
        clock["wait"] += t2 - t1
        clock["add"] += time.perf_counter() - t2
    if spent is not None:
        for what, seconds in clock.items():
            spent[what] = spent.get(what, 0.0) + seconds
    return len(jobs)


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    ctx.require(
        sizes_ok(args.sizes), "--sizes must be positive integers separated by commas, e.g. 1,1001"
    )
    ctx.require(
        sizes_ok(args.chunks),
        "--chunks must be positive integers separated by commas, e.g. 2,4,8 (1 is the plain ring)",
    )
    ctx.require(args.iters >= 1, "--iters must be at least 1")
    ctx.require_point_to_point()
    rank, world = ctx.rank, ctx.world_size
    sizes, chunk_counts = (
        [int(s) for s in args.sizes.split(",")],
        [int(c) for c in args.chunks.split(",")],
    )
    dist.barrier()  # NCCL: the first batch_isend_irecv must involve every rank (see ring_all_reduce.py)

    for n in sizes:
        mine = data_of(rank, n).to(ctx.device)
        for chunks in chunk_counts:
            summed = mine.clone()
            jobs = pipelined_ring_all_reduce(
                summed, rank, world, chunks, reduce_before_wait=args.reduce_before_wait
            )
            check_matches_plain_sum_and_library(
                f"pipelined ring ({chunks} chunks)", summed, mine, world, rank
            )
            assert jobs == 2 * (world - 1) * chunks, jobs
    print0(
        f"pipelined ring = dist.all_reduce = plain sum, bit for bit, at sizes {sizes} x chunks {chunk_counts}"
    )

    print0(f"{'elements':>9}  {'way':<22} {'ms/call':>8}  {'speed vs dist.all_reduce':>24}")
    for n in sizes:
        mine = data_of(rank, n).to(ctx.device)
        print_speeds(n, mine, chunk_counts, args, ctx)
    n = sizes[-1]
    print0(
        f"where each rank's time went at {n} elements, ms per call (post: batch_isend_irecv, wait: "
        "Work.wait, add: the reduction):"
    )
    for chunks in chunk_counts:
        print_in_order(
            f"{chunks} chunk(s): {time_split(data_of(rank, n).to(ctx.device), chunks, args, ctx)}"
        )
    print0(
        f"OK: the pipelined ring all-reduce ({', '.join(map(str, chunk_counts))} chunks per segment, the next "
        f"chunks in flight while one is added) equals dist.all_reduce and a plain sum bit for bit on {world} "
        f"ranks at sizes {sizes}"
    )


def print_speeds(n, mine, chunk_counts, args, ctx):
    """ms per call of each way and speed = dist.all_reduce's time / its time. The ways take turns, one call each
    per round, so that a burst of load from elsewhere hits them alike; the median over rounds, slowest rank's."""
    ways = {"dist.all_reduce": library_all_reduce, "plain ring": ring_all_reduce}
    for chunks in chunk_counts:
        ways[f"pipelined, {chunks} chunk(s)"] = lambda t, r, w, chunks=chunks: (
            pipelined_ring_all_reduce(t, r, w, chunks)
        )
    work, seconds = mine.clone(), {name: [] for name in ways}
    for i in range(
        args.iters + 1
    ):  # call 0 warms up: connections and buffers are set up on first use
        for name, all_reduce in ways.items():
            work.copy_(mine)
            dist.barrier()  # every rank starts together: the time is the call's, not the ranks' skew
            start = time.perf_counter()
            all_reduce(work, ctx.rank, ctx.world_size)
            if ctx.device.type != "cpu":
                torch.accelerator.synchronize()
            seconds[name] += [time.perf_counter() - start] if i else []
    ms = torch.tensor([sorted(s)[len(s) // 2] * 1e3 for s in seconds.values()], device=ctx.device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    for name, value in zip(ways, ms.tolist()):
        print0(f"{n:>9}  {name:<22} {value:>8.3f}  {ms[0].item() / value:>23.2f}x")


def time_split(mine, chunks, args, ctx):
    """This rank's seconds in posting, waiting and adding, per call (measured inside the function)."""
    spent, work, total = {}, mine.clone(), 0.0
    for _ in range(args.iters):
        work.copy_(mine)
        dist.barrier()  # as in print_speeds: the ranks start each call together
        start = time.perf_counter()
        pipelined_ring_all_reduce(work, ctx.rank, ctx.world_size, chunks, spent)
        if (
            ctx.device.type != "cpu"
        ):  # on a GPU the calls only enqueue: the GPU time shows as "other"
            torch.accelerator.synchronize()
        total += time.perf_counter() - start
    parts = {what: seconds / args.iters for what, seconds in spent.items()}
    parts["other"] = total / args.iters - sum(parts.values())
    return f"total {total / args.iters * 1e3:7.3f}  " + "  ".join(
        f"{what} {s * 1e3:7.3f}" for what, s in parts.items()
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument(
        "--sizes",
        default="3,1001,65537",
        help="tensor lengths, comma-separated (default includes some smaller than N x chunks)",
    )
    parser.add_argument(
        "--chunks", default="1,2,4", help="chunks per segment to try, comma-separated (1: plain)"
    )
    parser.add_argument("--iters", type=int, default=3, help="timed calls per size and way")
    test_flags(parser).add_argument(
        "--reduce-before-wait",
        action="store_true",
        help="add each received chunk before its receive has completed",
    )
    run(main, parser.parse_args())
