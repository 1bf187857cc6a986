"""Starting the ranks yourself: mp.spawn, and a plain multiprocessing.Process loop.

torchrun is the launcher to reach for: it restarts, rendezvous across machines, and kills
the survivors when one rank fails. Starting processes yourself suits a single machine
when the launch must live inside Python: a notebook, a test, a program that starts a
distributed job as one step among others. Two ways, both here (no shared module, so
every line is visible):
  --method spawn    torch.multiprocessing.spawn: starts N processes, join() waits, and if one
                    raises, the others are terminated and the error is raised in the parent.
  --method process  the same by hand with mp.Process: start, then poll exit codes; on the
                    first failure terminate the rest; report every exit code.

    python launch/spawn_template.py --nproc 3 --method spawn
    python launch/spawn_template.py --nproc 3 --method process --fail-rank 1     # exits 1, no rank left

Docs: https://pytorch.org/docs/stable/multiprocessing.html#spawning-subprocesses
"""

import argparse
import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world_size, port, fail_rank):
    if rank == fail_rank:  # a crash at start-up (a bad path, out of memory...): the others will
        raise RuntimeError(f"rank {rank} fails on purpose (--fail-rank)")  # wait for it in init
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # The others wait here for a rank that never comes, up to the timeout: the parent must stop them.
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=30)
    )
    try:
        total = torch.tensor([rank + 1], device="cpu")  # this template is Gloo on CPU throughout
        dist.all_reduce(total)
        expected = world_size * (world_size + 1) // 2
        if total.item() != expected:
            raise RuntimeError(f"rank {rank}: sum {total.item()}, expected {expected}")
        sys.stdout.write(
            f"rank {rank}: all_reduce of rank+1 = {total.item()}\n"
        )  # one write: lines never mix
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()


def with_spawn(args, port):
    try:
        mp.spawn(worker, args=(args.nproc, port, args.fail_rank), nprocs=args.nproc, join=True)
        return 0
    except mp.ProcessRaisedException as error:  # a rank raised: the others were terminated
        print(
            f"parent: a rank failed, mp.spawn stopped the rest: {str(error).strip().splitlines()[-1]}"
        )
        return 1
    except mp.ProcessExitedException as error:
        print(
            f"parent: rank {error.error_index} exited with code {error.exit_code}; the rest were stopped"
        )
        return 1


def with_process(args, port):
    context = mp.get_context("spawn")  # never fork a process that may hold CUDA or threads
    procs = [
        context.Process(target=worker, args=(rank, args.nproc, port, args.fail_rank))
        for rank in range(args.nproc)
    ]
    for p in procs:
        p.start()
    while any(p.exitcode is None for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):  # one failed: the others would wait
            for p in procs:  # in a collective until the timeout
                if p.exitcode is None:
                    p.terminate()
            break
        time.sleep(0.1)
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    print(f"parent: exit codes by rank {codes} (negative: stopped by that signal)")
    return 0 if all(c == 0 for c in codes) else 1


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--method", choices=["spawn", "process"], default="spawn")
    parser.add_argument(
        "--fail-rank", type=int, default=-1, help="this rank raises, to show error handling"
    )
    args = parser.parse_args()
    if args.nproc < 1:
        sys.exit("error: --nproc must be at least 1")
    with (
        socket.socket() as s
    ):  # a free port, held until the ranks have ended (see dist_setup.reserve_port)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        code = (with_spawn if args.method == "spawn" else with_process)(args, s.getsockname()[1])
    if code == 0:
        print(f"OK: {args.nproc} rank(s) started with {args.method}, joined, all exit codes 0")
    sys.exit(code)


if __name__ == "__main__":
    main()
