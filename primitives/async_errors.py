"""Async errors and operations in flight: where a failure surfaces, and what pending work holds.

1. A collective started with async_op=True returns a Work at once, even one that can never
   finish. Here the last rank never joins an all_reduce on a group whose timeout is
   --fail-after seconds: on the other ranks the call returns, and the failure is raised later by
   work.wait() (Gloo; NCCL's watchdog acts first: primitives/README.md). So the try belongs
   around wait().
2. In flight: N all_reduces issued without waiting, then waited for together. Until its wait()
   each tensor must stay alive and untouched (the backend writes into it), and each Work is one
   more handle the backend tracks. Measured for each N: the bytes the tensors hold, the
   process's memory growth while they are in flight, the time to issue and to finish, against
   the blocking call, one at a time.

    torchrun --nproc_per_node=2 primitives/async_errors.py
    python primitives/async_errors.py --nproc 3 --in-flight 1,10,100,1000 --size 65536

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#synchronous-and-asynchronous-collective-operations
"""

import datetime
import time

import torch
import torch.distributed as dist
from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: one of them stays away")
    # the last rank waits in a barrier on the world group while the others wait --fail-after
    ctx.require(2 * args.fail_after <= args.timeout, "needs --fail-after <= --timeout / 2")
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device

    # 1. The last rank stays away from a collective on a group with a short timeout. Gloo only:
    # on NCCL the watchdog meets the timeout and by default ends the process (primitives/README.md,
    # "Blocking wait against async error handling").
    short = dist.new_group(timeout=datetime.timedelta(seconds=args.fail_after))  # every rank
    gloo = ctx.backend == "gloo"
    report = "stayed away" if rank == world - 1 else None if gloo else "not tried on " + ctx.backend
    if rank != world - 1 and gloo:
        t = torch.ones(args.size, device=dev)
        start, returned = time.perf_counter(), None
        try:
            work = dist.all_reduce(t, group=short, async_op=True)  # no error here
            returned = time.perf_counter()
            work.wait()  # the timeout is raised here
        except RuntimeError as error:  # Gloo: RuntimeError; dist.DistBackendError subclasses it
            report = failure_report(start, returned, error, args.fail_after)
    dist.barrier()  # on the world group: the last rank waits here for the others' failures
    print_in_order(check_report(report))

    # 2. N operations in flight on the (healthy) world group, then the same N one at a time.
    rows = []
    for n in args.in_flight:
        tensors = [torch.full((args.size,), rank + 1.0, device=dev) for _ in range(n)]
        before, start = memory_now(), time.perf_counter()
        works = [dist.all_reduce(x, async_op=True) for x in tensors]  # keep every handle
        issued, grown = time.perf_counter(), memory_now() - before
        for work in works:
            work.wait()
        done = time.perf_counter()
        check_sums(tensors, world)
        one_at_a_time = [torch.full((args.size,), rank + 1.0, device=dev) for _ in range(n)]
        start_each = time.perf_counter()
        for x in one_at_a_time:
            dist.all_reduce(x)  # blocking: returns when x holds the sum
        each = time.perf_counter() - start_each
        check_sums(one_at_a_time, world)
        rows.append((n, n * tensors[0].nbytes, grown, issued - start, done - start, each))
    print_table(rows, args.size)
    failed = "failed in wait(), not in the call" if gloo else f"not tried on {ctx.backend}"
    print0(
        f"OK: the missing rank's all_reduce {failed}; {len(rows)} "
        f"batches of async all_reduces in flight summed to {sum(range(1, world + 1))} everywhere"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def failure_report(start, returned, error, fail_after):
    """The call must have returned a Work before anything failed: the error came from wait(); and it
    is the timeout asked for, --fail-after seconds after the call, not earlier (a timeout typed in,
    or in other units, fails sooner)."""
    first, waited = str(error).splitlines()[0], time.perf_counter() - start
    if returned is None:
        raise RuntimeError(f"the all_reduce call itself raised, not wait(): {first}")
    if "Timed out" not in first and "timeout" not in first.lower():
        raise RuntimeError(f"wait() raised something other than a timeout: {first}")
    if waited < fail_after:
        raise RuntimeError(
            f"wait() raised {waited:.2f} s after the call, before --fail-after {fail_after:g} s"
        )
    return (
        f"all_reduce(async_op=True) returned a Work in {1e3 * (returned - start):.1f} ms; "
        f"wait() raised {type(error).__name__} {waited:.1f} s later: {first}"
    )


def check_report(report):
    if report is None:
        raise RuntimeError("wait() returned without an error, though a rank never joined")
    return report


def check_sums(tensors, world):
    """Each rank filled its tensors with its rank + 1 (not its rank: rank 0's zeros would let MAX
    pass for SUM at 2 ranks): every element must be 1 + 2 + ... + world."""
    want = float(sum(range(1, world + 1)))
    for i, x in enumerate(tensors):
        if not bool((x == want).all()):
            raise RuntimeError(f"tensor {i} of {len(tensors)}: {x[:4].tolist()}, expected {want}")


def memory_now():
    """This process's resident memory in bytes (Linux: /proc/self/statm), else 0."""
    try:
        with open("/proc/self/statm") as f:
            import resource

            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


def print_table(rows, size):
    lines = [
        f"{'in flight':>9} {'tensors held':>13} {'RSS growth':>11} {'issue':>9} {'all done':>9} "
        f"{'one at a time':>14}   ({size} floats each)"
    ]
    for n, held, grown, issue, total, each in rows:
        lines.append(
            f"{n:>9} {held / 2**20:>10.2f} MB {grown / 2**20:>8.2f} MB {1e3 * issue:>6.1f} ms "
            f"{1e3 * total:>6.1f} ms {1e3 * each:>11.1f} ms"
        )
    print_in_order("\n".join(lines))


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
        "--fail-after",
        type=float_in(0.1, 600),
        default=2.0,
        help="timeout in seconds of the group whose all_reduce one rank skips",
    )
    parser.add_argument(
        "--in-flight",
        type=ints_in(1, 100_000),
        default=[1, 10, 100, 1000],
        help="numbers of all_reduces to keep in flight at once",
    )
    parser.add_argument(
        "--size", type=int_in(1, 10_000_000), default=1024, help="floats per all_reduce"
    )
    run(main, parser.parse_args())
