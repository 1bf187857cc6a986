"""Debugging hangs: four tools that turn a silent, stuck job into a message that names the cause.

What goes into your own job (main below sets up (c) and (d) as a job would):
    dist.monitored_barrier(timeout=..., wait_all_ranks=True)  # (a) Gloo: names who never came
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun ...  # (b) debug runs: calls compared across ranks
    dist.init_process_group(..., timeout=timedelta(minutes=10))  # (c) a waiting rank raises
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # (d) `kill -USR1 PID`: the stacks
Below the divider, parts (a) to (d) show each at work on a rank that misbehaves, on a Gloo side
group with a short --demo-timeout, and check that the tool named the cause.

    torchrun --nproc_per_node=3 primitives/debug_hangs.py
    python primitives/debug_hangs.py --nproc 2 --demo-timeout 3 --missing-rank 1

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.
Docs: https://pytorch.org/docs/stable/distributed.html#debugging-torch-distributed-applications
"""

import datetime
import faulthandler
import os
import re
import signal
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    missing = ctx.world_size - 1 if args.missing_rank is None else args.missing_rank
    ctx.require(
        1 <= missing < ctx.world_size,
        f"--missing-rank must be between 1 and {ctx.world_size - 1} "
        "(rank 0 is the one that monitors)",
    )
    ctx.require(
        set(args.parts.split(",")) <= set("abcd"), "--parts: a comma-separated subset of a,b,c,d"
    )

    # (d) The line for your training script. Without file= the stacks go to stderr (here part (d)
    # reads them back).
    stacks = tempfile.TemporaryFile("w+")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # (c) The timeout of every demonstration's group: init_process_group(timeout=...) in a real job.
    demo = SimpleNamespace(
        timeout=datetime.timedelta(seconds=args.demo_timeout), missing=missing, stacks=stacks
    )
    results = []
    for name, part in [("a", part_a), ("b", part_b), ("c", part_c), ("d", part_d)]:
        if name in args.parts.split(","):
            print0(f"\n== ({name}) {part.__doc__}")
            results.append(part(ctx, demo))
    faulthandler.unregister(signal.SIGUSR1)
    stacks.close()
    print0(f"OK: {'; '.join(results)} (missing rank {missing}, {args.demo_timeout:g}s timeouts)")


# ---- The lesson ends here. What follows is how it checks itself. ----


def part_a(ctx, demo):
    """monitored_barrier: rank 0 waits for a message from every rank and names the absent."""
    side = dist.new_group(backend="gloo", timeout=demo.timeout)
    outcome = "skipped the barrier (the bug under study)"
    dist.barrier()  # start together: on a loaded machine a late (but present) rank may be named
    if ctx.rank != demo.missing:
        try:
            dist.monitored_barrier(group=side, timeout=demo.timeout, wait_all_ranks=True)
            outcome = "passed (unexpected)"
        except RuntimeError as error:
            outcome = first_line(error)
    dist.barrier()  # on the healthy default group: the missing rank waits here for the others
    dist.destroy_process_group(side)
    print_in_order(f"monitored_barrier: {outcome}")
    if ctx.rank == 0:
        named = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", outcome)
        if not named or sorted(map(int, re.findall(r"\d+", named.group(1)))) != [demo.missing]:
            raise RuntimeError(
                f"monitored_barrier should have named rank {demo.missing}, its message was: "
                f"{outcome}"
            )
        print0(
            f"-> missing rank: {demo.missing}. Rank 0 collects one message per rank and, with "
            "wait_all_ranks=True, lists every rank that did not arrive in time instead of stopping "
            "at the first."
        )
    return f"monitored_barrier named missing rank {demo.missing}"


def part_b(ctx, demo):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the group: each call is fingerprinted and compared."""
    # TORCH_DISTRIBUTED_DEBUG=DETAIL, read at import, wraps every group made at that level (torch
    # 2.13, distributed_c10d.py, _new_process_group_helper): here only these two. A mismatch raises
    # at once; the long timeout covers the wrapper's pre-check, which a loaded machine may delay.
    before = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    slack = max(demo.timeout, datetime.timedelta(seconds=30))
    shapes_group = dist.new_group(backend="gloo", timeout=slack)
    order_group = dist.new_group(backend="gloo", timeout=slack)
    dist.set_debug_level(before)
    caught = 0
    try:  # (b1) one rank reduces 5 elements, the others 4
        t = torch.ones(5 if ctx.rank == demo.missing else 4, device="cpu")
        dist.all_reduce(t, group=shapes_group)
        shapes = "no error (unexpected)"
    except RuntimeError as error:
        shapes, caught = first_line(error), caught + 1
    try:  # (b2) one rank broadcasts first, the others all-reduce first
        t = torch.ones(4, device="cpu")
        if ctx.rank == demo.missing:
            dist.broadcast(t, src=0, group=order_group)
            dist.all_reduce(t, group=order_group)
        else:
            dist.all_reduce(t, group=order_group)
            dist.broadcast(t, src=0, group=order_group)
        order = "no error (unexpected)"
    except RuntimeError as error:
        order, caught = first_line(error), caught + 1
    dist.barrier()
    dist.destroy_process_group(shapes_group)
    dist.destroy_process_group(order_group)
    print_in_order(f"shape mismatch: {shapes}\norder mismatch: {order}")
    caught = sum_over_ranks(ctx, caught)
    if caught != 2 * ctx.world_size:
        raise RuntimeError(
            f"DETAIL should have raised 2 errors on each of {ctx.world_size} ranks, saw {caught}"
        )
    named = all(f"Rank {demo.missing} is running" in text for text in (shapes, order))
    if ctx.rank == 0 and not named:
        raise RuntimeError(
            f"rank 0's DETAIL errors should name rank {demo.missing}: {shapes} / {order}"
        )
    print0(
        "-> with DETAIL every rank raises at the first call that differs, and the message shows "
        "both ranks' op, shape and dtype. Without it: a wrong result, a crash or a hang, depending "
        "on the backend."
    )
    return f"DETAIL raised {caught} mismatch errors"


def part_c(ctx, demo):
    """A short timeout on the group: the ranks that wait get an exception instead of a hang."""
    side = dist.new_group(backend="gloo", timeout=demo.timeout)
    dist.barrier()
    outcome, start = "skipped the all_reduce (the bug under study)", time.perf_counter()
    if ctx.rank != demo.missing:
        try:
            dist.all_reduce(torch.ones(4, device="cpu"), group=side)
            outcome = "completed (unexpected)"
        except RuntimeError as error:
            outcome = f"after {time.perf_counter() - start:.1f}s: {first_line(error)}"
    dist.barrier()
    dist.destroy_process_group(side)
    print_in_order(f"all_reduce: {outcome}")
    timed_out = sum_over_ranks(ctx, int(outcome.startswith("after")))
    if timed_out != ctx.world_size - 1:
        raise RuntimeError(f"expected {ctx.world_size - 1} ranks to time out, saw {timed_out}")
    print0(
        f"-> {timed_out} rank(s) got an exception after the {demo.timeout.total_seconds():g}s "
        "timeout: it says that this rank waited, not who is missing ((a) does). On NCCL the "
        "watchdog ends the process instead (TORCH_NCCL_ASYNC_ERROR_HANDLING)."
    )
    return f"a short timeout ended {timed_out} hung rank(s)"


def part_d(ctx, demo):
    """faulthandler on a signal: a stuck process prints its own Python stacks when asked."""
    side = dist.new_group(backend="gloo", timeout=demo.timeout)
    dist.barrier()
    if ctx.rank != demo.missing:
        # `kill -USR1 PID` from a thread, while the rank is stuck. The thread lives until the
        # broadcast returns: the handler walks every thread's stack, and one that exits meanwhile
        # can crash it.
        done = threading.Event()

        def poke():
            time.sleep(demo.timeout.total_seconds() / 2)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
            done.wait()

        poker = threading.Thread(target=poke)
        poker.start()
        try:
            # The source never sends: stuck on the next line but one, which the dump should show.
            waits_at = f"line {sys._getframe().f_lineno + 1} in part_d"
            dist.broadcast(torch.ones(4, device="cpu"), src=demo.missing, group=side)
        except RuntimeError:
            pass  # part (c) showed this error; here we want the stack taken while it waited
        done.set()
        poker.join()  # the signal must come while main's handler is registered (by default: exit)
    dist.barrier()
    dist.destroy_process_group(side)
    demo.stacks.seek(0)
    frames = [line.strip() for line in demo.stacks.read().splitlines() if "debug_hangs.py" in line]
    shown = "\n".join(frames) if ctx.rank != demo.missing else "not stuck: no stack asked for"
    print_in_order(
        f"pid {os.getpid()}; Python stack taken by SIGUSR1 while waiting (frames in this file):"
        f"\n{shown}"
    )
    shown_right = ctx.rank == demo.missing or any(waits_at in f for f in frames)
    if sum_over_ranks(ctx, int(shown_right)) != ctx.world_size:
        raise RuntimeError("a stuck rank's dump did not show the broadcast it waited in")
    pids = [None] * ctx.world_size
    dist.all_gather_object(pids, os.getpid())  # pickles: fine between our own ranks
    print0(
        "-> each stuck rank's dump shows the line of the broadcast it waited in. Without changing "
        f"the code: `py-spy dump --pid {pids[0]}` (add --native for C++ frames; for all ranks: "
        f"`for p in {' '.join(map(str, pids))}; do py-spy dump --pid $p; done`)."
    )
    return f"faulthandler dumped {ctx.world_size - 1} stuck rank(s)' stacks"


def first_line(error):
    line = next((line for line in str(error).splitlines() if line.strip()), repr(error))
    # DETAIL's fingerprints spell out every TensorOptions field: keep op, shape and dtype.
    return re.sub(r", TensorDeviceTypes=TensorOptions\(.*?memory_format=\([^)]*\)\)", "", line)


def sum_over_ranks(ctx, count):
    """An int summed over all ranks, on the default group (on ctx.device: it may be NCCL)."""
    total = torch.tensor([count], device=ctx.device)
    dist.all_reduce(total)
    return int(total.item())


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument(
        "--missing-rank",
        type=int_in(1, 4095),
        help="the rank that skips a call (default: the last; rank 0 monitors)",
    )
    parser.add_argument(
        "--demo-timeout",
        type=float_in(0, 600, low_open=True),
        default=2.0,
        help="seconds each demonstration waits",
    )
    parser.add_argument("--parts", default="a,b,c,d", help="which parts to run, e.g. a,c")
    run(main, parser.parse_args())
