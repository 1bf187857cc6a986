"""All-reduce written by hand from point-to-point calls: the ring and the binomial tree.

Ring: the tensor is cut into N chunks (tensor_split: they need not be equal, some may be
empty). Reduce-scatter phase: N-1 steps, each rank sends one chunk to its right neighbour
and adds the chunk from its left; afterwards rank r owns the full sum of chunk (r+1) % N.
All-gather phase: N-1 more steps pass the finished chunks round. 2(N-1) steps, and each
rank sends only 2(N-1)/N of the tensor in all: bandwidth-optimal, latency grows with N.
Tree: binomial reduce to rank 0 (ceil(log2 N) steps), then broadcast back the same way.
2 ceil(log2 N) steps, but every step moves the whole tensor: few steps, many bytes.
Both are checked bit for bit against dist.all_reduce and a plain sum of every rank's data
(integer-valued floats, so the summation order cannot change a bit), then timed.

    torchrun --nproc_per_node=4 primitives/ring_all_reduce.py
    python primitives/ring_all_reduce.py --nproc 5 --sizes 3,1001,1048577 --iters 10

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.batch_isend_irecv
"""

import math
import time

import torch
import torch.distributed as dist
from launch.dist_setup import lesson_parser, print0, run


def ring_all_reduce(tensor, rank, world):
    """Sum tensor over all ranks in place; return (steps, bytes this rank sent)."""
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = tensor.view(-1).tensor_split(world)  # views into tensor: results land in place
    steps = sent = 0

    def exchange(send_chunk, recv_buffer):
        nonlocal steps, sent
        ops = []  # an empty chunk (length < N) is skipped on both sides: they agree on sizes
        if send_chunk.numel():
            ops.append(dist.P2POp(dist.isend, send_chunk, right))
            sent += send_chunk.numel() * send_chunk.element_size()
        if recv_buffer.numel():
            ops.append(dist.P2POp(dist.irecv, recv_buffer, left))
        if ops:  # send and receive posted together: no rank waits on a send (see deadlock.py)
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        steps += 1

    for s in range(world - 1):  # reduce-scatter: partial sums travel right
        send_i, recv_i = (rank - s) % world, (rank - s - 1) % world
        incoming = torch.empty_like(chunks[recv_i])
        exchange(chunks[send_i], incoming)
        chunks[recv_i].add_(incoming)
    for s in range(world - 1):  # all-gather: rank r starts with finished chunk (r+1) % N
        send_i, recv_i = (rank + 1 - s) % world, (rank - s) % world
        exchange(chunks[send_i], chunks[recv_i])  # received straight into place
    return steps, sent


def tree_all_reduce(tensor, rank, world):
    """Binomial-tree reduce to rank 0, then broadcast down the same tree; in place.

    Blocking send/recv is safe here, on NCCL too: in each round a rank only sends or only
    receives, and its partner does the opposite, so no two sends can wait on each other."""
    steps = sent = 0
    incoming = torch.empty_like(tensor)
    mask = 1
    while mask < world:  # reduce: at distance mask, odd multiples send down to even ones
        if rank % (2 * mask) == mask:
            dist.send(tensor, dst=rank - mask)
            sent += tensor.numel() * tensor.element_size()
        elif rank % (2 * mask) == 0 and rank + mask < world:
            dist.recv(incoming, src=rank + mask)
            tensor.add_(incoming)
        mask *= 2
        steps += 1  # one round of the algorithm (a rank may sit a round out)
    while mask > 1:  # broadcast: the same edges, in the reverse order
        mask //= 2
        if rank % (2 * mask) == 0 and rank + mask < world:
            dist.send(tensor, dst=rank + mask)
            sent += tensor.numel() * tensor.element_size()
        elif rank % (2 * mask) == mask:
            dist.recv(tensor, src=rank - mask)
        steps += 1
    return steps, sent


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    ctx.require(
        sizes_ok(args.sizes), "--sizes must be positive integers separated by commas, e.g. 1,1001"
    )
    ctx.require(args.iters >= 1, "--iters must be at least 1")
    ctx.require_point_to_point()
    rank, world = ctx.rank, ctx.world_size
    sizes = [int(s) for s in args.sizes.split(",")]
    # With NCCL the first batch_isend_irecv of a group must involve every rank, and a ring step on a
    # tensor shorter than N may leave a rank nothing to send: a collective first sets the group up.
    dist.barrier()

    print0(
        f"{'elements':>9} {'ring steps':>10} {'ring MB sent':>12} {'ring ms':>8}  {'tree steps':>10} "
        f"{'tree MB sent':>12} {'tree ms':>8}  {'all_reduce ms':>13}"
    )
    for n in sizes:
        mine = data_of(rank, n).to(ctx.device)
        ring, tree = mine.clone(), mine.clone()
        ring_steps, ring_sent = ring_all_reduce(
            ring, rank, world
        )  # in place: ring now holds the sum
        tree_steps, tree_sent = tree_all_reduce(tree, rank, world)
        check_matches_plain_sum_and_library("ring", ring, mine, world, rank)
        check_matches_plain_sum_and_library("tree", tree, mine, world, rank)
        most_sent = [busiest_rank_sent(sent, ctx) / 1e6 for sent in (ring_sent, tree_sent)]
        ms = [
            ms_per_call(fn, mine, args, ctx)
            for fn in (ring_all_reduce, tree_all_reduce, library_all_reduce)
        ]
        print0(
            f"{n:>9} {ring_steps:>10} {most_sent[0]:>12.3f} {ms[0]:>8.3f}  {tree_steps:>10} {most_sent[1]:>12.3f} "
            f"{ms[1]:>8.3f}  {ms[2]:>13.3f}"
        )

    print0(
        f"Ring: 2(N-1) = {2 * (world - 1)} steps, the busiest rank sends 2(N-1)/N of the tensor. Tree: "
        f"2 ceil(log2 N) = {2 * math.ceil(math.log2(world))} steps of the whole tensor. Which wins where: "
        "primitives/README.md (on one loaded CPU host the times blur both costs)."
    )
    print0(
        f"OK: ring and tree all-reduce built from send/recv equal dist.all_reduce and a plain sum bit for bit "
        f"on {world} ranks at sizes {sizes}"
    )


def data_of(r, n):
    """Rank r's data for size n, a function of (r, n) only: any rank can rebuild everyone's. Integer
    values in float32: every sum is exact, so a different summation order cannot change a bit."""
    gen = torch.Generator().manual_seed(1000 * n + r)
    return torch.randint(-1000, 1000, (n,), generator=gen, device="cpu").float()


def check_matches_plain_sum_and_library(name, summed, mine, world, rank):
    """Bit for bit against a plain sum of every rank's data (rebuilt here) and against dist.all_reduce."""
    library = mine.clone()
    dist.all_reduce(library)
    plain = sum(data_of(r, mine.numel()) for r in range(world))
    for what, other in [
        ("a plain sum of every rank's data", plain),
        ("dist.all_reduce", library.cpu()),
    ]:
        if not torch.equal(summed.cpu(), other):
            bad = (summed.cpu() != other).nonzero().flatten()[:5].tolist()
            raise RuntimeError(
                f"rank {rank}: {name} all-reduce of {mine.numel()} elements differs from {what} "
                f"at indices {bad}"
            )


def library_all_reduce(tensor, rank, world):
    dist.all_reduce(tensor)


def busiest_rank_sent(sent, ctx):
    """The most bytes any rank sent: the busiest rank sets the pace."""
    most = torch.tensor([sent], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return most.item()


def ms_per_call(all_reduce, data, args, ctx):
    """Milliseconds per call of all_reduce(tensor, rank, world), the slowest rank's, after a warm-up call."""
    work = data.clone()
    all_reduce(
        work, ctx.rank, ctx.world_size
    )  # warm-up: connections and buffers are set up on first use
    dist.barrier()
    if ctx.device.type != "cpu":
        torch.accelerator.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        work.copy_(data)
        all_reduce(work, ctx.rank, ctx.world_size)
    if ctx.device.type != "cpu":
        torch.accelerator.synchronize()
    elapsed = torch.tensor([(time.perf_counter() - start) / args.iters], device=ctx.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item() * 1e3


def sizes_ok(text):
    try:
        return all(int(s) >= 1 for s in text.split(","))
    except ValueError:
        return False


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument(
        "--sizes",
        default="1,3,1001,65537",
        help="tensor lengths, comma-separated (default includes some smaller than N)",
    )
    parser.add_argument("--iters", type=int, default=5, help="timed calls per size and algorithm")
    run(main, parser.parse_args())
