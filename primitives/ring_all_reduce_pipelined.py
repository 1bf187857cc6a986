"""The ring all-reduce of ring_all_reduce.py, pipelined: communication hidden behind the reduction.

Each of the N segments is cut into C chunks; one (step, chunk) pair is a job. The plain ring waits
for a whole segment, adds it, and only then sends the next: the wire idles while the adds run. Here
the next jobs' sends and receives are posted (batch_isend_irecv, non-blocking) before job k is
waited on and added, in both phases. Job k+C sends what job k received (the same chunk, one step
on), so up to C jobs are in flight, each with a receive buffer of its own; C = 1 is the plain ring.
Checked bit for bit against a plain sum and dist.all_reduce (integer-valued floats), then timed
against the plain ring and dist.all_reduce, with where each rank's time went (post, wait, add).

    torchrun --nproc_per_node=4 primitives/ring_all_reduce_pipelined.py
    python primitives/ring_all_reduce_pipelined.py --nproc 4 --sizes 1048576,4194304 \\
        --chunks 1,2,4,8 --iters 10

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.
Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.batch_isend_irecv
"""

import contextlib
import time

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run
from ring_all_reduce import check_sum, data_of, library_all_reduce, ring_all_reduce


def pipelined_ring_all_reduce(tensor, rank, world, chunks):
    """Sum tensor over all ranks in place, each of its N segments cut into `chunks` pieces."""
    right, left = (rank + 1) % world, (rank - 1) % world
    pieces = [seg.tensor_split(chunks) for seg in tensor.view(-1).tensor_split(world)]  # views
    steps = [((rank - s) % world, (rank - s - 1) % world, True) for s in range(world - 1)]
    steps += [((rank + 1 - s) % world, (rank - s) % world, False) for s in range(world - 1)]
    # A job: (the piece to send, the piece it lands in, add it?): reduce-scatter, then all-gather.
    jobs = [(pieces[i][c], pieces[j][c], add) for i, j, add in steps for c in range(chunks)]
    longest = pieces[0][0].numel()  # tensor_split puts the longer pieces first
    spare = torch.empty(chunks, longest, dtype=tensor.dtype, device=tensor.device)

    def post(k):  # start job k's transfers; a reduce-scatter job receives into a spare buffer
        send, recv, add = jobs[k]
        into = spare[k % chunks, : recv.numel()] if add else recv  # all-gather: straight in place
        ops = [dist.P2POp(dist.isend, send, right)] if send.numel() else []  # every rank skips
        ops += [dist.P2POp(dist.irecv, into, left)] if into.numel() else []  # the same empties
        return into, dist.batch_isend_irecv(ops) if ops else []

    posted = []
    for k, (_, recv, add) in enumerate(jobs):
        while len(posted) < min(k + chunks, len(jobs)):  # job k+C reuses job k's spare buffer
            posted.append(post(len(posted)))  # the next jobs' transfers start before this add
        into, works = posted[k]
        for work in works:
            work.wait()  # only now is the chunk there: touch `into` before this and it may not be
        if add:
            recv.add_(into)  # the overlap: the next jobs' bytes move while this add runs


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    # Gloo's send and recv take CPU tensors only (docs: distributed.html#backends)
    ctx.require(
        ctx.backend != "gloo" or ctx.device.type == "cpu",
        "point-to-point on gloo needs CPU tensors: use --backend nccl or --device cpu",
    )
    dist.barrier()  # NCCL: a first batch_isend_irecv must involve every rank (ring_all_reduce.py)
    for n in args.sizes:
        mine = data_of(ctx.rank, n).to(ctx.device)
        for chunks in args.chunks:
            summed = mine.clone()
            pipelined_ring_all_reduce(summed, ctx.rank, ctx.world_size, chunks)
            check_sum(f"pipelined ring ({chunks} chunks)", summed, mine, ctx.world_size, ctx.rank)
    print0(
        "pipelined ring = dist.all_reduce = plain sum, bit for bit, at sizes "
        f"{args.sizes} x chunks {args.chunks}"
    )
    print_speeds_and_split(args, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


def print_speeds_and_split(args, ctx):
    print0(f"{'elements':>9}  {'way':<22} {'ms/call':>8}  {'speed vs dist.all_reduce':>24}")
    for n in args.sizes:
        print_speeds(n, data_of(ctx.rank, n).to(ctx.device), args, ctx)
    n = args.sizes[-1]
    print0(
        f"where each rank's time went at {n} elements, ms per call (post: batch_isend_irecv, "
        "wait: Work.wait, add: the reduction):"
    )
    for chunks in args.chunks:
        split = time_split(data_of(ctx.rank, n).to(ctx.device), chunks, args, ctx)
        print_in_order(f"{chunks} chunk(s): {split}")
    chunks = ", ".join(map(str, args.chunks))
    print0(
        f"OK: the pipelined ring all-reduce ({chunks} chunks per segment, "
        "the next chunks in flight while one is added) equals dist.all_reduce and a plain sum bit "
        f"for bit on {ctx.world_size} ranks at sizes {args.sizes}"
    )


def print_speeds(n, mine, args, ctx):
    """ms per call of each way and speed = dist.all_reduce's time / its time. The ways take turns,
    one call each per round, so that a burst of load from elsewhere hits them alike; the median over
    rounds, the slowest rank's."""
    ways = {"dist.all_reduce": library_all_reduce, "plain ring": ring_all_reduce}
    for chunks in args.chunks:
        ways[f"pipelined, {chunks} chunk(s)"] = lambda t, r, w, chunks=chunks: (
            pipelined_ring_all_reduce(t, r, w, chunks)
        )
    work, seconds = mine.clone(), {name: [] for name in ways}
    for i in range(args.iters + 1):  # call 0 warms up: connections and buffers are set up then
        for name, all_reduce in ways.items():
            work.copy_(mine)
            dist.barrier()  # every rank starts together: the time is the call's, not the skew's
            start = time.perf_counter()
            all_reduce(work, ctx.rank, ctx.world_size)
            if ctx.device.type != "cpu":
                torch.accelerator.synchronize()
            seconds[name] += [time.perf_counter() - start] if i else []
    ms = torch.tensor([sorted(s)[len(s) // 2] * 1e3 for s in seconds.values()], device=ctx.device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    for name, value in zip(ways, ms.tolist()):
        print0(f"{n:>9}  {name:<22} {value:>8.3f}  {ms[0].item() / value:>23.2f}x")


@contextlib.contextmanager
def timed_calls(clock):
    """Adds to clock[what] the seconds spent in the three calls the pipelined ring makes, timed from
    outside so that the taught function carries no timer: batch_isend_irecv (post), Work.wait
    (wait) and Tensor.add_ (add). Both names are looked up when called, so the wrappers are used."""
    batch_isend_irecv, add_ = dist.batch_isend_irecv, torch.Tensor.add_

    def timed(what, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock[what] += time.perf_counter() - start

        return call

    class TimedWork:
        def __init__(self, work):
            self.wait = timed("wait", work.wait)

    dist.batch_isend_irecv = lambda ops: [
        TimedWork(w) for w in timed("post", batch_isend_irecv)(ops)
    ]
    torch.Tensor.add_ = timed("add", add_)
    try:
        yield
    finally:
        dist.batch_isend_irecv, torch.Tensor.add_ = batch_isend_irecv, add_


def time_split(mine, chunks, args, ctx):
    """This rank's seconds in posting, waiting and adding, per call; `other`: the rest."""
    clock, work, total = {"post": 0.0, "wait": 0.0, "add": 0.0}, mine.clone(), 0.0
    for _ in range(args.iters):
        work.copy_(mine)
        dist.barrier()  # as in print_speeds: the ranks start each call together
        start = time.perf_counter()
        with timed_calls(clock):
            pipelined_ring_all_reduce(work, ctx.rank, ctx.world_size, chunks)
        if ctx.device.type != "cpu":  # on a GPU the calls only enqueue: GPU time shows as other
            torch.accelerator.synchronize()
        total += time.perf_counter() - start
    parts = {what: seconds / args.iters for what, seconds in clock.items()}
    parts["other"] = total / args.iters - sum(parts.values())
    return f"total {total / args.iters * 1e3:7.3f}  " + "  ".join(
        f"{what} {s * 1e3:7.3f}" for what, s in parts.items()
    )


def ints_in(low, high):
    """An argparse type: a comma-separated list of integers, each in [low, high] (1,8,32)."""
    one = int_in(low, high)

    def parse(text):
        return [one(part) for part in text.split(",")]

    parse.__name__, parse.high = f"a comma-separated list of integers in [{low}, {high}]", high
    return parse


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument(
        "--sizes",
        type=ints_in(1, 1 << 30),
        default=[3, 1001, 65537],
        help="tensor lengths, comma-separated (default includes some smaller than N x chunks)",
    )
    parser.add_argument(
        "--chunks",
        type=ints_in(1, 4096),
        default=[1, 2, 4],
        help="chunks per segment to try, comma-separated (1: the plain ring)",
    )
    parser.add_argument(
        "--iters", type=int_in(1, 10_000), default=3, help="timed calls per size and way"
    )
    run(main, parser.parse_args())
