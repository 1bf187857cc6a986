"""A bandwidth benchmark for collectives, in the manner of NVIDIA's nccl-tests.

For each collective and each message size (powers of --factor from --min-bytes to
--max-bytes): --warmup untimed calls, then --iters timed calls (device-synchronised on
GPU); the time per call is the slowest rank's. As in nccl-tests, "size" is the largest
buffer a rank holds (all_gather's output, reduce_scatter's input), and:
    algbw = size / time        busbw = algbw * factor
    factor: all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n;
            broadcast, reduce, send/recv 1
busbw is what each rank's link actually carried, so it is comparable across world sizes and
collectives, and with the hardware's peak. After the timed calls, one more call on fresh
data is checked, on the device and chunk by chunk, against a closed form of the answer (rank
r holds i % 7 + r + 1 at index i); a wrong value raises. Memory per rank: the message's
buffers (at most twice the message: all_to_all and sendrecv hold input and output) plus
about 0.3 GB of check temporaries, so 8G fits an 80 GB GPU.

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
from launch.dist_setup import lesson_parser, print0, run

OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "sendrecv"]


def bus_factor(op, n):
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "all_to_all": (n - 1) / n}.get(op, 1.0)


def parse_bytes(text):
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


CHUNK = 1 << 22  # elements per step of fill and check: their temporaries stay near 0.3 GB


def value(r, i):
    """Rank r's input at index i (a tensor of indices): small integers, so sums are exact in float types."""
    return i % 7 + r + 1


def fill(buf, r):
    """Write rank r's input into buf, chunk by chunk: no temporary the size of the message."""
    flat = buf.view(-1)
    for start in range(0, flat.numel(), CHUNK):
        idx = torch.arange(start, min(start + CHUNK, flat.numel()), device=flat.device)
        flat[start:start + idx.numel()] = value(r, idx)


def first_wrong(result, expected, rtol):
    """(index, got, want) of the first element of result that differs from expected(index), or None."""
    flat = result.view(-1)
    for start in range(0, flat.numel(), CHUNK):
        idx = torch.arange(start, min(start + CHUNK, flat.numel()), device=flat.device)
        got, want = flat[start:start + idx.numel()].double(), expected(idx).double()
        bad = (~((got - want).abs() <= rtol * want.abs())).nonzero()  # written so that a NaN counts as wrong
        if bad.numel():
            i = bad[0].item()
            return start + i, got[i].item(), want[i].item()
    return None


def make_call(op, count, dtype, device, rank, n):
    """Return (result, inputs, call, expected) for one message of `count` elements (count % n == 0):
    inputs are (buffer, rank whose data it holds) pairs to fill; expected(i) is the value result[i]
    must hold, in closed form (None where the result is undefined). Buffers: at most 2x the message."""
    empty = lambda numel: torch.empty(numel, dtype=dtype, device=device)
    right, left, part = (rank + 1) % n, (rank - 1) % n, count // n
    total = lambda i: n * (i % 7) + n * (n + 1) // 2  # sum over ranks r of value(r, i)
    # torch 2.13 renamed the *_into_tensor / *_tensor calls; keep older versions working.
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if op == "all_reduce":
        buf = empty(count)
        return buf, [(buf, rank)], lambda: dist.all_reduce(buf), total
    if op == "all_gather":  # size = output; each rank contributes count/n, rank r's lands at r*part
        out, inp = empty(count), empty(part)
        return out, [(inp, rank)], lambda: all_gather_single(out, inp), lambda i: value(i // part, i % part)
    if op == "reduce_scatter":  # size = input; rank r keeps elements r*part... of the sum
        out, inp = empty(part), empty(count)
        return out, [(inp, rank)], lambda: reduce_scatter_single(out, inp), lambda i: total(rank * part + i)
    if op == "broadcast":
        buf = empty(count)
        return buf, [(buf, rank)], lambda: dist.broadcast(buf, src=0), lambda i: value(0, i)
    if op == "reduce":  # only the root's result is defined
        buf = empty(count)
        return buf, [(buf, rank)], lambda: dist.reduce(buf, dst=0), total if rank == 0 else None
    if op == "all_to_all":  # block j of my input goes to rank j; block s of my output came from rank s
        out, inp = empty(count), empty(count)
        return out, [(inp, rank)], lambda: dist.all_to_all_single(out, inp), \
            lambda i: value(i // part, rank * part + i % part)
    if op == "sendrecv":  # every rank sends right and receives from the left, in one batch (NCCL-safe)
        out, inp = empty(count), empty(count)
        def call():
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, inp, right),
                                                dist.P2POp(dist.irecv, out, left)]):
                work.wait()
        return out, [(inp, rank)], call, lambda i: value(left, i)
    raise ValueError(op)


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    ops = args.ops.split(",")
    ctx.require(all(op in OPS for op in ops), f"--ops: choose from {','.join(OPS)}")
    try:
        lo, hi = parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)
    except (ValueError, IndexError):
        lo = hi = 0
    ctx.require(0 < lo <= hi, "--min-bytes and --max-bytes must be sizes like 1024, 64K, 1M, 8G with min <= max")
    ctx.require(args.factor >= 2 and args.iters >= 1 and args.warmup >= 0,
                "need --factor >= 2, --iters >= 1, --warmup >= 0")
    rank, n, dtype = ctx.rank, ctx.world_size, getattr(torch, args.dtype)
    if "sendrecv" in ops:
        ctx.require_point_to_point()
    esize = dtype.itemsize
    # Every value a result holds is an integer no larger than all_reduce's 6n + n(n+1)/2. A float type
    # holds every integer up to 2^(mantissa bits + 1) exactly, so up to there each partial sum of a
    # reduction is exact, whatever its order, and the check is bit for bit (float32: any sane n;
    # bfloat16: n <= 17; float16: n <= 58). Beyond, each of a reduction's n-1 additions may round by
    # half an ulp: n * eps bounds the relative error.
    largest, info = 6 * n + n * (n + 1) // 2, torch.finfo(dtype)
    rtol = 0.0 if largest <= 2 / info.eps else n * info.eps  # 2 / eps = 2^(mantissa bits + 1)

    def sync():
        if ctx.device.type != "cpu":
            torch.accelerator.synchronize()

    sizes, size = [], lo
    while size <= hi:
        sizes.append(size)
        size *= args.factor

    rows = []
    print0(f"# {n} ranks, backend {ctx.backend}, device {ctx.device.type}, dtype {args.dtype}, "
           f"warmup {args.warmup}, iters {args.iters}")
    print0(f"{'op':>14} {'size(B)':>11} {'count':>10} {'time(us)':>10} {'algbw(GB/s)':>11} "
           f"{'busbw(GB/s)':>11} {'check':>5}")
    for op in ops:
        for size in sizes:
            count = max(n, size // esize // n * n)  # whole elements, divisible by n (as nccl-tests)
            result, inputs, call, expected = make_call(op, count, dtype, ctx.device, rank, n)
            for buf, r in inputs:
                fill(buf, r)
            for _ in range(args.warmup):
                call()
            dist.barrier()
            sync()
            start = time.perf_counter()
            for _ in range(args.iters):
                call()
            sync()
            seconds = torch.tensor([(time.perf_counter() - start) / args.iters], device=ctx.device)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            seconds = seconds.item()

            # The check: refill the inputs (the timed calls changed some), call once more, compare with
            # the closed form on the device, chunk by chunk: no second copy of the message anywhere.
            if all(result is not buf for buf, _ in inputs):
                result.fill_(-1)  # so that a call that writes nothing cannot pass on the last call's output
            for buf, r in inputs:
                fill(buf, r)
            call()
            if args.corrupt_for_testing and rank == n - 1 and op == ops[-1] and size == sizes[-1]:
                result.view(-1)[:1].neg_()  # testing only: a wrong value the check must catch
            wrong = first_wrong(result, expected, rtol) if expected is not None else None
            if wrong:
                print(f"[rank {rank}] {op} of {count * esize} bytes returned a wrong value at index {wrong[0]}: "
                      f"{wrong[1]:g} instead of {wrong[2]:g}", flush=True)
            wrong_ranks = torch.tensor([int(wrong is not None)], device=ctx.device)
            dist.all_reduce(wrong_ranks)  # every rank learns of it, so none goes on to print OK
            if wrong_ranks.item():
                raise RuntimeError(f"rank {rank}: wrong result of {op} at {count * esize} bytes on "
                                   f"{int(wrong_ranks.item())} rank(s)")
            del result, inputs, call, expected  # free this size's buffers before the next (larger) one

            nbytes = count * esize
            algbw = nbytes / seconds / 1e9
            busbw = algbw * bus_factor(op, n)
            rows.append(dict(op=op, bytes=nbytes, count=count, dtype=args.dtype, ranks=n, time_us=seconds * 1e6,
                             algbw_GBps=algbw, busbw_GBps=busbw, backend=ctx.backend, device=ctx.device.type))
            print0(f"{op:>14} {nbytes:>11} {count:>10} {seconds * 1e6:>10.1f} {algbw:>11.3f} {busbw:>11.3f} {'ok':>5}")

    if rank == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        if args.csv:
            with open(args.csv, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
    largest = rows[len(sizes) - 1::len(sizes)]  # the last size of each op
    print0("busbw at the largest size: " + ", ".join(f"{r['op']} {r['busbw_GBps']:.3f} GB/s" for r in largest))
    print0(f"OK: {len(ops)} collectives x {len(sizes)} sizes on {n} ranks, every result checked; "
           f"average busbw {sum(r['busbw_GBps'] for r in rows) / len(rows):.3f} GB/s")


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument("--min-bytes", default="1K", help="smallest message (bytes; K, M, G allowed)")
    parser.add_argument("--max-bytes", default="1M", help="largest message (e.g. 8G on GPUs)")
    parser.add_argument("--factor", type=int, default=4, help="size multiplier between steps (nccl-tests -f)")
    parser.add_argument("--iters", type=int, default=5, help="timed calls per size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per size first")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS))
    parser.add_argument("--json", help="also write the rows to this JSON file (rank 0)")
    parser.add_argument("--csv", help="also write the rows to this CSV file (rank 0)")
    parser.add_argument("--corrupt-for-testing", action="store_true",
                        help="negate one element of the last result on the last rank, to see the check fail")
    run(main, parser.parse_args())
