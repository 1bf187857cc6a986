"""Blocking send/recv: a chain 0 -> 1 -> ... -> N-1 where each rank transforms what it got.

This is the pipeline-parallel pattern: a stage receives activations from the stage
before it, computes, and sends the result on. A receiver must allocate its buffer
first (same shape and dtype as what is sent): recv fills a tensor, it does not create one.
Then: `tag` to label messages, and `recv` with no `src` (from any source: Gloo and MPI implement it,
NCCL does not, its recvAnysource is under "Unsupported Ops" in ProcessGroupNCCL.hpp, torch 2.13).

    torchrun --nproc_per_node=3 primitives/point_to_point.py
    python primitives/point_to_point.py --nproc 4

Docs: https://pytorch.org/docs/stable/distributed.html#point-to-point-communication
"""

import torch
import torch.distributed as dist
from launch.dist_setup import lesson_parser, print0, print_in_order, run


def stage(x, rank):
    """What stage `rank` does to the activations it receives (any function would do)."""
    return 2 * x + rank


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    ctx.require_point_to_point()
    rank, world, n = ctx.rank, ctx.world_size, args.size

    # 1. The chain. Rank 0 makes the input; every later rank receives, transforms, sends on.
    x = None
    if rank == 0:
        x = 100 * rank + torch.arange(n, dtype=torch.float32, device=ctx.device)
        got = "(made the input)"
    else:
        x = torch.empty(n, dtype=torch.float32, device=ctx.device)  # allocate before recv
        dist.recv(x, src=rank - 1)  # blocks until rank-1 has sent
        got = x.tolist()
    y = stage(x, rank)
    if rank < world - 1:
        dist.send(y, dst=rank + 1)  # Gloo: blocks until rank+1 has posted its recv
    print_in_order(f"received {got} -> {'sends' if rank < world - 1 else 'result'} {y.tolist()}")

    # Independent check on the last rank: run every stage on one process, in plain torch.
    if rank == world - 1:
        expected = torch.arange(n, dtype=torch.float32, device="cpu")
        for r in range(world):
            expected = stage(expected, r)
        if not torch.equal(y.cpu(), expected):
            raise RuntimeError(f"chain gave {y.tolist()}, plain torch gives {expected.tolist()}")

    # 2. Tags label messages between the same two ranks. Gloo matches a recv to the send
    #    with the same tag, so rank 1 may receive tag 2 before tag 1. NCCL ignores tags:
    #    there, messages between two ranks arrive in the order they were sent. (Gloo here means
    #    CPU tensors: require_point_to_point refused Gloo with CUDA tensors above.)
    if ctx.backend == "gloo":
        if rank == 0:
            # isend: a send that returns at once with a Work to wait() on (async_point_to_point.py); here
            # so that rank 0 does not block on the first message while rank 1 asks for the second.
            works = [
                dist.isend(torch.full((n,), 1.0, device=ctx.device), dst=1, tag=1),
                dist.isend(torch.full((n,), 2.0, device=ctx.device), dst=1, tag=2),
            ]
            for w in works:
                w.wait()
        elif rank == 1:
            second, first = torch.empty(n, device=ctx.device), torch.empty(n, device=ctx.device)
            dist.recv(second, src=0, tag=2)  # asked for tag 2 first: gets the second message
            dist.recv(first, src=0, tag=1)
            if first[0].item() != 1.0 or second[0].item() != 2.0:
                raise RuntimeError(f"tags did not match messages: tag1={first[0]} tag2={second[0]}")
            print(
                f"[rank 1] tag 2 received first: {second[0].item():g}, then tag 1: {first[0].item():g}",
                flush=True,
            )
    else:
        print0(
            f"tags: skipped on {ctx.backend} (it ignores tags; order of sends is the order of recvs)"
        )

    # 3. recv with no src: take messages in whatever order they come; recv returns the sender.
    if (
        ctx.backend == "gloo"
    ):  # and MPI (not a backend the lessons run); NCCL has no recv from any source
        if rank == 0:
            senders = []
            for _ in range(world - 1):
                buf = torch.empty(1, device=ctx.device)
                sender = dist.recv(buf)  # any source
                if buf.item() != 100 * sender:
                    raise RuntimeError(f"message {buf.item()} does not come from rank {sender}")
                senders.append(sender)
            if sorted(senders) != list(range(1, world)):
                raise RuntimeError(
                    f"expected one message from each other rank, got senders {senders}"
                )
            print(
                f"[rank 0] recv with no src got messages from ranks in this order: {senders}",
                flush=True,
            )
        else:
            dist.send(torch.tensor([100.0 * rank], device=ctx.device), dst=0)
    else:
        print0(
            f"recv from any source: skipped on {ctx.backend} (Gloo and MPI have it, NCCL does not)"
        )

    dist.barrier()
    print0(
        f"OK: send/recv chain through {world} stages matches plain torch; tags matched; "
        "recv from any source returned each sender"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument("--size", type=int, default=4, help="elements per message")
    run(main, parser.parse_args())
