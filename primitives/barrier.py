"""barrier: no rank leaves until every rank has arrived.

The classic use: one rank per node prepares something on disk (downloads a data set,
writes a cache), the others wait at a barrier and only then read it. Here local rank 0
sleeps --delay seconds, then writes a file; every rank reads it right after the barrier.
Without the barrier the readers would look before the file exists, and fail.
Also: monitored_barrier (Gloo only), which names the ranks that did not arrive in time.

    torchrun --nproc_per_node=4 primitives/barrier.py
    python primitives/barrier.py --nproc 3 --delay 1

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.barrier
      https://pytorch.org/docs/stable/distributed.html#torch.distributed.monitored_barrier
"""

import datetime
import os
import tempfile
import time
import uuid

import torch.distributed as dist
from launch.dist_setup import float_in, lesson_parser, print0, print_in_order, run


def prepare(path, delay, rank):
    time.sleep(delay)  # stands for a download
    with open(path + ".tmp", "w") as f:
        f.write(f"prepared by rank {rank}")
    os.replace(path + ".tmp", path)  # atomic: a reader sees all of it or nothing


def main(args, ctx):
    # broadcast_object_list: broadcast for picklable Python objects (object_collectives.py); here
    # rank 0's file name, so that every rank uses the same one.
    names = [uuid.uuid4().hex if ctx.rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    path = os.path.join(tempfile.gettempdir(), f"barrier_demo_{names[0]}.txt")  # one per node

    try:
        start = time.perf_counter()
        if ctx.local_rank == 0:  # the node's preparer
            prepare(path, args.delay, ctx.rank)
        dist.barrier()  # nobody reads before the preparer has written
        seen = read_prepared(path, ctx.rank)
        print_in_order(f"left the barrier after {time.perf_counter() - start:.2f}s: {seen!r}")

        if ctx.backend == "gloo":
            # Rank 0 collects an acknowledgement from each rank; on timeout it raises an error
            # that lists the missing ranks (a hang made readable). Costs more than barrier().
            dist.monitored_barrier(
                timeout=datetime.timedelta(seconds=args.timeout), wait_all_ranks=True
            )
            print0("monitored_barrier: all ranks acknowledged")
        else:
            print0(f"monitored_barrier: skipped, Gloo only ({ctx.backend} here)")

        dist.barrier()  # every rank has read the file: the preparer may delete it
    finally:
        if ctx.local_rank == 0 and os.path.exists(path):
            os.remove(path)
    print0(
        f"OK: all {ctx.world_size} ranks waited at the barrier and read the file local rank 0 "
        f"wrote after {args.delay:g}s"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def read_prepared(path, rank):
    """The file's text; a reader that finds no file was let through too early."""
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        raise RuntimeError(
            f"rank {rank}: {path} does not exist yet: nothing made this rank wait"
        ) from None


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--delay",
        type=float_in(0, 600),
        default=0.5,
        help="seconds local rank 0 takes to prepare (0: none)",
    )
    run(main, parser.parse_args())
