"""The setup every lesson shares (primitives/hello_distributed.py does it all by hand).

    from launch.dist_setup import lesson_parser, run, print0

    def main(args, ctx):            # ctx: rank, world_size, local_rank, device, backend
        ...
        print0("OK: ...")

    run(main, lesson_parser(__doc__).parse_args())    # last, under if __name__ == "__main__"

Under torchrun it reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT. Started as `python lesson.py --nproc N` it starts N processes itself,
rendezvous on a free port of 127.0.0.1. Either way each rank picks its device and backend
(CUDA+NCCL when every local rank has a GPU of its own, else CPU+Gloo; --backend/--device
or DIST_BACKEND/DIST_DEVICE override), initialises the process group with a bounded
timeout, runs main(args, ctx) and destroys the group on every path. The device choice lives in
launch/devices.py, the print helpers in launch/printing.py and the flags' ranged types in
launch/argtypes.py; lessons import all of them from here. A lesson copied out of this repository
replaces this import with the block in launch/README.md ("Copying a lesson into your project";
tests/test_copy_out.py runs lessons copied out that way under torchrun).

How the test suite runs the lessons (CONTRIBUTING.md, "Tests"): real torchrun runs the launch
tests (tests/test_launch.py, tests/test_launch_cluster.py) and one lesson per folder, the folder's
first lesson on the core path (primitives/all_reduce.py, ddp_basics/ddp_minimal.py,
fsdp_basics/fsdp_minimal.py, transformer_basics/train.py), at two world sizes. Every other lesson
runs once as `python lesson.py --nproc N` (this module's spawn path) and at its other world sizes
through the suite's warm launcher (tests/warm_launcher.py), which gives each rank the environment
torchrun gives it and reaches _run_rank the same way. So not every lesson runs under torchrun in
the suite: what torchrun adds (its agent, restarts, rendezvous) is tested on the launch lessons.
"""

import argparse
import datetime
import gc
import multiprocessing
import os
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launch.argtypes import existing_file, float_in, int_in, ints_in  # noqa: F401
from launch.devices import UsageError, choose_device, cores, default_nproc

# The lessons import these from here (F401: imported, not used in this file).
from launch.printing import _write, print0, print_in_order, print_rank  # noqa: F401

# What a lesson may import that costs seconds: the forkserver imports those the lesson did (run),
# and those named in DIST_PRELOAD (comma-separated): torch._dynamo, say, which every optimizer,
# DDP and DeviceMesh import in each rank (4 s of CPU per rank on a small machine, torch 2.13).
_PRELOAD = ["torch", "numpy"] + [
    f"torch.distributed.{name}" for name in ("tensor", "fsdp", "checkpoint", "pipelining")
]


@dataclass(frozen=True)
class Context:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    def require(self, ok, message):
        """Stop every rank with a one-line message when a start condition fails."""
        if not ok:
            raise UsageError(message)

    def require_writable_dir(self, path):
        """Make directory `path` if needed and check that this rank can write a file in it (every
        rank checks: on several machines each has its own disk), before any work is done."""
        try:
            os.makedirs(path, exist_ok=True)
            probe = os.path.join(path, f".write_test_{os.getpid()}")
            open(probe, "w").close()
            os.remove(probe)
        except OSError as error:
            raise UsageError(
                f"cannot write to {path} ({error.strerror}): pass a writable directory"
            ) from None

    def require_point_to_point(self):
        """send/recv/isend/irecv: NCCL takes CUDA tensors, Gloo CPU tensors only (the backend table
        of https://pytorch.org/docs/stable/distributed.html#backends), so Gloo with CUDA tensors
        cannot run them."""
        self.require(
            not (self.backend == "gloo" and self.device.type != "cpu"),
            f"point-to-point on gloo needs CPU tensors, not {self.device.type}: "
            "use --backend nccl (one GPU per rank) or --device cpu",
        )


class _HelpWithRanges(argparse.RawDescriptionHelpFormatter):
    """--help shows each flag's range (launch/argtypes.py) and default."""

    def _get_help_string(self, action):
        help, kind = action.help or "", getattr(action.type, "__name__", "")
        if kind.startswith(("an integer in", "a number in", "a comma-separated")):
            help += f" ({kind})"
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in help:
            help += " (default: %(default)s)"
        return help


def lesson_parser(doc, default_nproc=None, min_ranks=1):
    """min_ranks: `python lesson.py` with no --nproc starts at least this many ranks (one per GPU,
    else 2). Each flag's type gives its range (launch/argtypes.py)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=_HelpWithRanges)
    parser.set_defaults(min_ranks=min_ranks)
    env = os.environ.get
    group = parser.add_argument_group("distributed set-up (launch/dist_setup.py)")
    group.add_argument(
        "--nproc",
        type=int_in(1, 4096),
        default=default_nproc,
        help="ranks to spawn when started with plain python (default: one per GPU, else 2; "
        f"at least {max(min_ranks, 1)})",
    )
    group.add_argument(
        "--backend",
        default=env("DIST_BACKEND"),
        help="gloo or nccl (env DIST_BACKEND; default: nccl if every local rank has a GPU, "
        "else gloo)",
    )
    group.add_argument(
        "--device",
        default=env("DIST_DEVICE"),
        help="cpu or cuda (env DIST_DEVICE; default follows the backend)",
    )
    group.add_argument(
        "--timeout",
        type=float_in(0, 86_400, low_open=True),
        default=env("DIST_TIMEOUT", "60"),
        help="seconds a collective may wait before it fails (env DIST_TIMEOUT)",
    )
    return parser


def _run_rank(main, args, init=True):
    """Run main on this process as one rank; return the exit code."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    try:
        device, backend = choose_device(local_rank, local_world_size, args.backend, args.device)
        if device.type == "cpu":  # share the cores, so that N ranks do not fight over them
            torch.set_num_threads(max(1, cores() // local_world_size))
        else:
            torch.accelerator.set_device_index(device.index)
        if init:
            dist.init_process_group(
                backend,
                timeout=datetime.timedelta(seconds=args.timeout),
                device_id=None if device.type == "cpu" else device,
            )
        if rank == 0:
            gpus = torch.accelerator.device_count()
            auto_cpu = device.type == "cpu" and gpus and not (args.backend or args.device)
            why = f" ({local_world_size} ranks/node > {gpus} GPUs)" if auto_cpu else ""
            _write(
                f"[setup] {world_size} rank(s), backend {backend}, device {device.type}{why}, "
                f"timeout {args.timeout:g}s, torch {torch.__version__}"
            )  # one write: see _write
        main(args, Context(rank, world_size, local_rank, local_world_size, device, backend))
        return 0
    except UsageError as error:
        sys.stderr.write(f"[rank {rank}] error: {error}\n")  # one write: ranks' lines never mix
        sys.stderr.flush()
        # torchrun and mp.spawn stop every rank when one exits: let the others print first (3 s:
        # 1 s was too short once for a rank still starting, with the suite loading 2 cores)
        if world_size > 1:
            time.sleep(3)
        return 2
    finally:
        if dist.is_initialized():
            # free DDP/FSDP objects (they sit in reference cycles) while their group is up
            gc.collect()
            dist.destroy_process_group()


def _spawned(local_rank, main, args, nproc, port, init):
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    code = _run_rank(main, args, init)
    if code:
        sys.exit(code)


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


def run(main, args, init_process_group=True):
    """Run main(args, ctx) on every rank: under torchrun as is, else spawn args.nproc ranks.

    init_process_group=False leaves the init to main (primitives/init_methods.py).
    """
    # torchrun, Slurm + torchrun, a platform
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        sys.exit(_run_rank(main, args, init_process_group))
    nproc = args.nproc if args.nproc is not None else default_nproc(args)
    held = None if os.environ.get("MASTER_PORT") else reserve_port()
    port = int(os.environ["MASTER_PORT"]) if held is None else held.getsockname()[1]
    with socket.socket() as s:  # a named port that is taken fails here, not in a rank
        if held is None and s.connect_ex(("127.0.0.1", port)) == 0:
            sys.exit(
                f"error: port {port} on 127.0.0.1 is in use: unset MASTER_PORT or pick a free one"
            )
    # forkserver, not spawn: one server process imports torch once and each rank is forked from
    # it, torch already imported (~2.5 s of CPU saved per rank). Safe with CUDA: the server never
    # touches the GPU. The server must be told what to import: Python's own "preload __main__"
    # never happens (CPython 3.11 forkserver.py asks get_preparation_data for 'main_path', a key
    # it never sets), so each rank would import the lesson, and torch, by itself.
    # https://docs.python.org/3/library/multiprocessing.html#contexts-and-start-methods
    extra = [m for m in os.environ.get("DIST_PRELOAD", "").split(",") if m]
    multiprocessing.set_forkserver_preload([m for m in _PRELOAD if m in sys.modules] + extra)
    try:
        mp.start_processes(
            _spawned,
            args=(main, args, nproc, port, init_process_group),
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
