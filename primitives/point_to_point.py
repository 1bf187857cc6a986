"""Blocking send/recv: a chain 0 -> 1 -> ... -> N-1 where each rank transforms what it got.

This is the pipeline-parallel pattern: a stage receives activations from the stage
before it, computes, and sends the result on. A receiver must allocate its buffer
first (same shape and dtype as what is sent): recv fills a tensor, it does not create one.
Then: `tag` to label messages, and `recv` with no `src` (from any source: Gloo and MPI
implement it, NCCL does not, its recvAnysource is under "Unsupported Ops" in
ProcessGroupNCCL.hpp, torch 2.13).

    torchrun --nproc_per_node=3 primitives/point_to_point.py
    python primitives/point_to_point.py --nproc 4

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#point-to-point-communication
"""

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, print_rank, run


def stage(x, rank):
    """What stage `rank` does to the activations it receives (any function would do)."""
    return 2 * x + rank


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    # Gloo's send and recv take CPU tensors only (docs: distributed.html#backends)
    ctx.require(
        ctx.backend != "gloo" or ctx.device.type == "cpu",
        "point-to-point on gloo needs CPU tensors: use --backend nccl or --device cpu",
    )
    rank, world, n, dev = ctx.rank, ctx.world_size, args.size, ctx.device

    # 1. The chain. Rank 0 makes the input; every later rank receives, transforms, sends on.
    if rank == 0:
        x = torch.arange(n, dtype=torch.float32, device=dev)
    else:
        x = torch.empty(n, dtype=torch.float32, device=dev)  # allocate before recv
        dist.recv(x, src=rank - 1)  # blocks until rank-1 has sent
    y = stage(x, rank)
    if rank < world - 1:
        dist.send(y, dst=rank + 1)  # Gloo: blocks until rank+1 has posted its recv
    print_in_order(
        f"received {x.tolist() if rank else '(made the input)'} -> "
        f"{'sends' if rank < world - 1 else 'result'} {y.tolist()}"
    )
    if rank == world - 1:
        check_chain(y, world, n)

    # 2. Tags: Gloo matches a recv to the send with the same tag, so rank 1 may take tag 2 before
    #    tag 1 (NCCL ignores tags: messages arrive in the order sent). 3. recv with no src takes
    #    messages as they come and returns the sender (Gloo and MPI have it, NCCL has not).
    if ctx.backend != "gloo":
        print0(f"tags and recv from any source: skipped on {ctx.backend} (Gloo and MPI only)")
    elif rank == 0:
        # isend returns at once: rank 0 does not block on tag 1 while rank 1 waits for tag 2
        works = [dist.isend(torch.full((n,), float(t), device=dev), dst=1, tag=t) for t in (1, 2)]
        for work in works:
            work.wait()
        senders = []
        for _ in range(world - 1):
            buf = torch.empty(1, device=dev)
            sender = dist.recv(buf)  # from any source
            senders.append((sender, buf.item()))
        check_one_message_from_each(senders, world)
    else:
        if rank == 1:
            second, first = torch.empty(n, device=dev), torch.empty(n, device=dev)
            dist.recv(second, src=0, tag=2)  # asked for tag 2 first: gets the second message
            dist.recv(first, src=0, tag=1)
            check_tags(first, second)
        dist.send(torch.tensor([100.0 * rank], device=dev), dst=0)

    dist.barrier()  # the other ranks' checks end before rank 0 says OK
    more = "tags matched; recv from any source returned each sender"
    print0(
        f"OK: send/recv chain through {world} stages matches plain torch; "
        + (more if ctx.backend == "gloo" else f"tags and any source skipped on {ctx.backend}")
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_chain(y, world, n):
    """Every stage run on one process, in plain torch."""
    expected = torch.arange(n, dtype=torch.float32, device="cpu")
    for r in range(world):
        expected = stage(expected, r)
    if not torch.equal(y.cpu(), expected):
        raise RuntimeError(f"chain gave {y.tolist()}, plain torch gives {expected.tolist()}")


def check_tags(first, second):
    if first[0].item() != 1.0 or second[0].item() != 2.0:
        raise RuntimeError(f"tags did not match messages: tag1={first[0]} tag2={second[0]}")
    print_rank(f"tag 2 received first: {second[0].item():g}, then tag 1: {first[0].item():g}")


def check_one_message_from_each(senders, world):
    """(sender, value) in the order recv returned them: each rank r sent 100 * r, once."""
    if sorted(senders) != [(r, 100.0 * r) for r in range(1, world)]:
        raise RuntimeError(f"expected one message 100 * r from each rank r > 0, got {senders}")
    order = [sender for sender, _ in senders]
    print_rank(f"recv with no src got messages from ranks in this order: {order}")


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument("--size", type=int_in(1, 1_000_000), default=4, help="elements per message")
    run(main, parser.parse_args())
