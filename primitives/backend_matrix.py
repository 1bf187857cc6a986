"""A tool, not a lesson: which calls each backend supports on each device, found by trying them.

It prints a Markdown table: a row per call (collectives, point-to-point, every ReduceOp, object
collectives, monitored_barrier; the probes and their checks are in backend_probes.py), a column
per backend/device pair (Gloo/CPU, Gloo/CUDA, NCCL/CUDA). "yes": every rank made the call and its
result was right; "no (k)": a rank raised, hung, crashed or got a wrong value (note k under the
table says which); "not available here": this machine cannot run the pair, and nothing is assumed.
Then a "Made with" line (torch, platform, ranks, GPUs) and an OK line with the counts.

The calls run in child processes because a timed-out NCCL call cannot be caught: its watchdog
tears the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING: 3 is ProcessGroupNCCL's default, torchrun
sets 1, and both end the process; see the README's "When it hangs" and
https://pytorch.org/docs/stable/torch_nccl_environment_variables.html), and torchrun would then
stop every rank. Each rank starts one child per column; the children form their own group, make
the calls and agree on each outcome. If one hangs or crashes, the parents mark that call "no"
and start new children from the next call.

    torchrun --nproc_per_node=2 primitives/backend_matrix.py
    python primitives/backend_matrix.py --nproc 4 --op-timeout 10

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.
Docs: https://pytorch.org/docs/stable/distributed.html#backends
"""

import datetime
import multiprocessing
import os
import platform
import signal

import torch
import torch.distributed as dist
from backend_probes import calls
from launch.dist_setup import float_in, lesson_parser, print0, run


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    n = ctx.world_size
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    has_gpu = gpus >= ctx.local_world_size  # one GPU per local rank, or the CUDA columns are off
    columns = [
        ("Gloo", "gloo", "cpu", dist.is_gloo_available()),
        ("Gloo", "gloo", "cuda", dist.is_gloo_available() and has_gpu),
        ("NCCL", "nccl", "cuda", dist.is_nccl_available() and has_gpu),
    ]
    # A CPU group for the parents to agree on outcomes; it waits while the children probe.
    wait = datetime.timedelta(seconds=3 * args.timeout + args.op_timeout)
    coord = dist.new_group(backend="gloo", timeout=wait)
    store_at, _server = serve_store_for_children(coord)  # rank 0 keeps _server alive to the end
    names = [name for name, _ in calls(ctx.rank, n, torch.device("cpu"))]
    outcomes = [
        probe(args, ctx, backend, dev, len(names), gpus, store_at, coord) if available else None
        for _, backend, dev, available in columns
    ]
    supported = print_table(names, columns, outcomes)
    print_made_with(args, n, gpus, names, columns, supported)


# ---- The lesson ends here. What follows is how it checks itself. ----


def print_made_with(args, n, gpus, names, columns, supported):
    print0(
        f"\nMade with torch {torch.__version__} on {platform.system()} {platform.machine()}, "
        f"{n} ranks, {gpus} GPU(s), by: python primitives/backend_matrix.py --nproc {n} "
        f"--op-timeout {args.op_timeout:g}"
    )
    live = [f"{label}/{dev.upper()}" for label, _, dev, available in columns if available]
    print0(
        f"OK: tried {len(names)} calls on {', '.join(live)} with {n} ranks, each result checked: "
        f"{supported} of {len(names) * len(live)} work; {len(columns) - len(live)} "
        "backend/device pair(s) not available here"
    )


def error_text(e):
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"


def probe_column(conn, backend, device_type, start, ranks, gpus, store_at, timeouts):
    """The child process: try the calls from `start` on. After each call the ranks agree on every
    rank's outcome and send it up the pipe: (index, [error or None per rank])."""
    rank, n, local_rank = ranks
    op_timeout, coord_timeout = (datetime.timedelta(seconds=t) for t in timeouts)
    torch.set_num_threads(1)
    dev = torch.device("cuda", local_rank % gpus) if device_type == "cuda" else torch.device("cpu")
    try:  # a process group of its own, through the parents' store
        if dev.type == "cuda":
            torch.cuda.set_device(dev)  # as launch/dist_setup.py does for the lessons
        (host, port), prefix = store_at
        store = dist.PrefixStore(
            prefix, dist.TCPStore(host, port, is_master=False, timeout=coord_timeout)
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=n,
            timeout=coord_timeout,  # only makes the groups below: a loaded machine may be slow
            device_id=dev if dev.type != "cpu" else None,
        )
        coord = dist.new_group(backend="gloo", timeout=coord_timeout)  # to agree on outcomes
        group = dist.new_group(backend=backend, timeout=op_timeout)  # to try the calls on
    except Exception as e:
        conn.send(("init", error_text(e)))
        os._exit(0)
    for i, (name, fn) in enumerate(calls(rank, n, dev)):
        if i < start:
            continue
        try:
            fn(group)
            error = None
        except Exception as e:  # an unsupported call, a Gloo time-out or a wrong value: record it
            error = error_text(e)
        errors = [None] * n
        try:
            dist.all_gather_object(errors, error, group=coord)  # pickles: fine between our ranks
        except Exception:
            os._exit(3)  # a peer's process is gone: leave too, the parents know where we were
        conn.send((i, errors))
        if any(errors):  # the group may be stuck mid-call: start a clean one
            dist.destroy_process_group(group)
            group = dist.new_group(backend=backend, timeout=op_timeout)
    dist.destroy_process_group()
    conn.send(("done", None))
    os._exit(0)


def run_child(args, ctx, backend, device_type, start, gpus, store_at, attempt):
    """Start one child, collect what it reports until it ends or goes quiet, and end it. Returns
    ({call index: errors per rank}, the error that stopped its set-up or None, its exit code)."""
    spawn = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA or threads
    receiver, sender = spawn.Pipe(duplex=False)
    ranks, timeouts = (ctx.rank, ctx.world_size, ctx.local_rank), (args.op_timeout, args.timeout)
    where = (
        store_at,
        f"matrix/{backend}/{device_type}/{attempt}",
    )  # a fresh store prefix each time
    child = spawn.Process(
        target=probe_column,
        args=(sender, backend, device_type, start, ranks, gpus, where, timeouts),
    )
    child.start()
    sender.close()
    seen, init_error = {}, None
    quiet_after = args.op_timeout + 2 * args.timeout  # a call and the agreement, or the start
    while receiver.poll(quiet_after):
        try:
            index, errors = receiver.recv()
        except EOFError:  # the child ended
            break
        if index == "init":
            init_error = errors
        elif index != "done":
            seen[index] = errors
    if child.is_alive():
        child.kill()
    child.join()
    return seen, init_error, child.exitcode


def how_it_ended(code):
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return "a time-out of the tool (killed)" if code is None else f"exit code {code}"


def first_error(errors):
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)


def probe(args, ctx, backend, device_type, count, gpus, store_at, coord):
    """Fill one column: {call index: None if it works, else the reason}."""
    outcome, start, attempt = {}, 0, 0
    while start < count:
        reports = [None] * ctx.world_size  # what every rank's child reported, and how it ended
        dist.all_gather_object(
            reports,
            run_child(args, ctx, backend, device_type, start, gpus, store_at, attempt),
            group=coord,
        )
        for seen, _, _ in reports:
            outcome.update({i: first_error(errors) for i, errors in seen.items()})
        failed_init = first_error([init_error for _, init_error, _ in reports])
        if failed_init:
            outcome.update(
                {i: f"the group could not be made: {failed_init}" for i in range(start, count)}
            )
            break
        start = next((i for i in range(start, count) if i not in outcome), count)
        if start < count:  # no rank's child finished this call: one of them hung or crashed in it
            dead = [(r, code) for r, (_, _, code) in enumerate(reports) if code not in (0, 3)]
            who = (
                ", ".join(f"rank {r}'s ended with {how_it_ended(code)}" for r, code in dead)
                or "they ended"
            )
            outcome[start] = f"hung or crashed: the probing processes did not finish it ({who})"
            start, attempt = start + 1, attempt + 1
    return outcome


def serve_store_for_children(coord):
    """Rank 0 serves a TCPStore on a free port of MASTER_ADDR (its host); every rank learns it."""
    host = os.environ["MASTER_ADDR"]
    server = (
        dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        if dist.get_rank() == 0
        else None
    )
    port = [server.port if server else None]
    dist.broadcast_object_list(port, src=0, group=coord)
    return (host, port[0]), server


def print_table(names, columns, outcomes):
    """The Markdown table, then the numbered reasons for its "no" cells; returns how many "yes"."""
    print0(f"| call | {' | '.join(f'{label} / {dev.upper()}' for label, _, dev, _ in columns)} |")
    print0(f"|---|{'---|' * len(columns)}")
    notes, supported = [], 0
    for i, name in enumerate(names):
        cells = []
        for (label, _, dev, _), outcome in zip(columns, outcomes):
            if outcome is None:
                cells.append("not available here")
            elif outcome[i] is None:
                cells.append("yes")
                supported += 1
            else:
                notes.append(f"{label}/{dev.upper()} {name}, {outcome[i]}")
                cells.append(f"no ({len(notes)})")
        print0(f"| `{name}` | {' | '.join(cells)} |")
    print0("")
    for k, note in enumerate(notes, 1):
        print0(f"({k}) {note}")
    return supported


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument(
        "--op-timeout",
        type=float_in(0, 3600, low_open=True),
        default=5.0,
        help="seconds a call may take before it counts as no",
    )
    run(main, parser.parse_args())
