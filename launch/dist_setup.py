"""The set-up every lesson shares; copy it into your project as launch/dist_setup.py, unchanged.

    from launch.dist_setup import lesson_parser, print0, run

    def main(args, ctx):  # ctx: rank, world_size, local_rank, local_world_size, device, backend
        print0("OK")

    run(main, lesson_parser(__doc__).parse_args())  # under if __name__ == "__main__":

Under torchrun, run() picks each rank's device (a GPU each and NCCL if every local rank has one,
else CPU and Gloo), starts the process group with a bounded timeout, runs main and destroys the
group on every path. On CPU a rank computes with (cores - 1) // (ranks on this machine) threads, at
least 1: one core stays free, since a thread that waits for a core held by another busy process
stalls every op of its rank (tools/cpu_threads.py measures it; on a machine of your own, drop the
`- 1`). Plain `python lesson.py --nproc N` starts N ranks through launch/local_ranks.py.
"""

import argparse
import datetime
import functools
import gc
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Before init_process_group: imported after it (DDP does, through torch._dynamo), its functions'
# `group=group.WORLD` defaults hold the group past destroy_process_group (primitives/README.md).
import torch.distributed.nn  # noqa: F401


class UsageError(Exception):
    """The lesson was started wrongly: each rank prints one line and exits with code 2."""


def _ranged(kind, low, high, low_open=False):
    """An argparse type: a finite `kind` in [low, high], or (low, high]; --help shows the range."""
    noun, where = "an integer" if kind is int else "a number", f"[{low}, {high}]"
    where = where.replace("[", "(", low_open)

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = float("nan")  # compares False with everything: refused below
        if not (low < value <= high if low_open else low <= value <= high):
            raise argparse.ArgumentTypeError(f"{text} is not {noun} in {where}")
        return value

    parse.__name__, parse.high = f"{noun} in {where}", high
    return parse


int_in = functools.partial(_ranged, int)  # int_in(1, 100): an integer in [1, 100]
float_in = functools.partial(_ranged, float)  # float_in(0, 1, low_open=True): a number in (0, 1]


class _HelpWithRanges(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):  # each flag's range (its type's name) and default
        help, ranged = action.help or "", hasattr(action.type, "high")
        shown = action.default not in (None, False, argparse.SUPPRESS) and "default" not in help
        return help + " (%(type)s)" * ranged + " (default: %(default)s)" * shown


def lesson_parser(doc, min_ranks=1):
    """argparse with the set-up flags; min_ranks: the fewest ranks the lesson runs at."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=_HelpWithRanges)
    parser.set_defaults(min_ranks=min_ranks)
    add, env = parser.add_argument_group("distributed set-up").add_argument, os.environ.get
    add("--nproc", type=int_in(1, 4096),
        help="plain python only: ranks to start (default: one per GPU, else 2)")  # fmt: skip
    add("--backend", default=env("DIST_BACKEND"),
        help="gloo or nccl (env DIST_BACKEND; default: nccl with a GPU a rank)")  # fmt: skip
    add("--device", default=env("DIST_DEVICE"),
        help="cpu or cuda (env DIST_DEVICE; default: the backend's)")  # fmt: skip
    add("--timeout", type=float_in(0, 86_400, low_open=True), default=env("DIST_TIMEOUT", "60"),
        help="seconds a collective may wait before it fails (env DIST_TIMEOUT)")  # fmt: skip
    return parser


def choose_device(local_rank, local_world_size, backend=None, device=None):
    """(torch.device, backend) for this rank: a GPU each and NCCL if there are enough, else CPU."""
    accel = torch.accelerator.current_accelerator()  # the build's: cuda even with no GPU here
    gpus = torch.accelerator.device_count() if accel is not None else 0
    asked = f"--device {device}" if device else f"--backend {backend}"
    if device is None and backend is None:
        device = accel.type if accel is not None and gpus >= local_world_size else "cpu"
    elif device is None:
        device = "cpu" if backend in ("gloo", "mpi") else getattr(accel, "type", "cuda")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise UsageError(f"unknown device {device!r}: use cpu or cuda") from None
    if kind != "cpu" and (accel is None or accel.type != kind or gpus == 0):
        raise UsageError(f"{asked} needs a {kind} device and this machine has none: use gloo")
    backend = backend or dist.get_default_backend_for_device(kind)
    if not dist.is_backend_available(backend):
        raise UsageError(f"backend {backend!r} is not in this build of torch: use --backend gloo")
    if kind != "cpu" and backend != "gloo" and gpus < local_world_size:
        raise UsageError(
            f"{local_world_size} ranks on this node but only {gpus} {kind} device(s): {backend}"
            f" needs one per rank; start at most {gpus} per node or use --backend gloo"
        )
    return torch.device(kind, local_rank % gpus) if kind != "cpu" else torch.device(kind), backend


@dataclass(frozen=True)
class Context:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    def require(self, ok, message):
        """A start condition: if not ok, every rank prints one line and exits with code 2."""
        if not ok:
            raise UsageError(message)


def run(main, args, init_process_group=True):
    """Run main(args, ctx) on this rank; init_process_group=False leaves the init to main."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:  # plain python, no launcher
        try:
            from launch.local_ranks import start
        except ImportError:
            sys.exit(f"error: start it with torchrun --nproc_per_node=N {sys.argv[0]} (no RANK)")
        return start(run, main, args, init_process_group)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    try:
        device, backend = choose_device(local_rank, local_world_size, args.backend, args.device)
        if device.type == "cpu":  # the ranks share the cores but one: see the docstring
            torch.set_num_threads(max(1, (len(os.sched_getaffinity(0)) - 1) // local_world_size))
        else:
            torch.accelerator.set_device_index(device.index)
        if init_process_group:  # device_id binds NCCL's communicator to this GPU (not Gloo's)
            timeout = datetime.timedelta(seconds=args.timeout)
            bind = device if backend == "nccl" else None
            dist.init_process_group(backend, timeout=timeout, device_id=bind)
        gpus = torch.accelerator.device_count()  # say why a GPU node runs on its CPU
        why = f" ({local_world_size} ranks/node > {gpus} GPUs)" if gpus < local_world_size else ""
        why = why if gpus and device.type == "cpu" else ""
        print0(f"[setup] {world_size} rank(s), backend {backend}, device {device.type}{why}, "
               f"timeout {args.timeout:g}s, torch {torch.__version__}")  # fmt: skip
        main(args, Context(rank, world_size, local_rank, local_world_size, device, backend))
    except UsageError as error:
        _write(f"[rank {rank}] error: {error}", sys.stderr)
        if world_size > 1:  # torchrun ends every rank when one exits: let the others print too
            time.sleep(3)
        sys.exit(2)
    finally:
        if dist.is_initialized():
            gc.collect()  # DDP and FSDP objects sit in reference cycles: free them first
            dist.destroy_process_group()


def _write(text, stream=None):
    # One write call per line: print(a, b) writes piece by piece, and the pieces of several ranks
    # mix on a shared pipe. A write to a pipe of at most PIPE_BUF bytes is never mixed with others:
    # POSIX promises 512 bytes, Linux gives 4,096 (man 7 pipe); a longer line may be split.
    stream = stream or sys.stdout
    stream.write(text + "\n")
    stream.flush()


def _rank():
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def print_rank(*values):
    """Print one line prefixed with this rank."""
    _write(" ".join(map(str, (f"[rank {_rank()}]", *values))))


def print0(*values):
    """Print on rank 0 only."""
    if _rank() == 0:
        _write(" ".join(map(str, values)))


def print_in_order(*values, group=None):
    """Every rank of group calls this; its first rank prints all lines in rank order."""
    text = "\n".join(f"[rank {_rank()}] {line}" for line in " ".join(map(str, values)).split("\n"))
    first = dist.get_global_rank(group, 0) if group is not None else 0
    lines = [None] * dist.get_world_size(group) if dist.get_rank() == first else None
    dist.gather_object(text, lines, dst=first, group=group)  # pickles: fine between our own ranks
    if lines is not None:
        _write("\n".join(lines))
