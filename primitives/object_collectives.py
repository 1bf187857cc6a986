"""Object collectives: send any picklable Python object (dicts, strings, lists) between ranks.

  broadcast_object_list(objs, src)       objs on src copied into objs everywhere
  all_gather_object(out, obj)            out[r] = rank r's obj, on every rank
  gather_object(obj, out, dst)           the same, on dst only (others pass None)
  scatter_object_list(out, in, src)      out[0] = in[r] on rank r

They pickle the object, send the bytes as a tensor (two collectives: sizes, then data),
and unpickle. Unpickling runs code chosen by the sender: use them only between your own
trusted ranks, never on data from elsewhere. They are also slower than the tensor
collectives: measured below against all_gather of the same numbers as a tensor.

    torchrun --nproc_per_node=3 primitives/object_collectives.py
    python primitives/object_collectives.py --nproc 2 --numbers 100000

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_gather_object
"""

import time

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run

CONFIG = {"lr": 0.1, "layers": [64, 64], "note": "from rank 0"}


def report(rank):
    """What rank r has to say: any picklable object."""
    return {"rank": rank, "name": f"worker-{rank}", "values": [100 * rank + i for i in range(3)]}


def main(args, ctx):
    rank, world = ctx.rank, ctx.world_size

    config = [CONFIG if rank == 0 else None]
    dist.broadcast_object_list(config, src=0)
    everyone = [None] * world
    dist.all_gather_object(everyone, report(rank))
    at_zero = [None] * world if rank == 0 else None
    dist.gather_object(report(rank), at_zero, dst=0)
    mine = [None]
    tasks = [f"task for rank {r}: shard {r} of {world}" for r in range(world)]
    dist.scatter_object_list(mine, tasks if rank == 0 else None, src=0)

    print_in_order(
        f"broadcast {config[0]}\nall_gather_object {everyone}\n"
        f"gather_object {at_zero if rank == 0 else '(not dst)'}\nscatter_object_list {mine[0]!r}"
    )
    check_objects(config[0], everyone, at_zero, mine[0], rank, world)

    # Cost: the same numbers as a Python list through all_gather_object, and as a tensor.
    numbers = [float(100 * rank + i) for i in range(args.numbers)]
    as_tensor = torch.tensor(numbers, device=ctx.device)

    def by_object():
        out = [None] * world
        dist.all_gather_object(out, numbers)
        return out

    def by_tensor():
        out = torch.empty(world * args.numbers, device=ctx.device)
        dist.all_gather_single(out, as_tensor)
        return out

    times = {
        "all_gather_object": best_time(by_object, args, ctx),
        "all_gather (tensor)": best_time(by_tensor, args, ctx),
    }
    slower = print_times(times, args)
    print0(
        f"OK: broadcast_object_list, all_gather_object, gather_object and scatter_object_list "
        f"moved Python objects among {world} ranks; the object all_gather took {slower:.1f}x "
        "the tensor one"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_objects(config, everyone, at_zero, mine, rank, world):
    """Each result against the objects built by hand."""
    expected = [report(r) for r in range(world)]
    if config != CONFIG:
        raise RuntimeError(f"broadcast_object_list gave {config}")
    if everyone != expected:
        raise RuntimeError(f"all_gather_object gave {everyone}")
    if rank == 0 and at_zero != expected:
        raise RuntimeError(f"gather_object gave {at_zero}")
    if mine != f"task for rank {rank}: shard {rank} of {world}":
        raise RuntimeError(f"scatter_object_list gave {mine!r}")


def best_time(fn, args, ctx):
    """Best of args.repeat timed calls, after a warm-up (first calls pay for allocations and
    connections); checks that fn gathered every rank's numbers."""
    fn()
    best = float("inf")
    for _ in range(args.repeat):
        dist.barrier()
        start = time.perf_counter()
        got = fn()
        if ctx.device.type != "cpu":
            torch.accelerator.synchronize()
        best = min(best, time.perf_counter() - start)
    if torch.is_tensor(got):
        got = got.view(ctx.world_size, args.numbers).tolist()
    if got != [[float(100 * r + i) for i in range(args.numbers)] for r in range(ctx.world_size)]:
        raise RuntimeError(f"{fn.__name__} gathered the wrong numbers")
    return best


def print_times(times, args):
    slower = times["all_gather_object"] / times["all_gather (tensor)"]
    print0(
        f"{args.numbers} floats per rank, best of {args.repeat}: "
        + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in times.items())
        + f"; the object version took {slower:.1f}x the time"
    )
    return slower


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--numbers", type=int_in(1, 10_000_000), default=10000, help="floats per rank in the timing"
    )
    parser.add_argument(
        "--repeat", type=int_in(1, 1000), default=3, help="timed runs; the best is printed"
    )
    run(main, parser.parse_args())
