"""Four ways to form a process group: env://, tcp://, file:// and an explicit store.

All four end in the same place: every rank holds a Store (a small key-value server)
through which the ranks find each other, then the backend connects them.
  env://    reads MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (what torchrun sets)
  tcp://    the address of rank 0 in the URL; rank and world size passed by hand
  file://   a file on a file system every rank sees (shared disk on a cluster)
  store=    a TCPStore you created yourself, e.g. to reuse it for your own keys

    torchrun --nproc_per_node=3 primitives/init_methods.py                 # all four in turn
    torchrun --nproc_per_node=3 primitives/init_methods.py --init-method file
    python primitives/init_methods.py --nproc 3 --init-method tcp

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.
Here run(main, args, init_process_group=False) leaves out the first: main forms each group.

Docs: https://pytorch.org/docs/stable/distributed.html#initialization
"""

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run

METHODS = ["env", "tcp", "file", "store"]


def small_job(rank, world_size, device):
    """All-reduce of the ranks and all-gather of rank**2: the same answer whatever the init."""
    total = torch.tensor([rank], device=device)
    dist.all_reduce(total)
    squares = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world_size)]
    dist.all_gather(squares, torch.tensor([rank * rank], device=device))
    return total.item(), [s.item() for s in squares]


def init(method, args, ctx):
    timeout = datetime.timedelta(seconds=args.timeout)
    device_id = None if ctx.device.type == "cpu" else ctx.device
    common = dict(backend=ctx.backend, timeout=timeout, device_id=device_id)
    by_hand = dict(rank=ctx.rank, world_size=ctx.world_size, **common)  # what env:// reads
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if method == "env":
        dist.init_process_group(init_method="env://", **common)
    elif method == "tcp":
        # Rank 0 serves a store at host:port and the others connect. torchrun's agent (its
        # parent process on each node) already serves a TCPStore, the agent store, at
        # MASTER_ADDR:MASTER_PORT (stores: see stores.py), and sets
        # TORCHELASTIC_USE_AGENT_STORE=True, which makes every rank a mere client of it; that
        # store still holds the keys of the env:// group above, and a second group formed there
        # would read them. So: a fresh store, served by rank 0, on the next port.
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        dist.init_process_group(init_method=f"tcp://{host}:{args.port or port + 1}", **by_hand)
    elif method == "file":
        dist.init_process_group(init_method=f"file://{file_path(args)}", **by_hand)
    elif method == "store":  # our own store object: we can also use it for our own keys
        at = (args.port or port + 1) + 1
        store = dist.TCPStore(host, at, ctx.world_size, is_master=ctx.rank == 0, timeout=timeout)
        dist.init_process_group(store=store, **by_hand)
    return f"{method}:// " if method != "store" else "store=TCPStore "


def file_path(args):
    # Every rank must name the same file, and it must be new: a FileStore file left over
    # from an earlier run still holds that run's keys and rank counter, so the next run
    # would read stale values and fail or hang. One name per run, removed at the end (below).
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "spawn")
    name = f"init_methods_{os.environ['MASTER_PORT']}_{run_id}"
    return args.file or os.path.join(tempfile.gettempdir(), name)


def remove_store_file(args, rank):
    # torch deletes the file when the last rank's FileStore is destroyed, best effort: the
    # destructor bumps two counters in two steps, and in some orders no rank sees itself last,
    # so the file stays (~FileStore in torch/csrc/distributed/c10d/FileStore.cpp, torch 2.13).
    # So we delete it while the group is up, after the barrier in main (nobody reads the store
    # any more); after the barrier here every destructor finds no file and returns at once (a
    # group's collectives do not use the store).
    if rank == 0:
        os.remove(file_path(args))
    dist.barrier()


def main(args, ctx):
    # Up to four inits in one process, only to compare the methods: the docs call re-init
    # "unsupported/untested" (distributed.html#reinitialization), so each group is destroyed
    # after a barrier and the next uses a fresh store.
    methods = METHODS if args.init_method == "all" else [args.init_method]
    folder = os.path.dirname(os.path.abspath(args.file or tempfile.gettempdir() + "/x"))
    ctx.require(
        os.path.isdir(folder) and os.access(folder, os.W_OK),
        f"--file {args.file}: {folder} is not a writable directory",
    )
    for method in methods:
        how = init(method, args, ctx)
        try:
            result = small_job(ctx.rank, ctx.world_size, ctx.device)
            print_in_order(
                f"{how:16} rank {dist.get_rank()}/{dist.get_world_size()} "
                f"sum of ranks {result[0]}, squares {result[1]}"
            )
            check_same_answer(method, result, ctx.world_size)
            dist.barrier()  # nobody tears its group down while others still use it
            if method == "file":
                remove_store_file(args, ctx.rank)
        finally:
            dist.destroy_process_group()
    total, squares = expected(ctx.world_size)
    print0(f"OK: init by {', '.join(methods)} gave the same result: sum {total}, squares {squares}")


# ---- The lesson ends here. What follows is how it checks itself. ----


def expected(world_size):
    """small_job's answer, by hand: 0 + 1 + ... + (n-1), and every rank's square."""
    return world_size * (world_size - 1) // 2, [r * r for r in range(world_size)]


def check_same_answer(method, result, world_size):
    if result != expected(world_size):
        raise RuntimeError(f"{method}: got {result}, expected {expected(world_size)}")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--init-method", choices=METHODS + ["all"], default="all")
    parser.add_argument(
        "--port",
        type=int_in(1, 65534),
        help="port for tcp:// (default MASTER_PORT + 1); store= uses the next one",
    )
    parser.add_argument("--file", help="path for file:// (default: a fresh name in the temp dir)")
    run(main, parser.parse_args(), init_process_group=False)
