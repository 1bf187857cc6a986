"""`python lesson.py --nproc N`: start the N ranks on this machine, without torchrun.

launch/dist_setup.py's run() imports this only when no launcher set RANK and WORLD_SIZE; a lesson
copied out with dist_setup.py alone runs under torchrun and says so when started with plain python.
Each rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR=127.0.0.1, MASTER_PORT: a free port) and calls run() again, which now finds them.
launch/spawn_template.py teaches the same thing step by step.
"""

import multiprocessing
import os
import socket
import sys

import torch
import torch.multiprocessing as mp

# Imported once by the forkserver, so that each rank is forked with them already imported: those
# of them the lesson imported, and the modules named in DIST_PRELOAD (comma-separated), for example
# torch._dynamo, which every optimizer, DDP and DeviceMesh import in each rank. Measured on the
# idle 2-core machine, torch 2.13.0+cpu, 2026-11-26 (CONTRIBUTING.md, README.md): `import torch`
# takes 2.9 to 3.5 CPU-s in a process; ddp_minimal.py at 4 ranks took 16.8 CPU-s, and 10.9 with
# DIST_PRELOAD=torch._dynamo (about 2 CPU-s saved per rank beyond the server's own import).
PRELOAD = ["torch", "numpy"] + [
    f"torch.distributed.{name}" for name in ("tensor", "fsdp", "checkpoint", "pipelining")
]


def default_nproc(args):
    """One rank per GPU, else 2, and at least the lesson's min_ranks (a lesson that needs a peer
    still runs on a 1-GPU machine: its 2 ranks fall back to CPU + Gloo)."""
    wants_cpu = args.backend == "gloo" or args.device == "cpu"
    gpus = torch.accelerator.device_count() if not wants_cpu else 0
    return max(gpus or 2, getattr(args, "min_ranks", 1))


def reserve_port():
    """A socket bound to a free port of 127.0.0.1, not listening. Keep it open until the ranks
    have started: while it is bound the OS hands that port to no other process (a port picked and
    released at once can be taken by another program before rank 0 listens on it, seconds later:
    EADDRINUSE). Rank 0's store can still bind it, because both sockets set SO_REUSEADDR (torch's
    TCPStore does)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


def _rank(local_rank, run, main, args, nproc, port, init):
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    run(main, args, init)  # the launcher's path of run(): exits with the rank's code


def start(run, main, args, init_process_group=True):
    """Start args.nproc ranks, each calling run(main, args); exit with the first failure's code."""
    nproc = args.nproc if args.nproc is not None else default_nproc(args)
    held = None if os.environ.get("MASTER_PORT") else reserve_port()
    port = int(os.environ["MASTER_PORT"]) if held is None else held.getsockname()[1]
    with socket.socket() as s:  # a named port that is taken fails here, not in a rank
        if held is None and s.connect_ex(("127.0.0.1", port)) == 0:
            sys.exit(
                f"error: port {port} on 127.0.0.1 is in use: unset MASTER_PORT or pick a free one"
            )
    # forkserver, not spawn: one server process imports torch once and each rank is forked from
    # it, torch already imported. Safe with CUDA: the server never touches the GPU. The server
    # must be told what to import: Python's own "preload __main__" never happens (CPython 3.11
    # forkserver.py asks get_preparation_data for 'main_path', a key it never sets), so each rank
    # would import the lesson, and torch, by itself.
    # https://docs.python.org/3/library/multiprocessing.html#contexts-and-start-methods
    extra = [m for m in os.environ.get("DIST_PRELOAD", "").split(",") if m.strip()]
    preload = [m for m in PRELOAD if m in sys.modules] + [m.strip() for m in extra]
    multiprocessing.set_forkserver_preload(preload)
    try:
        mp.start_processes(
            _rank,
            args=(run, main, args, nproc, port, init_process_group),
            nprocs=nproc,
            start_method="forkserver",
        )
    except mp.ProcessExitedException as error:  # the rank printed its own error; pass its code on
        sys.exit(error.exit_code if error.exit_code and error.exit_code > 0 else 1)
    except mp.ProcessRaisedException as error:  # a bug: show the rank's traceback once
        sys.exit(f"{error}")
    finally:
        if held is not None:
            held.close()
