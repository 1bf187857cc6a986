"""Why DDP runs one process per device: the GIL lets only one thread run Python at a time.

The same pure-Python work (a loop the interpreter executes, like the Python parts of a training
step: module calls, hooks, the optimizer loop, data handling) is done three ways:
  serial     rank 0 does N units one after the other,
  threads    rank 0 starts N threads, one unit each (torch.nn.DataParallel's model: one process
             drives every GPU from its threads),
  processes  the N ranks of this job do one unit each, at the same time (DDP's model).
Threads take about as long as serial: they share one interpreter lock. Processes take about as
long as one unit, given a free core each. Each unit's result is checked against a formula. Kernels
(a big matmul) release the GIL, so threads help there; the Python around them does not scale.

    torchrun --nproc_per_node=2 primitives/gil_threads_vs_processes.py
    python primitives/gil_threads_vs_processes.py --nproc 4 --work 3000000

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.
Docs: https://pytorch.org/docs/stable/notes/cuda.html#use-nn-parallel-distributeddataparallel-instead-of-multiprocessing-or-nn-dataparallel
"""

import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print_in_order, run


def python_work(n):
    """Pure-Python arithmetic: holds the GIL the whole time."""
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks (the processes to compare)")
    n, work = ctx.world_size, args.work
    # 1 and 2 on rank 0 alone; the others wait at the barrier. On Gloo (CPU) a waiting rank blocks
    # in a socket read and uses no core. On NCCL it waits for the GPU, and CUDA's default schedule
    # spins while a process has no more CUDA contexts than there are cores (cudaDeviceScheduleAuto,
    # CUDA runtime API docs, cudaSetDeviceFlags): there each waiting rank holds a core.
    serial = threads = 0.0
    if ctx.rank == 0:
        start = time.perf_counter()
        check([python_work(work) for _ in range(n)], work, ctx)
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
        threads = time.perf_counter() - start
        check(results, work, ctx)
    dist.barrier()

    # 3: every rank, one unit each, at the same time; the job is done when the slowest is.
    start = time.perf_counter()
    check([python_work(work)], work, ctx)
    mine = time.perf_counter() - start
    slowest = torch.tensor([mine], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    print_in_order(f"pid {os.getpid()}: one unit of work in its own process took {mine:.3f}s")
    if ctx.rank == 0:  # only rank 0 ran the serial and threaded versions
        print_times(serial, threads, slowest.item(), args, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


def expected(n):
    """python_work(n) by a formula: i*i % 7 repeats with period 7."""
    cycle = [i * i % 7 for i in range(7)]
    return sum(cycle) * (n // 7) + sum(cycle[: n % 7])


def check(results, work, ctx):
    for result in results:
        if result != expected(work):
            raise RuntimeError(
                f"rank {ctx.rank}: a unit of work returned {result}, expected {expected(work)}"
            )


def print_times(serial, threads, processes, args, ctx):
    n = ctx.world_size
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gil = sys._is_gil_enabled() if hasattr(sys, "_is_gil_enabled") else True  # off: 3.13t+
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{n} units of {args.work} loop iterations; {cores} core(s) here, load average {load:.1f} "
        f"(other jobs take cores from the processes); GIL {'on' if gil else 'off'}"
    )
    print(f"  {'serial, 1 thread:':<24}{serial:7.3f}s")
    print(f"  {f'{n} threads, 1 process:':<24}{threads:7.3f}s  speed-up {serial / threads:.2f}x")
    print(
        f"  {f'{n} processes:':<24}{processes:7.3f}s  speed-up {serial / processes:.2f}x "
        f"(at most min(ranks, cores) = {min(n, cores)}x)"
    )
    print(
        f"OK: every unit's result matched the formula; {n} threads ran {serial / threads:.2f}x "
        f"and {n} processes {serial / processes:.2f}x as fast as serial ({cores} cores)",
        flush=True,
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument(
        "--work", type=int_in(1, 10**9), default=2_000_000, help="loop iterations per unit of work"
    )
    run(main, parser.parse_args())
