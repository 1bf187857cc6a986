"""Asynchronous collectives: async_op=True, Work.wait(), get_future().then(...),
get_future_result(), overlap.

Every collective takes async_op=True and then returns a Work handle at once instead of
blocking. Work.wait() blocks until the result is in the tensor (on NCCL: makes the
current stream wait). Work.get_future() gives a torch.futures.Future of the output
tensors; .then(fn) chains a callback that runs when the collective finishes (DDP's
gradient hooks are built on this). Work.get_future_result() gives a Future of a status
code instead (0 SUCCESS, 1 TIMEOUT, 2 COMM_ERROR): NCCL only; Gloo raises, as shown.
Overlap: start the all_reduce, compute something that does not touch its tensor, then
wait. We time both orders; the saving depends on cores, message size and the backend.

    torchrun --nproc_per_node=2 primitives/async_collectives.py
    python primitives/async_collectives.py --nproc 2 --size 50000000 --compute 2048   # on GPUs

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#synchronous-and-asynchronous-collective-operations
      https://pytorch.org/docs/stable/futures.html
"""

import time

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device

    # 1. async_op=True, wait(), and a callback chained on the future.
    t = 100 * rank + torch.arange(args.size, dtype=torch.float32, device=dev)
    work = dist.all_reduce(t, async_op=True)  # returns at once
    mean_future = work.get_future().then(lambda fut: fut.value()[0] / world)  # runs when done
    work.wait()  # t now holds the sum on this rank
    mean = mean_future.wait()
    try:  # a Future of a status code (0 = SUCCESS), not of the tensors; only NCCL implements it
        status = work.get_future_result().wait()
    except RuntimeError as error:  # Gloo keeps the base Work's method, which raises
        status = error
    check_sum_and_mean(t, mean, rank, world, args.size)
    print_in_order(
        f"async all_reduce sum[:3] = {t[:3].tolist()}, callback's mean[:3] = {mean[:3].tolist()}"
    )
    print0(check_status(status, ctx))

    # 2. Overlap. The same communication and computation, one after the other, then together.
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.compute, args.compute, generator=gen).to(dev)

    def compute():
        y = x
        for _ in range(args.steps):
            y = torch.tanh(y @ x / args.compute)
        return y

    def sequential():
        t = torch.ones(args.size, device=dev)
        dist.all_reduce(t)
        return t, compute()

    def overlapped():
        t = torch.ones(args.size, device=dev)
        work = dist.all_reduce(t, async_op=True)
        y = compute()  # does not touch t, so it may run while t is being reduced
        work.wait()
        return t, y

    times = {fn.__name__: best_time(fn, compute, args, ctx) for fn in (sequential, overlapped)}
    print_saving(times, args)
    print0(
        "OK: async all_reduce + wait() and a .then() callback match plain torch; "
        f"overlap of communication and computation measured (best of {args.repeat}, "
        "same results either way)"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_sum_and_mean(t, mean, rank, world, n):
    full_sum = sum(100 * r for r in range(world)) + world * torch.arange(
        n, dtype=torch.float32, device="cpu"
    )
    if not torch.equal(t.cpu(), full_sum) or not torch.allclose(mean.cpu(), full_sum / world):
        raise RuntimeError(
            f"rank {rank}: sum {t[:4].tolist()} / mean {mean[:4].tolist()} do not match plain torch"
        )


def check_status(status, ctx):
    """What Work.get_future_result() gave, torch 2.13. Its docstring (Work binding,
    c10d/init.cpp): "a torch.futures.Future object of int type which maps to the enum type of
    WorkResult" and "supports NCCL". WorkResult (c10d/Work.hpp): SUCCESS 0, TIMEOUT 1,
    COMM_ERROR 2, UNKNOWN 100; ProcessGroupNCCL's watchdog completes the Future (SUCCESS once the
    GPU has run the collective, else TIMEOUT or COMM_ERROR; c10d/ProcessGroupNCCL.cpp).
    Work::getFutureResult (Work.cpp) raises "not implemented"."""
    if isinstance(status, Exception):
        return (
            f"get_future_result(): not supported on {ctx.backend} ({status}); "
            "NCCL gives a status code"
        )
    # WorkResult is not re-exported under torch.distributed
    name = torch._C._distributed_c10d.WorkResult(status).name
    if status != 0:
        raise RuntimeError(
            f"get_future_result() says {status} ({name}) for an all_reduce that finished"
        )
    return f"get_future_result() on {ctx.backend}: {status} ({name})"


def best_time(fn, compute, args, ctx):
    """Best of args.repeat timed calls of fn, after a warm-up (first calls pay for allocations
    and connection set-up); checks what fn returned: the all_reduce of ones, and compute()."""
    sync = torch.accelerator.synchronize if ctx.device.type != "cpu" else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(args.repeat):
        dist.barrier()
        sync()
        start = time.perf_counter()
        t, y = fn()
        sync()
        best = min(best, time.perf_counter() - start)
    name = fn.__name__
    if not torch.equal(t.cpu(), torch.full((args.size,), float(ctx.world_size), device="cpu")):
        raise RuntimeError(
            f"{name}: all_reduce of ones gave {t[:4].tolist()}, expected {ctx.world_size}"
        )
    if not torch.allclose(y, compute()):
        raise RuntimeError(f"{name}: the computation changed its result")
    return best


def print_saving(times, args):
    saved = times["sequential"] - times["overlapped"]
    print_in_order(
        f"all_reduce of {args.size} floats + {args.steps} matmuls {args.compute}x{args.compute}: "
        f"sequential {1e3 * times['sequential']:.1f} ms, "
        f"overlapped {1e3 * times['overlapped']:.1f} ms, "
        f"saved {1e3 * saved:.1f} ms ({100 * saved / times['sequential']:.0f}%)"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--size", type=int_in(1, 1_000_000_000), default=1 << 18, help="floats all-reduced"
    )
    parser.add_argument(
        "--compute", type=int_in(1, 16384), default=128, help="matrix size of the overlapped work"
    )
    parser.add_argument(
        "--steps", type=int_in(1, 100_000), default=8, help="matmuls in the overlapped work"
    )
    parser.add_argument(
        "--repeat", type=int_in(1, 1000), default=3, help="timed runs; the best is printed"
    )
    run(main, parser.parse_args())
