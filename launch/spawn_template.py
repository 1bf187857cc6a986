"""Starting the ranks yourself: mp.spawn, and a plain multiprocessing.Process loop.

torchrun is the launcher to reach for (restarts, rendezvous across machines, survivors stopped
when a rank fails); starting processes yourself suits one machine when the launch lives inside
Python (a notebook, a test, a program with other steps). All set up by hand, no shared module:
  --method spawn    torch.multiprocessing.spawn: N processes, join() waits; if one raises, the
                    others are terminated and the error is raised in the parent.
  --method process  the same by hand with mp.Process: start, poll exit codes, terminate the
                    rest on the first failure, report every exit code.

    python launch/spawn_template.py --nproc 3 --method spawn
    python launch/spawn_template.py --nproc 3 --method process --fail-rank 1   # exits 1, none left

Docs: https://pytorch.org/docs/stable/multiprocessing.html#spawning-subprocesses
"""

import argparse
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from launch.dist_setup import int_in


def worker(rank, world_size, port, fail_rank):
    if rank == fail_rank:  # a crash at start-up (a bad path, out of memory...)
        raise RuntimeError(f"rank {rank} fails on purpose (--fail-rank)")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # The others wait here for a rank that crashed, up to the timeout: the parent must stop them.
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    try:
        total = torch.tensor([rank + 1], device="cpu")  # this template is Gloo on CPU throughout
        dist.all_reduce(total)
        check_sum(rank, total, world_size)
    finally:
        dist.destroy_process_group()


def with_spawn(args, port):
    try:
        mp.spawn(worker, args=(args.nproc, port, args.fail_rank), nprocs=args.nproc, join=True)
        return 0
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
        # A rank raised or exited non-zero: mp.spawn terminated the others, then raised this.
        print(f"parent: a rank failed, mp.spawn stopped the rest: {last_line(error)}")
        return 1


def with_process(args, port):
    context = mp.get_context("spawn")  # never fork a process that may hold CUDA or threads
    job = (args.nproc, port, args.fail_rank)
    procs = [context.Process(target=worker, args=(rank, *job)) for rank in range(args.nproc)]
    for p in procs:
        p.start()
    while any(p.exitcode is None for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):  # one failed: the others would wait
            for p in procs:  # in a collective until the timeout (an ended one ignores terminate)
                p.terminate()
            break
        time.sleep(0.1)
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    print(f"parent: exit codes by rank {codes} (negative: stopped by that signal)")
    return 0 if all(c == 0 for c in codes) else 1


def main(args):
    with socket.socket() as s:  # a free port, held until the ranks end (dist_setup.reserve_port)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return (with_spawn if args.method == "spawn" else with_process)(args, s.getsockname()[1])


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_sum(rank, total, world_size):
    expected = world_size * (world_size + 1) // 2
    if total.item() != expected:
        raise RuntimeError(f"rank {rank}: sum {total.item()}, expected {expected}")
    # One write: the ranks' lines never mix.
    sys.stdout.write(f"rank {rank}: all_reduce of rank+1 = {total.item()}\n")
    sys.stdout.flush()


def last_line(error):
    """The last line of a rank's traceback, as mp.spawn hands it on."""
    return str(error).strip().splitlines()[-1]


def exit_with(code, args):
    if code == 0:
        print(f"OK: {args.nproc} rank(s) started with {args.method}, joined, all exit codes 0")
    sys.exit(code)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int_in(1, 64), default=2, help="ranks to start")
    parser.add_argument("--method", choices=["spawn", "process"], default="spawn")
    parser.add_argument(
        "--fail-rank", type=int_in(0, 63), help="this rank raises, to show error handling"
    )
    args = parser.parse_args()
    if args.fail_rank is not None and args.fail_rank >= args.nproc:
        parser.error(f"--fail-rank {args.fail_rank}: there are only ranks 0..{args.nproc - 1}")
    exit_with(main(args), args)
