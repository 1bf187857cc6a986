"""All-reduce by hand from point-to-point calls: the ring and the binomial tree, and their costs.

Ring: N chunks (tensor_split: unequal, maybe empty), reduce-scatter in N-1 steps (send one right,
add the one from the left), all-gather in N-1 more: each rank sends 2(N-1)/N of the tensor. Tree:
binomial reduce to rank 0, broadcast back: 2 ceil(log2 N) rounds of the whole tensor. Each counts
its steps and bytes; both are checked bit for bit against dist.all_reduce, then timed.

    torchrun --nproc_per_node=4 primitives/ring_all_reduce.py
    python primitives/ring_all_reduce.py --nproc 5 --sizes 3,1001,1048577 --iters 10
run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.
Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.batch_isend_irecv
"""

import math
import time

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, run


def ring_all_reduce(tensor, rank, world):
    """Sum tensor over all ranks in place; return (steps, bytes this rank sent)."""
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = tensor.view(-1).tensor_split(world)  # views into tensor: results land in place
    steps = sent = 0

    def exchange(send_chunk, recv_buffer):  # an empty chunk is skipped on both sides
        ops = [dist.P2POp(dist.isend, send_chunk, right)] if send_chunk.numel() else []
        ops += [dist.P2POp(dist.irecv, recv_buffer, left)] if recv_buffer.numel() else []
        for work in dist.batch_isend_irecv(ops) if ops else []:  # posted together: no deadlock
            work.wait()
        return send_chunk.numel() * send_chunk.element_size()

    for s in range(world - 1):  # reduce-scatter: partial sums travel right
        send_i, recv_i = (rank - s) % world, (rank - s - 1) % world
        incoming = torch.empty_like(chunks[recv_i])
        sent, steps = sent + exchange(chunks[send_i], incoming), steps + 1
        chunks[recv_i].add_(incoming)
    for s in range(world - 1):  # all-gather: rank r starts with finished chunk (r+1) % N
        send_i, recv_i = (rank + 1 - s) % world, (rank - s) % world
        sent += exchange(chunks[send_i], chunks[recv_i])  # received straight into place
        steps += 1
    return steps, sent


def tree_all_reduce(tensor, rank, world):
    """Binomial tree: reduce to rank 0, broadcast back down; in place; returns (rounds, bytes)."""
    rounds, sent, mask, incoming = 0, 0, 1, torch.empty_like(tensor)
    # Blocking send/recv is safe, on NCCL too: in a round a rank only sends or only receives.
    while mask < world:  # reduce: at distance mask, odd multiples send down to even ones
        if rank % (2 * mask) == mask:
            dist.send(tensor, dst=rank - mask)
            sent += tensor.numel() * tensor.element_size()
        elif rank % (2 * mask) == 0 and rank + mask < world:
            dist.recv(incoming, src=rank + mask)
            tensor.add_(incoming)
        mask, rounds = mask * 2, rounds + 1  # a rank may sit a round out
    while mask > 1:  # broadcast: the same edges, in the reverse order
        mask //= 2
        if rank % (2 * mask) == 0 and rank + mask < world:
            dist.send(tensor, dst=rank + mask)
            sent += tensor.numel() * tensor.element_size()
        elif rank % (2 * mask) == mask:
            dist.recv(tensor, src=rank - mask)
        rounds += 1
    return rounds, sent


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    # Gloo's send and recv take CPU tensors only (docs: distributed.html#backends)
    ctx.require(
        ctx.backend != "gloo" or ctx.device.type == "cpu",
        "point-to-point on gloo needs CPU tensors: use --backend nccl or --device cpu",
    )
    dist.barrier()  # NCCL: a first batch_isend_irecv must involve every rank; a short one may not
    for n in args.sizes:
        mine = data_of(ctx.rank, n).to(ctx.device)
        ring, tree = mine.clone(), mine.clone()
        ring_cost = ring_all_reduce(ring, ctx.rank, ctx.world_size)  # ring now holds the sum
        tree_cost = tree_all_reduce(tree, ctx.rank, ctx.world_size)
        check_ring_and_tree(ring, tree, mine, ctx.world_size, ctx.rank)
        print_row(n, ring_cost, tree_cost, mine, args, ctx)
    print_summary(args, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


def data_of(r, n):
    """Rank r's data for size n, a function of (r, n) only: any rank can rebuild everyone's. Integer
    values in float32: every sum is exact, so a different summation order cannot change a bit."""
    gen = torch.Generator().manual_seed(1000 * n + r)
    return torch.randint(-1000, 1000, (n,), generator=gen, device="cpu").float()


def check_ring_and_tree(ring, tree, mine, world, rank):
    check_sum("ring", ring, mine, world, rank)
    check_sum("tree", tree, mine, world, rank)


def check_sum(name, summed, mine, world, rank):
    """Bit for bit against a plain sum of every rank's data (rebuilt here) and dist.all_reduce."""
    library = mine.clone()
    dist.all_reduce(library)
    plain = sum(data_of(r, mine.numel()) for r in range(world))
    for what, other in [("a plain sum of every rank's data", plain), ("dist.all_reduce", library)]:
        if not torch.equal(summed.cpu(), other.cpu()):
            bad = (summed.cpu() != other.cpu()).nonzero().flatten()[:5].tolist()
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
    """Milliseconds per call of all_reduce(tensor, rank, world), the slowest rank's, after a warm-up
    call (connections and buffers are set up on first use)."""
    work = data.clone()
    all_reduce(work, ctx.rank, ctx.world_size)
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


def print_row(n, ring_cost, tree_cost, mine, args, ctx):
    if n == args.sizes[0]:
        print_header()
    print0(row(n, ring_cost, tree_cost, mine, args, ctx))


def print_header():
    print0(
        f"{'elements':>9} {'ring steps':>10} {'ring MB sent':>12} {'ring ms':>8}  "
        f"{'tree steps':>10} {'tree MB sent':>12} {'tree ms':>8}  {'all_reduce ms':>13}"
    )


def row(n, ring_cost, tree_cost, mine, args, ctx):
    (ring_steps, ring_sent), (tree_steps, tree_sent) = ring_cost, tree_cost
    ring_mb, tree_mb = (busiest_rank_sent(sent, ctx) / 1e6 for sent in (ring_sent, tree_sent))
    ring_ms, tree_ms, lib_ms = (
        ms_per_call(fn, mine, args, ctx)
        for fn in (ring_all_reduce, tree_all_reduce, library_all_reduce)
    )
    return (
        f"{n:>9} {ring_steps:>10} {ring_mb:>12.3f} {ring_ms:>8.3f}  {tree_steps:>10} "
        f"{tree_mb:>12.3f} {tree_ms:>8.3f}  {lib_ms:>13.3f}"
    )


def print_summary(args, ctx):
    world = ctx.world_size
    print0(
        f"Ring: 2(N-1) = {2 * (world - 1)} steps, the busiest rank sends 2(N-1)/N of the tensor. "
        f"Tree: 2 ceil(log2 N) = {2 * math.ceil(math.log2(world))} steps of the whole tensor. "
        "Which wins where: primitives/README.md (on one loaded CPU host the times blur both costs)."
    )
    print0(
        "OK: ring and tree all-reduce built from send/recv equal dist.all_reduce and a plain sum "
        f"bit for bit on {world} ranks at sizes {args.sizes}"
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
        default=[1, 3, 1001, 65537],
        help="tensor lengths, comma-separated (default includes some smaller than N)",
    )
    parser.add_argument(
        "--iters", type=int_in(1, 10_000), default=5, help="timed calls per size and algorithm"
    )
    run(main, parser.parse_args())
