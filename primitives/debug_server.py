"""debug_server: a job hangs; read every rank's stack, live, from torch's debug server.

start_debug_server() (torch 2.13, experimental; needs `pip install aiohttp tabulate`) starts
an HTTP server in every rank and, on rank 0, a front end (port 25999) whose pages ask every rank at
once: /stacks, /fr_trace_json (flight records), /tcpstore. Both listen on every interface (README).
Here --stuck-rank sleeps in step --hang-step and the others wait; rank 0's watchdog thread, once no
step has ended for --late s, reads two pages on 127.0.0.1 and prints where each rank waits and who
is behind; after --stall s the rank wakes and the job ends. To look in a browser: --stall 300
--timeout 600, then open http://HOST:PORT/stacks (an SSH tunnel to HOST: -L PORT:127.0.0.1:PORT).

    torchrun --nproc_per_node=3 primitives/debug_server.py
    python primitives/debug_server.py --nproc 2 --stuck-rank 0 --port 26001

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.
Docs: https://docs.pytorch.org/docs/stable/distributed.html (the server: pytorch PR #167395)
"""

import inspect
import json
import os
import re
import socket
import threading
import time
import urllib.request
from importlib.util import find_spec

import torch
import torch.distributed as dist
from torch.distributed.debug import start_debug_server, stop_debug_server
from launch.dist_setup import float_in, int_in, lesson_parser, run


def main(args, ctx):
    stuck = ctx.world_size - 1 if args.stuck_rank is None else args.stuck_rank
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: one hangs, the others wait for it")
    ctx.require(stuck < ctx.world_size, f"--stuck-rank must be a rank below {ctx.world_size}")
    ctx.require(args.hang_step < args.steps, f"--hang-step must be below --steps {args.steps}")
    ctx.require(args.late < args.stall < args.timeout, "needs --late < --stall < --timeout")
    # the front end's packages (jinja2 comes with torch; the other two do not)
    missing = [name for name in ("aiohttp", "jinja2", "tabulate") if find_spec(name) is None]
    ctx.require(not missing, f"needs {' '.join(missing)}: pip install {' '.join(missing)}")
    taken = torch.tensor([ctx.rank == 0 and port_taken(args.port)], device=ctx.device)
    dist.broadcast(taken, src=0)  # the front end listens on rank 0's machine: its verdict
    ctx.require(not taken.item(), f"--port {args.port} is in use on rank 0's machine: pass another")
    # Every rank: a worker server (a free port). Rank 0 also: the front end, a process of its own,
    # spawned: a fresh interpreter rather than a fork of a rank that runs the group's threads
    start_debug_server(port=args.port, start_method="spawn")
    beats, done, report = [time.monotonic()], threading.Event(), {}
    # the front end, on rank 0's machine; flight records: CPU's (Gloo) or NCCL's, a page each
    record = "fr_trace_nccl_json" if ctx.backend == "nccl" else "fr_trace_json"
    urls = [f"http://127.0.0.1:{args.port}/{page}" for page in ("stacks", record)]
    watch = threading.Thread(target=watchdog, args=(urls, args.late, beats, done, report))
    if ctx.rank == 0:
        wait_until_up(urls[0], args.timeout)  # the front end imports torch first: seconds
        watch.start()
    grad, sums = torch.zeros(args.size, device=ctx.device), []
    for step in range(args.steps):
        grad.copy_(load_batch(step, args, stalls=ctx.rank == stuck))
        dist.all_reduce(grad)  # on Gloo the others wait here for the stuck rank
        sums.append(grad.sum().item())  # on NCCL here: all_reduce returns before the data is in
        beats.append(time.monotonic())
    if ctx.rank == 0:
        done.set()
        watch.join()
        stop_debug_server()  # rank 0 only: on the others it raises (it stops the front end)
        check_report(report, args, sums, ctx.world_size)


def port_taken(port):
    """Whether the front end could not listen on `port`: it binds ("", port) on IPv6, as here."""
    with socket.socket(socket.AF_INET6) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Python's HTTP server does
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


def wait_until_up(url, timeout):
    """Wait until the front end answers: the hang must not be over before it can be read."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return urllib.request.urlopen(url, timeout=timeout).close()
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the debug server's front end did not answer {url}") from None
            time.sleep(0.2)


def load_batch(step, args, stalls):
    if stalls and step == args.hang_step:
        time.sleep(args.stall)  # stuck: a network disk, a dead data worker, a deadlock...
    return torch.full((args.size,), float(step), device="cpu")  # a host batch, as loaders make


def watchdog(urls, late, beats, done, report):
    """Rank 0's thread: once no step has ended for `late` seconds, read two pages and report."""
    while not done.wait(0.5):
        if time.monotonic() - beats[-1] < late:
            continue
        try:
            stacks, record = [read(url) for url in urls]
        except (OSError, ValueError):  # the front end is still starting up: try again
            continue
        status = {r: json.loads(text)["pg_status"]["0"] for r, text in record.items()}  # group 0
        issued = {r: int(s["last_enqueued_collective"]) for r, s in status.items()}
        where = {r: waits_at(text) for r, text in stacks.items()}
        for r in where:
            print(f"[watchdog] rank {r}: issued collective #{issued[r]}, waits at {where[r]}")
        report.update(issued=issued, where=where, behind=min(issued, key=issued.get))
        waited = time.monotonic() - beats[-1]
        print(f"[watchdog] no step for {waited:.1f} s; behind: rank {report['behind']}", flush=True)
        return


def read(url):
    """A page of the front end as {rank: text}: its "<h2>Rank N: ...</h2> ... <pre>TEXT</pre>"."""
    page = urllib.request.urlopen(url, timeout=30).read().decode()
    found = re.findall(r"<h2>Rank (\d+): .*?</h2>.*?<pre>(.*?)</pre>", page, re.S)
    return {int(rank): text for rank, text in found}


def waits_at(stacks):
    """The innermost frame of this file in the thread that runs main: where the rank waits."""
    for thread in re.split(r"\n\s*\n", stacks):
        frames = re.findall(r'File "(.+?)", line (\d+) in (\S+)', thread)
        ours = [f for f in frames if os.path.realpath(f[0]) == os.path.realpath(__file__)]
        if any(function == "main" for _, _, function in ours):
            path, line, function = ours[0]
            return f"{os.path.basename(path)}:{line} in {function}: {source(path, line)}"
    return "no thread of this file in main"


def source(path, line):
    with open(path) as f:
        return f.read().splitlines()[int(line) - 1].split("  #")[0].strip()


# ---- The lesson ends here. What follows is how it checks itself. ----


def line_of(function, text):
    """The line of `function` (in this file) that holds `text`."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def check_report(report, args, sums, world):
    stuck = world - 1 if args.stuck_rank is None else args.stuck_rank  # what the reader asked for
    if not report:
        raise RuntimeError(
            f"the watchdog read no pages while rank {stuck} slept {args.stall:g}s: the front end "
            "did not answer in time (a loaded machine: raise --stall)"
        )
    here = os.path.basename(__file__)
    sleeps = f"{here}:{line_of(load_batch, 'time.sleep')} in load_batch"
    waits = [f"{here}:{line_of(main, text)} in main" for text in ("all_reduce(", "sums.append")]
    lines = report["where"]
    if sorted(lines) != list(range(world)):
        raise RuntimeError(f"the stacks page shows ranks {sorted(lines)} of {world}")
    if report["behind"] != stuck:
        raise RuntimeError(f"the pages name rank {report['behind']}; rank {stuck} was to hang")
    wrong = {
        r: line
        for r, line in lines.items()
        if not (line.startswith(sleeps) if r == stuck else line.startswith(tuple(waits)))
    }
    if wrong:
        raise RuntimeError(f"rank {stuck} sleeps at {sleeps}, the others wait in main: {wrong}")
    issued, first = report["issued"], 1  # the port check's broadcast, then the steps' all_reduces
    others = {issued[r] for r in issued if r != stuck}
    if issued[stuck] != first + args.hang_step or others != {first + args.hang_step + 1}:
        raise RuntimeError(f"collectives issued per rank {issued}: stuck in {args.hang_step}")
    want = [float(step * args.size * world) for step in range(args.steps)]
    if sums != want:
        raise RuntimeError(f"the all_reduce sums {sums}, expected {want}")
    print(f"OK: the debug server's pages named rank {stuck}, the rank asked to hang, live")


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument("--stuck-rank", type=int_in(0, 4095), help="default: the last rank")
    parser.add_argument("--steps", type=int_in(1, 1000), default=4, help="training steps")
    parser.add_argument(
        "--hang-step",
        type=int_in(1, 999),
        default=2,
        help="the step that hangs (from 1: hung in step 0, Gloo's flight-record page showed no "
        "collective on any rank, torch 2.13)",
    )
    parser.add_argument(
        "--stall", type=float_in(1, 3600), default=10.0, help="seconds the stuck rank sleeps"
    )
    parser.add_argument(
        "--late",
        type=float_in(0.1, 3600),
        default=2.0,
        help="seconds without a step before rank 0's watchdog reads the pages",
    )
    parser.add_argument(
        "--port", type=int_in(1, 65535), default=25999, help="the front end's port (rank 0)"
    )
    parser.add_argument("--size", type=int_in(1, 1_000_000), default=4, help="elements reduced")
    args = parser.parse_args()
    run(main, args)
