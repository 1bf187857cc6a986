"""Non-blocking isend/irecv: post the transfer, compute meanwhile, wait before touching buffers.

isend/irecv return at once with a Work handle. `work.is_completed()` asks without
blocking; `work.wait()` blocks until the transfer is done. The buffer rules:
  - do not write the send buffer before its isend's wait (the peer may get the new values),
  - do not read the recv buffer before its irecv's wait (it may still be empty or half full).
On GPUs (NCCL) wait() makes the current stream wait for the transfer; it does not block the CPU.
Measured with Gloo (torch 2.13): a send/recv Work reports is_completed() False until wait()
is called, even when the data has long arrived. So poll it as a hint, and always wait().

The order of the posts matters on NCCL. Even ranks post the isend first, odd ranks the irecv
first, so that no cycle of sends can wait on each other (deadlock.py's Fix 1 and 2). Why: with
device_id passed to init_process_group (run() does), NCCL runs every unbatched send/recv of the
group on its one communicator, one after the other (pytorch PR #132900, torch 2.5; PR #156748),
and an NCCL send may not finish before its recv is posted; NCCL's guide asks that sends and
recvs that must progress together be grouped ("Point-to-point communication",
https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/p2p.html). Had every rank
posted isend-to-the-right first, each would wait on its neighbour's isend: a ring of waits.
The other safe form is dist.batch_isend_irecv (one NCCL group), deadlock.py's Fix 3. Gloo
progresses each isend/irecv on its own and takes any order.

    torchrun --nproc_per_node=3 primitives/async_point_to_point.py
    python primitives/async_point_to_point.py --nproc 2 --size 1000000 --compute 1024

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.isend
"""

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    # Gloo's send and recv take CPU tensors only (docs: distributed.html#backends)
    ctx.require(
        ctx.backend != "gloo" or ctx.device.type == "cpu",
        "point-to-point on gloo needs CPU tensors: use --backend nccl or --device cpu",
    )
    rank, world, n = ctx.rank, ctx.world_size, args.size
    right, left = (rank + 1) % world, (rank - 1) % world

    send_buf = 100 * rank + torch.arange(n, dtype=torch.float32, device=ctx.device)
    recv_buf = torch.full((n,), -1.0, device=ctx.device)  # -1 marks "not received yet"
    sent = send_buf.clone()  # a copy we may read any time, to print

    # Post both transfers; neither call waits for the peer. Parity order: safe on NCCL too.
    if rank % 2 == 0:
        send_work = dist.isend(send_buf, dst=right)
        recv_work = dist.irecv(recv_buf, src=left)
    else:
        recv_work = dist.irecv(recv_buf, src=left)
        send_work = dist.isend(send_buf, dst=right)
    polled = [recv_work.is_completed()]  # asking never blocks

    # Useful work that needs neither buffer overlaps with the transfer.
    gen = torch.Generator().manual_seed(rank)
    a = torch.randn(args.compute, args.compute, generator=gen).to(ctx.device)
    for _ in range(args.steps):
        a = torch.tanh(a @ a / args.compute)
        polled.append(recv_work.is_completed())
        if polled[-1]:
            break

    recv_work.wait()  # from here recv_buf holds the left neighbour's data
    send_work.wait()  # from here send_buf may be reused
    send_buf.fill_(-2.0)  # safe now: the peer already has its copy

    check_received(recv_buf, recv_work, send_work, left, n)
    print_in_order(
        f"sent {short(sent)} to rank {right}; received {short(recv_buf)} from rank {left}; "
        f"irecv completed: at post {polled[0]}, after {len(polled) - 1} compute step(s) "
        f"{polled[-1]}"
    )
    say_whether_polling_saw_it(polled[-1], ctx)
    print0(
        "OK: isend/irecv delivered each left neighbour's data while computation ran; "
        "is_completed() polled without blocking, wait() made the buffers safe"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_received(recv_buf, recv_work, send_work, left, n):
    expected = 100 * left + torch.arange(n, dtype=torch.float32, device="cpu")
    if not torch.equal(recv_buf.cpu(), expected):
        raise RuntimeError(f"received {recv_buf.tolist()[:8]}, expected {expected.tolist()[:8]}")
    if not (recv_work.is_completed() and send_work.is_completed()):
        raise RuntimeError("a Work handle is not completed after wait()")


def short(t):
    return t.tolist() if t.numel() <= 8 else f"{t[:4].tolist()}..."


def say_whether_polling_saw_it(done, ctx):
    """Count the ranks whose irecv looked completed before wait(); say so if none did."""
    seen = torch.tensor([int(done)], device=ctx.device)
    dist.all_reduce(seen)
    if seen.item() == 0:
        print0(
            f"No rank saw its irecv completed before wait(): on {ctx.backend} polling is a hint."
        )


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument(
        "--size", type=int_in(1, 100_000_000), default=4, help="elements per message"
    )
    parser.add_argument(
        "--compute", type=int_in(1, 16384), default=64, help="matrix size of the overlapped work"
    )
    parser.add_argument(
        "--steps", type=int_in(1, 100_000), default=20, help="most compute steps before waiting"
    )
    run(main, parser.parse_args())
