"""Debugging hangs: four ways to turn a silent, stuck job into a message that names the cause.

(a) One rank skips a barrier: monitored_barrier(wait_all_ranks=True) names every rank
    that did not arrive, where a plain barrier would only wait.
(b) Ranks call collectives with mismatched shapes, or in a different order:
    TORCH_DISTRIBUTED_DEBUG=DETAIL checks every call across ranks first and raises a
    clear error instead of hanging or returning garbage.
(c) One rank never joins a collective: a short process-group timeout turns the hang into
    an exception on the ranks that wait.
(d) Stacks of a stuck job: faulthandler registered on SIGUSR1 dumps every thread's Python
    stack on `kill -USR1 PID` (py-spy dump --pid PID does it with no code change).
Each part runs on a Gloo side group with a --demo-timeout of a few seconds, so it ends;
the default group stays healthy and lines the ranks up between parts.

    torchrun --nproc_per_node=3 primitives/debug_hangs.py
    python primitives/debug_hangs.py --nproc 2 --demo-timeout 3 --missing-rank 1

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

import torch
import torch.distributed as dist
from launch.dist_setup import lesson_parser, print0, print_in_order, run


def first_line(error):
    lines = [l for l in str(error).splitlines() if l.strip()]
    line = lines[0] if lines else repr(error)
    # DETAIL's fingerprints spell out every TensorOptions field: keep op, shape and dtype.
    return re.sub(r", TensorDeviceTypes=TensorOptions\(.*?memory_format=\([^)]*\)\)", "", line)


def part_a(ctx, timeout, missing):
    """monitored_barrier: rank 0 waits for a message from every rank and names the absent."""
    side = dist.new_group(backend="gloo", timeout=timeout)
    outcome = "skipped the barrier (the bug under study)"
    dist.barrier()  # start together: on a loaded machine a late (but present) rank would be named too
    if ctx.rank != missing:
        try:
            dist.monitored_barrier(group=side, timeout=timeout, wait_all_ranks=True)
            outcome = "passed (unexpected)"
        except RuntimeError as error:
            outcome = first_line(error)
    dist.barrier()  # on the healthy default group: the missing rank waits here for the others
    dist.destroy_process_group(side)
    print_in_order(f"monitored_barrier: {outcome}")
    named = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", outcome)
    if ctx.rank == 0:
        ranks = sorted(int(r) for r in named.group(1).replace(",", " ").split()) if named else None
        if ranks != [missing]:
            raise RuntimeError(f"monitored_barrier should have named rank {missing}, its message was: {outcome}")
        print0(f"-> missing rank: {missing}. Rank 0 collects one message per rank and lists every rank that "
               "did not arrive in time (wait_all_ranks=True), instead of stopping at the first.")
    return missing


def part_b(ctx, timeout, missing):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the group: each call is fingerprinted and compared."""
    # The variable is read when torch.distributed is imported; in a real job export it before
    # launching (it then wraps every group). Here we switch it on for the groups of this part only.
    before = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    # A mismatch is reported at once; the longer timeout only covers the wrapper's own pre-check,
    # in which every rank must arrive (a loaded machine may delay one by a few seconds).
    slack = max(timeout, datetime.timedelta(seconds=30))
    shapes_group = dist.new_group(backend="gloo", timeout=slack)
    order_group = dist.new_group(backend="gloo", timeout=slack)
    if before is None:
        del os.environ["TORCH_DISTRIBUTED_DEBUG"]
    else:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = before
    dist.set_debug_level_from_env()

    caught = 0
    try:  # (b1) one rank reduces 5 elements, the others 4
        dist.all_reduce(torch.ones(5 if ctx.rank == missing else 4, device="cpu"), group=shapes_group)
        shapes = "no error (unexpected)"
    except RuntimeError as error:
        shapes, caught = first_line(error), caught + 1
    try:  # (b2) one rank broadcasts first, the others all-reduce first
        t = torch.ones(4, device="cpu")
        if ctx.rank == missing:
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
    errors = torch.tensor([caught], device=ctx.device)  # the default group may be NCCL
    dist.all_reduce(errors)
    if errors.item() != 2 * ctx.world_size:
        raise RuntimeError(f"DETAIL should have raised 2 errors on each of {ctx.world_size} ranks, saw {errors.item()}")
    if ctx.rank == 0 and not all(f"Rank {missing} is running" in text for text in (shapes, order)):
        raise RuntimeError(f"rank 0's DETAIL errors should name rank {missing}: {shapes} / {order}")
    print0("-> with DETAIL every rank raises at the first call that differs, and the message shows both "
           "ranks' op, shape and dtype. Without it: a wrong result, a crash or a hang, depending on the backend.")
    return int(errors.item())


def part_c(ctx, timeout, missing):
    """A short timeout on the group: the ranks that wait get an exception instead of a hang."""
    side = dist.new_group(backend="gloo", timeout=timeout)
    dist.barrier()
    timed_out, outcome, start = 0, "skipped the all_reduce (the bug under study)", time.perf_counter()
    if ctx.rank != missing:
        try:
            dist.all_reduce(torch.ones(4, device="cpu"), group=side)
            outcome = "completed (unexpected)"
        except RuntimeError as error:
            timed_out, outcome = 1, f"after {time.perf_counter() - start:.1f}s: {first_line(error)}"
    dist.barrier()
    dist.destroy_process_group(side)
    print_in_order(f"all_reduce: {outcome}")
    count = torch.tensor([timed_out], device=ctx.device)
    dist.all_reduce(count)
    if count.item() != ctx.world_size - 1:
        raise RuntimeError(f"expected {ctx.world_size - 1} ranks to time out, saw {count.item()}")
    print0(f"-> {count.item()} rank(s) got an exception after the {timeout.total_seconds():g}s timeout; it says "
           "that this rank waited, not who is missing: (a) does that. On NCCL the call returns at once and the "
           "watchdog aborts the process after the timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING).")
    return int(count.item())


def part_d(ctx, timeout, missing):
    """faulthandler on a signal: a stuck process prints its own Python stacks when asked."""
    side = dist.new_group(backend="gloo", timeout=timeout)
    dumps = tempfile.TemporaryFile("w+")
    faulthandler.register(signal.SIGUSR1, file=dumps, all_threads=True)  # put this in your training script
    dist.barrier()
    if ctx.rank != missing:
        # From a shell this is `kill -USR1 PID`; here a thread does it while the rank is stuck. The
        # thread stays alive until the broadcast returns: the handler walks every thread's stack,
        # and a thread that exits during that walk can crash it.
        done = threading.Event()

        def poke():
            time.sleep(timeout.total_seconds() / 2)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
            done.wait()

        poker = threading.Thread(target=poke)
        poker.start()
        try:
            waits_at = f"line {sys._getframe().f_lineno + 1} in part_d"  # what the dump should show
            dist.broadcast(torch.ones(4, device="cpu"), src=missing, group=side)  # the source never sends: stuck
        except RuntimeError:
            pass  # part (c) showed this error; here we want the stack taken while it waited
        done.set()
        poker.join()  # the signal must arrive while our handler is registered (default action: exit)
    dist.barrier()
    dist.destroy_process_group(side)
    faulthandler.unregister(signal.SIGUSR1)
    dumps.seek(0)
    frames = [l.strip() for l in dumps.read().splitlines() if "debug_hangs.py" in l]
    dumps.close()
    shown = "\n".join(frames) if ctx.rank != missing else "not stuck: no stack asked for"
    print_in_order(f"pid {os.getpid()}; Python stack taken by SIGUSR1 while waiting (frames in this file):\n{shown}")
    ok = torch.tensor([int(ctx.rank == missing or any(waits_at in f for f in frames))], device=ctx.device)
    dist.all_reduce(ok)
    if ok.item() != ctx.world_size:
        raise RuntimeError("a stuck rank's faulthandler dump did not show the broadcast it waited in")
    pids = [None] * ctx.world_size
    dist.all_gather_object(pids, os.getpid())  # pickles: fine between our own ranks
    print0(f"-> each stuck rank's dump shows the line of the broadcast it waited in. Without changing the code: "
           f"`py-spy dump --pid {pids[0]}` (add --native for C++ frames; for all ranks: "
           f"`for p in {' '.join(map(str, pids))}; do py-spy dump --pid $p; done`).")
    return ctx.world_size - 1


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    missing = ctx.world_size - 1 if args.missing_rank is None else args.missing_rank
    ctx.require(1 <= missing < ctx.world_size, f"--missing-rank must be between 1 and {ctx.world_size - 1} "
                "(rank 0 is the one that monitors)")
    ctx.require(args.demo_timeout > 0, "--demo-timeout must be positive")
    parts = args.parts.split(",")
    ctx.require(set(parts) <= set("abcd"), "--parts: a comma-separated subset of a,b,c,d")
    timeout = datetime.timedelta(seconds=args.demo_timeout)
    results = []
    for name, part in [("a", part_a), ("b", part_b), ("c", part_c), ("d", part_d)]:
        if name in parts:
            print0(f"\n== ({name}) {part.__doc__}")
            results.append((name, part(ctx, timeout, missing)))
    said = {"a": "monitored_barrier named missing rank {}", "b": "DETAIL raised {} mismatch errors",
            "c": "a short timeout ended {} hung rank(s)", "d": "faulthandler dumped {} stuck rank(s)' stacks"}
    print0("OK: " + "; ".join(said[name].format(value) for name, value in results) +
           f" (missing rank {missing}, {args.demo_timeout:g}s timeouts)")


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument("--missing-rank", type=int, help="the rank that skips a call (default: the last)")
    parser.add_argument("--demo-timeout", type=float, default=2.0, help="seconds each demonstration waits")
    parser.add_argument("--parts", default="a,b,c,d", help="which parts to run, e.g. a,c")
    run(main, parser.parse_args())
