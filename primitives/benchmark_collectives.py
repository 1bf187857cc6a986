"""A tool, not a lesson: a bandwidth benchmark for collectives in the manner of NVIDIA's nccl-tests.

For each op in --ops and each size from --min-bytes to --max-bytes (times --factor each step): the
time per call (the slowest rank's, after --warmup untimed and --iters timed calls), algbw and busbw
in GB/s, and "ok" once one more call on fresh data matched its closed form (below the divider).
As in nccl-tests, size is the largest buffer a rank holds, algbw = size / time and busbw = algbw *
bus_factor: what each rank's link carried, comparable across world sizes and with the hardware's
peak. Memory per rank: twice the message plus ~0.3 GB for the check (8G fits an 80 GB GPU).

    torchrun --nproc_per_node=4 primitives/benchmark_collectives.py
    torchrun --nproc_per_node=8 primitives/benchmark_collectives.py --min-bytes 8 --max-bytes 8G \\
        --factor 2 --iters 20 --dtype bfloat16 --json busbw.json --chart busbw.md

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.
Docs: https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md
"""

import argparse
import csv
import json
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm
from launch import charts
from launch.dist_setup import int_in, lesson_parser, print0, run

OPS = "all_reduce all_gather reduce_scatter broadcast reduce all_to_all sendrecv".split()


def bus_factor(op, n):
    """busbw / algbw: the share of the message each rank's link carries (nccl-tests' docs)."""
    return {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n,
    }.get(op, 1.0)


def seconds_per_call(call, args, ctx):
    """Warm-up, then the mean time of --iters calls: the slowest rank's, as every rank waits."""
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


def buffers_and_call(op, count, dtype, device, rank, n):
    """(output, input, call) for a message of `count` elements (count % n == 0). As in nccl-tests,
    the size is all_gather's output and reduce_scatter's input; in place where the call is."""
    part = count // n
    out = torch.empty(part if op == "reduce_scatter" else count, dtype=dtype, device=device)
    if op in ("all_reduce", "broadcast", "reduce"):
        inp = out
    else:
        inp = torch.empty(part if op == "all_gather" else count, dtype=dtype, device=device)
    right, left = (rank + 1) % n, (rank - 1) % n

    def sendrecv():  # every rank sends right and receives from the left, in one batch (NCCL-safe)
        ops = [dist.P2POp(dist.isend, inp, right), dist.P2POp(dist.irecv, out, left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    call = {
        "all_reduce": lambda: dist.all_reduce(out),
        "all_gather": lambda: dist.all_gather_single(out, inp),
        "reduce_scatter": lambda: dist.reduce_scatter_single(out, inp),
        "broadcast": lambda: dist.broadcast(out, src=0),
        "reduce": lambda: dist.reduce(out, dst=0),
        "all_to_all": lambda: dist.all_to_all_single(out, inp),  # block j of the input to rank j
        "sendrecv": sendrecv,
    }[op]
    return out, inp, call


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    ctx.require(args.min_bytes <= args.max_bytes, "--min-bytes must not be above --max-bytes")
    if "sendrecv" in args.ops:
        # Gloo's send and recv take CPU tensors only (docs: distributed.html#backends)
        ctx.require(
            ctx.backend != "gloo" or ctx.device.type == "cpu",
            "point-to-point on gloo needs CPU tensors: use --backend nccl or --device cpu",
        )
    n, dtype, sizes = ctx.world_size, getattr(torch, args.dtype), [args.min_bytes]
    while sizes[-1] * args.factor <= args.max_bytes:
        sizes.append(sizes[-1] * args.factor)
    print_header(args, ctx)
    rows = []
    for op, size in sweep(args.ops, sizes, ctx.rank):  # rank 0: a tqdm bar on a terminal's stderr
        count = max(n, size // dtype.itemsize // n * n)  # whole elements, divisible by n
        result, inp, call = buffers_and_call(op, count, dtype, ctx.device, ctx.rank, n)
        fill(inp, ctx.rank)
        seconds = seconds_per_call(call, args, ctx)
        check_one_more_call(op, count, result, inp, call, ctx)
        del result, inp, call  # free this size's buffers before the next, larger one
        algbw = count * dtype.itemsize / seconds / 1e9
        rows.append(record(op, count, seconds, algbw, algbw * bus_factor(op, n), args, ctx))
    save_and_summarise(rows, len(sizes), args, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


# The calls timed, each with the closed form of its result. Rank r's input holds
# value(r, i) = i % 7 + r + 1 at index i, so every result element is a small integer known in
# closed form; fill and first_wrong work chunk by chunk, on the device, so that no temporary is as
# large as the message (up to 8G on a GPU).
CHUNK = 1 << 22  # elements per step of fill and check: their temporaries stay near 0.3 GB


def value(r, i):
    """Rank r's input at index i (a tensor of indices): small integers, so every sum is exact."""
    return i % 7 + r + 1


def fill(buf, r):
    """Write rank r's input into buf, chunk by chunk: no temporary the size of the message."""
    flat = buf.view(-1)
    for start in range(0, flat.numel(), CHUNK):
        idx = torch.arange(start, min(start + CHUNK, flat.numel()), device=flat.device)
        flat[start : start + idx.numel()] = value(r, idx)


def first_wrong(result, expected, rtol):
    """(index, got, want) of the first element of result unlike expected(index), or None."""
    flat = result.view(-1)
    for start in range(0, flat.numel(), CHUNK):
        idx = torch.arange(start, min(start + CHUNK, flat.numel()), device=flat.device)
        got, want = flat[start : start + idx.numel()].double(), expected(idx).double()
        bad = (~((got - want).abs() <= rtol * want.abs())).nonzero()  # a NaN counts as wrong
        if bad.numel():
            i = bad[0].item()
            return start + i, got[i].item(), want[i].item()
    return None


def closed_form(op, count, rank, n):
    """expected(i): what element i of op's result must hold, in closed form (None where it is
    undefined: a reduce's output off the root). Rank r's part of a split message is at r * part."""
    part, left = count // n, (rank - 1) % n

    def total(i):  # the sum over ranks r of value(r, i)
        return n * (i % 7) + n * (n + 1) // 2

    return {
        "all_reduce": total,
        "all_gather": lambda i: value(i // part, i % part),
        "reduce_scatter": lambda i: total(rank * part + i),
        "broadcast": lambda i: value(0, i),
        "reduce": total if rank == 0 else None,
        "all_to_all": lambda i: value(i // part, rank * part + i % part),  # block s came from s
        "sendrecv": lambda i: value(left, i),
    }[op]


def tolerance(dtype, n):
    """Every value a result holds is an integer no larger than all_reduce's 6n + n(n+1)/2. A float
    type holds every integer up to 2^(mantissa bits + 1) = 2 / eps exactly, so up to there any sum
    is exact and the check bit for bit (float32: any sane n; bfloat16: n <= 17; float16: n <= 58).
    Beyond, each of a reduction's n-1 additions may round by half an ulp: n * eps bounds the
    relative error."""
    eps = torch.finfo(dtype).eps
    return 0.0 if 6 * n + n * (n + 1) // 2 <= 2 / eps else n * eps


def sweep(ops, sizes, rank):
    """Every (op, size), op by op; on rank 0 a tqdm bar on stderr when it is a terminal (None)."""
    return tqdm([(op, size) for op in ops for size in sizes], "sizes", disable=rank != 0 or None)


def row(text):
    """Rank 0 prints a line of the table through tqdm.write: on a terminal it clears the bar, prints
    the line and draws the bar again below it, so the two never share a line."""
    if dist.get_rank() == 0:
        tqdm.write(text)
        sys.stdout.flush()


def check_one_more_call(op, count, result, inp, call, ctx):
    """Refill the input, call once more and compare with the closed form; raise on every rank if
    one rank's result is wrong."""
    expected = closed_form(op, count, ctx.rank, ctx.world_size)
    rtol = tolerance(result.dtype, ctx.world_size)
    nbytes = count * result.element_size()
    if result is not inp:
        result.fill_(-1)  # so that a call that writes nothing cannot pass on the last call's output
    fill(inp, ctx.rank)
    call()
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
            f"rank {ctx.rank}: wrong result of {op} at {nbytes} bytes on {wrong_ranks.item()} "
            "rank(s)"
        )


def print_header(args, ctx):
    print0(
        f"# {ctx.world_size} ranks, backend {ctx.backend}, device {ctx.device.type}, dtype "
        f"{args.dtype}, warmup {args.warmup}, iters {args.iters}"
    )
    print0(
        f"{'op':>14} {'size(B)':>11} {'count':>10} {'time(us)':>10} {'algbw(GB/s)':>11} "
        f"{'busbw(GB/s)':>11} {'check':>5}"
    )


def record(op, count, seconds, algbw, busbw, args, ctx):
    """Print the row (above rank 0's bar) and return it, as saved by --json / --csv."""
    nbytes = count * getattr(torch, args.dtype).itemsize
    row(
        f"{op:>14} {nbytes:>11} {count:>10} {seconds * 1e6:>10.1f} {algbw:>11.3f} {busbw:>11.3f} "
        f"{'ok':>5}"
    )
    return dict(
        op=op,
        bytes=nbytes,
        count=count,
        dtype=args.dtype,
        ranks=ctx.world_size,
        time_us=seconds * 1e6,
        algbw_GBps=algbw,
        busbw_GBps=busbw,
        backend=ctx.backend,
        device=ctx.device.type,
    )


def save_and_summarise(rows, n_sizes, args, ctx):
    if ctx.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if ctx.rank == 0 and args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if ctx.rank == 0 and args.chart:
        write_chart(rows, n_sizes, args, ctx)
    largest = rows[n_sizes - 1 :: n_sizes]  # the last size of each op
    print0(
        "busbw at the largest size: "
        + ", ".join(f"{r['op']} {r['busbw_GBps']:.3f} GB/s" for r in largest)
    )
    print0(
        f"OK: {len(args.ops)} collectives x {n_sizes} sizes on {ctx.world_size} ranks, every "
        f"result checked; average busbw {sum(r['busbw_GBps'] for r in rows) / len(rows):.3f} GB/s"
    )


def write_chart(rows, n_sizes, args, ctx):
    """busbw against message size, a line per collective; the sizes grow by --factor, so equally
    spaced categories make a log scale (xychart-beta has none: launch/charts.py)."""
    sizes = [charts.size_label(r["bytes"]) for r in rows[:n_sizes]]
    lines = {
        r["op"]: [q["busbw_GBps"] for q in rows if q["op"] == r["op"]] for r in rows[::n_sizes]
    }
    title = f"busbw, {ctx.world_size} ranks, {ctx.backend} on {ctx.device.type}, {args.dtype}"
    note = f" Sizes grow by a factor of {args.factor}: one category each (a log scale)."
    chart = charts.xychart(title, "message size", sizes, "busbw (GB/s)", lines, note=note)
    charts.write(args.chart, chart)


UNITS, LARGEST = {"K": 2**10, "M": 2**20, "G": 2**30}, 16 * 2**30


def message_size(text):
    """1024, 64K, 1M, 8G -> bytes, from 1 byte to 16G (what fits twice on an 80 GB GPU)."""
    clean = text.strip().upper().removesuffix("B")
    try:
        size = float(clean[:-1]) * UNITS[clean[-1]] if clean[-1:] in UNITS else float(clean)
    except ValueError:
        size = None
    if size is None or not 1 <= size <= LARGEST or size != int(size):
        raise argparse.ArgumentTypeError(f"{text} is not a size in bytes from 1 to 16G")
    return int(size)


message_size.__name__, message_size.high = "a size in bytes from 1 to 16G (K, M, G)", LARGEST


def op_list(text):
    ops = text.split(",")
    if not all(op in OPS for op in ops):
        raise argparse.ArgumentTypeError(f"{text}: choose a comma-separated subset of {OPS}")
    return ops


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument("--min-bytes", type=message_size, default="1K", help="smallest message")
    parser.add_argument("--max-bytes", type=message_size, default="1M", help="largest message")
    parser.add_argument(
        "--factor", type=int_in(2, 1024), default=4, help="size step (nccl-tests -f)"
    )
    parser.add_argument("--iters", type=int_in(1, 100_000), default=5, help="timed calls per size")
    parser.add_argument(
        "--warmup", type=int_in(0, 100_000), default=2, help="untimed calls per size first"
    )
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"]
    )
    parser.add_argument("--ops", type=op_list, default=OPS, help="comma-separated subset of OPS")
    parser.add_argument("--json", help="also write the rows to this JSON file (rank 0)")
    parser.add_argument("--csv", help="also write the rows to this CSV file (rank 0)")
    parser.add_argument("--chart", type=charts.path, help="busbw vs size as a Mermaid chart (.md)")
    run(main, parser.parse_args())
