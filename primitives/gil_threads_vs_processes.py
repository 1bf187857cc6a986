"""Why DDP runs one process per device: the GIL lets only one thread run Python at a time.

The same pure-Python work (a loop the interpreter executes, like the Python parts of a
training step: the module calls, hooks, optimizer loop, data handling) is done three ways:
  serial     rank 0 does N units one after the other,
  threads    rank 0 starts N threads, one unit each (torch.nn.DataParallel's model: one
             process drives every GPU from its threads),
  processes  the N ranks of this job do one unit each, at the same time (DDP's model).
Threads take about as long as serial: they share one interpreter lock. Processes take
about as long as one unit, as long as there is a free core for each (see "cores" below).
Each unit's result is checked against a closed formula. Kernels (a big matmul) release
the GIL, so threads help there; the Python around the kernels is what does not scale.

    torchrun --nproc_per_node=2 primitives/gil_threads_vs_processes.py
    python primitives/gil_threads_vs_processes.py --nproc 4 --work 3000000

Docs: https://pytorch.org/docs/stable/notes/cuda.html#use-nn-parallel-distributeddataparallel-instead-of-multiprocessing-or-nn-dataparallel
"""

import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from launch.dist_setup import lesson_parser, print_in_order, run


def python_work(n):
    """Pure-Python arithmetic: holds the GIL the whole time."""
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def expected(n):  # the same sum by a formula: i*i % 7 repeats with period 7
    cycle = [i * i % 7 for i in range(7)]
    return sum(cycle) * (n // 7) + sum(cycle[: n % 7])


def main(args, ctx):
    ctx.require(
        ctx.world_size >= 2,
        "needs at least 2 ranks (the processes to compare): run with --nproc_per_node=2 or more",
    )
    ctx.require(args.work >= 1, "--work must be at least 1")
    rank, n, work = ctx.rank, ctx.world_size, args.work
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

    def check(result):
        if result != expected(work):
            raise RuntimeError(
                f"rank {rank}: a unit of work returned {result}, expected {expected(work)}"
            )

    # 1 and 2: on rank 0 alone; the other ranks wait at the barrier (blocked, not using a core).
    serial = threads_time = 0.0
    if rank == 0:
        start = time.perf_counter()
        for _ in range(n):
            check(python_work(work))
        serial = time.perf_counter() - start

        results = [None] * n

        def unit(i):
            results[i] = python_work(work)

        pool = [threading.Thread(target=unit, args=(i,)) for i in range(n)]
        start = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        threads_time = time.perf_counter() - start
        for result in results:
            check(result)
    dist.barrier()

    # 3: every rank, one unit each, at the same time; the job is done when the slowest is.
    start = time.perf_counter()
    check(python_work(work))
    mine = time.perf_counter() - start
    slowest = torch.tensor([mine], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    processes = slowest.item()
    print_in_order(f"pid {os.getpid()}: one unit of work in its own process took {mine:.3f}s")

    if rank != 0:  # only rank 0 ran the serial and threaded versions
        return
    gil = (
        sys._is_gil_enabled() if hasattr(sys, "_is_gil_enabled") else True
    )  # False on free-threaded 3.13t+
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{n} units of {work} loop iterations; {cores} core(s) here, load average {load:.1f} "
        f"(other jobs take cores from the processes); GIL {'on' if gil else 'off'}"
    )
    print(f"  {'serial, 1 thread:':<24}{serial:7.3f}s")
    print(
        f"  {f'{n} threads, 1 process:':<24}{threads_time:7.3f}s  speed-up {serial / threads_time:.2f}x"
    )
    print(
        f"  {f'{n} processes:':<24}{processes:7.3f}s  speed-up {serial / processes:.2f}x "
        f"(at most min(ranks, cores) = {min(n, cores)}x)"
    )
    print(
        f"OK: every unit's result matched the formula; {n} threads ran {serial / threads_time:.2f}x "
        f"and {n} processes {serial / processes:.2f}x as fast as serial ({cores} cores)",
        flush=True,
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument(
        "--work", type=int, default=2_000_000, help="loop iterations per unit of work"
    )
    run(main, parser.parse_args())
