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

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_gather_object
"""

import time

import torch
import torch.distributed as dist
from launch.dist_setup import lesson_parser, print0, print_in_order, run


def report(rank):
    """What rank r has to say: any picklable object."""
    return {"rank": rank, "name": f"worker-{rank}", "values": [100 * rank + i for i in range(3)]}


def main(args, ctx):
    rank, world = ctx.rank, ctx.world_size
    expected = [report(r) for r in range(world)]  # the full data, built by hand

    config = [{"lr": 0.1, "layers": [64, 64], "note": "from rank 0"} if rank == 0 else None]
    dist.broadcast_object_list(config, src=0)
    if config[0] != {"lr": 0.1, "layers": [64, 64], "note": "from rank 0"}:
        raise RuntimeError(f"broadcast_object_list gave {config[0]}")

    everyone = [None] * world
    dist.all_gather_object(everyone, report(rank))
    if everyone != expected:
        raise RuntimeError(f"all_gather_object gave {everyone}")

    at_zero = [None] * world if rank == 0 else None
    dist.gather_object(report(rank), at_zero, dst=0)
    if rank == 0 and at_zero != expected:
        raise RuntimeError(f"gather_object gave {at_zero}")

    mine = [None]
    tasks = (
        [f"task for rank {r}: shard {r} of {world}" for r in range(world)] if rank == 0 else None
    )
    dist.scatter_object_list(mine, tasks, src=0)
    if mine[0] != f"task for rank {rank}: shard {rank} of {world}":
        raise RuntimeError(f"scatter_object_list gave {mine[0]!r}")

    print_in_order(
        f"broadcast {config[0]}\nall_gather_object {everyone}\n"
        f"gather_object {at_zero if rank == 0 else '(not dst)'}\nscatter_object_list {mine[0]!r}"
    )

    # Cost: the same numbers as a Python list through all_gather_object, and as a tensor.
    all_gather_single = (
        getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    )  # pre-2.13 name
    numbers = [float(100 * rank + i) for i in range(args.numbers)]
    as_tensor = torch.tensor(numbers, device=ctx.device)

    def by_object():
        out = [None] * world
        dist.all_gather_object(out, numbers)
        return out

    def by_tensor():
        out = torch.empty(world * args.numbers, device=ctx.device)
        all_gather_single(out, as_tensor)
        return out

    times = {}
    for name, fn in [("all_gather_object", by_object), ("all_gather (tensor)", by_tensor)]:
        fn()  # warm-up
        best = float("inf")
        for _ in range(args.repeat):
            dist.barrier()
            start = time.perf_counter()
            got = fn()
            if ctx.device.type != "cpu":
                torch.accelerator.synchronize()
            best = min(best, time.perf_counter() - start)
        if torch.is_tensor(got):
            got = got.view(world, args.numbers).tolist()
        if got != [[float(100 * r + i) for i in range(args.numbers)] for r in range(world)]:
            raise RuntimeError(f"{name} gathered the wrong numbers")
        times[name] = best
    slower = times["all_gather_object"] / times["all_gather (tensor)"]
    print0(
        f"{args.numbers} floats per rank, best of {args.repeat}: "
        + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in times.items())
        + f"; the object version took {slower:.1f}x the time"
    )
    print0(
        f"OK: broadcast_object_list, all_gather_object, gather_object and scatter_object_list moved "
        f"Python objects among {world} ranks; the object all_gather took {slower:.1f}x the tensor one"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--numbers", type=int, default=10000, help="floats per rank in the timing")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs; the best is printed")
    run(main, parser.parse_args())
