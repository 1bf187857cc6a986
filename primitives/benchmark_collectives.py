"""A tool, not a lesson: a bandwidth benchmark for collectives, in the manner of NVIDIA's nccl-tests.

For each op in --ops and each size from --min-bytes to --max-bytes (times --factor each step) it
prints a row: op, bytes, elements, time per call (the slowest rank's, after --warmup untimed and
--iters timed calls), algbw and busbw in GB/s, and "ok" once one more call on fresh data matched
its closed form (a wrong value raises). Then busbw at the largest size of each op, and an OK line;
--json / --csv also save the rows. As in nccl-tests, size is the largest buffer a rank holds,
algbw = size / time, busbw = algbw * bus_factor: the bytes each rank's link carried, comparable
across world sizes and with the hardware's peak. Memory per rank: twice the message at most, plus
about 0.3 GB for the check (8G fits an 80 GB GPU).

    torchrun --nproc_per_node=4 primitives/benchmark_collectives.py
    torchrun --nproc_per_node=8 primitives/benchmark_collectives.py --min-bytes 8 --max-bytes 8G \\
        --factor 2 --iters 20 --dtype bfloat16 --json busbw.json --csv busbw.csv

Docs: https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md
"""

import csv
import json
import time

import torch
import torch.distributed as dist
from benchmark_calls import fill, first_wrong, make_call, tolerance
from launch.dist_setup import lesson_parser, print0, run, test_flags

OPS = [
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all",
    "sendrecv",
]


def bus_factor(op, n):
    """busbw / algbw: the share of the message that each rank's link carries (nccl-tests' PERFORMANCE.md)."""
    return {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n,
    }.get(op, 1.0)


def parse_bytes(text):
    """1024, 64K, 1M, 8G -> bytes; 0 for text that is not such a size."""
    units, text = {"K": 2**10, "M": 2**20, "G": 2**30}, text.strip().upper().rstrip("B")
    try:
        return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)
    except ValueError:
        return 0


def seconds_per_call(call, args, ctx):
    """Warm-up, then the mean time of --iters calls; the slowest rank's, as every rank waits for it."""
    for _ in range(args.warmup):
        call()
    dist.barrier()
    if ctx.device.type != "cpu":
        torch.accelerator.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        call()
    if ctx.device.type != "cpu":
        torch.accelerator.synchronize()
    seconds = torch.tensor([(time.perf_counter() - start) / args.iters], device=ctx.device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def check_one_more_call(op, nbytes, result, inp, call, expected, rtol, corrupt, ctx):
    """Refill the input, call once more and compare with the closed form; raise on every rank if one is wrong."""
    if result is not inp:
        result.fill_(-1)  # so that a call that writes nothing cannot pass on the last call's output
    fill(inp, ctx.rank)
    call()
    if corrupt:
        result.view(-1)[:1].neg_()  # --corrupt-for-testing: a wrong value the check must catch
    wrong = first_wrong(result, expected, rtol) if expected is not None else None
    if wrong:
        print(
            f"[rank {ctx.rank}] {op} of {nbytes} bytes returned a wrong value at index {wrong[0]}: "
            f"{wrong[1]:g} instead of {wrong[2]:g}",
            flush=True,
        )
    wrong_ranks = torch.tensor([int(wrong is not None)], device=ctx.device)
    dist.all_reduce(wrong_ranks)  # every rank learns of it, so none goes on to print OK
    if wrong_ranks.item():
        raise RuntimeError(
            f"rank {ctx.rank}: wrong result of {op} at {nbytes} bytes on {wrong_ranks.item()} rank(s)"
        )


def save_rows(rows, args):
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    ops = args.ops.split(",")
    ctx.require(all(op in OPS for op in ops), f"--ops: choose from {','.join(OPS)}")
    lo, hi = parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)
    ctx.require(
        0 < lo <= hi,
        "--min-bytes and --max-bytes must be sizes like 1024, 64K, 1M, 8G with min <= max",
    )
    ctx.require(
        args.factor >= 2 and args.iters >= 1 and args.warmup >= 0,
        "need --factor >= 2, --iters >= 1, --warmup >= 0",
    )
    if "sendrecv" in ops:
        ctx.require_point_to_point()
    n, dtype = ctx.world_size, getattr(torch, args.dtype)
    sizes = [lo]
    while sizes[-1] * args.factor <= hi:
        sizes.append(sizes[-1] * args.factor)

    print0(
        f"# {n} ranks, backend {ctx.backend}, device {ctx.device.type}, dtype {args.dtype}, "
        f"warmup {args.warmup}, iters {args.iters}"
    )
    print0(
        f"{'op':>14} {'size(B)':>11} {'count':>10} {'time(us)':>10} {'algbw(GB/s)':>11} "
        f"{'busbw(GB/s)':>11} {'check':>5}"
    )
    rows = []
    for op in ops:
        for size in sizes:
            count = max(
                n, size // dtype.itemsize // n * n
            )  # whole elements, divisible by n (as nccl-tests)
            nbytes = count * dtype.itemsize
            result, inp, call, expected = make_call(op, count, dtype, ctx.device, ctx.rank, n)
            fill(inp, ctx.rank)
            seconds = seconds_per_call(call, args, ctx)
            corrupt = (
                args.corrupt_for_testing
                and ctx.rank == n - 1
                and op == ops[-1]
                and size == sizes[-1]
            )
            check_one_more_call(
                op, nbytes, result, inp, call, expected, tolerance(dtype, n), corrupt, ctx
            )
            del result, inp, call, expected  # free this size's buffers before the next (larger) one
            algbw = nbytes / seconds / 1e9
            busbw = algbw * bus_factor(op, n)
            rows.append(
                dict(
                    op=op,
                    bytes=nbytes,
                    count=count,
                    dtype=args.dtype,
                    ranks=n,
                    time_us=seconds * 1e6,
                    algbw_GBps=algbw,
                    busbw_GBps=busbw,
                    backend=ctx.backend,
                    device=ctx.device.type,
                )
            )
            print0(
                f"{op:>14} {nbytes:>11} {count:>10} {seconds * 1e6:>10.1f} {algbw:>11.3f} {busbw:>11.3f} {'ok':>5}"
            )

    if ctx.rank == 0:
        save_rows(rows, args)
    largest = rows[len(sizes) - 1 :: len(sizes)]  # the last size of each op
    print0(
        "busbw at the largest size: "
        + ", ".join(f"{r['op']} {r['busbw_GBps']:.3f} GB/s" for r in largest)
    )
    print0(
        f"OK: {len(ops)} collectives x {len(sizes)} sizes on {n} ranks, every result checked; "
        f"average busbw {sum(r['busbw_GBps'] for r in rows) / len(rows):.3f} GB/s"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument(
        "--min-bytes", default="1K", help="smallest message (bytes; K, M, G allowed)"
    )
    parser.add_argument("--max-bytes", default="1M", help="largest message (e.g. 8G on GPUs)")
    parser.add_argument(
        "--factor", type=int, default=4, help="size multiplier between steps (nccl-tests -f)"
    )
    parser.add_argument("--iters", type=int, default=5, help="timed calls per size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per size first")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"]
    )
    parser.add_argument(
        "--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS)
    )
    parser.add_argument("--json", help="also write the rows to this JSON file (rank 0)")
    parser.add_argument("--csv", help="also write the rows to this CSV file (rank 0)")
    test_flags(parser).add_argument(
        "--corrupt-for-testing",
        action="store_true",
        help="negate one element of the last result on the last rank: the check must fail",
    )
    run(main, parser.parse_args())
