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
data is checked against the answer computed locally; a wrong value raises.

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


def make_call(op, count, dtype, device, rank, n):
    """Return (buffers, call, expected) for one message of `count` elements (count % n == 0)."""
    def filled(r, numel):  # rank r's input: small integers, so every sum is exact
        return ((torch.arange(numel, device=device) % 7) + r + 1).to(dtype)
    def total(numel):  # sum over ranks of filled(r, numel)
        return sum(filled(r, numel).double() for r in range(n))
    right, left, part = (rank + 1) % n, (rank - 1) % n, count // n
    # torch 2.13 renamed the *_into_tensor / *_tensor calls; keep older versions working.
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if op == "all_reduce":
        buf = filled(rank, count)
        return buf, lambda: dist.all_reduce(buf), lambda: total(count)
    if op == "all_gather":  # size = output; each rank contributes count/n
        out, inp = torch.empty(count, dtype=dtype, device=device), filled(rank, part)
        return out, lambda: all_gather_single(out, inp), \
            lambda: torch.cat([filled(r, part).double() for r in range(n)])
    if op == "reduce_scatter":  # size = input; each rank keeps count/n
        out, inp = torch.empty(part, dtype=dtype, device=device), filled(rank, count)
        return out, lambda: reduce_scatter_single(out, inp), lambda: total(count)[rank * part:(rank + 1) * part]
    if op == "broadcast":
        buf = filled(rank, count)
        return buf, lambda: dist.broadcast(buf, src=0), lambda: filled(0, count).double()
    if op == "reduce":  # only the root's result is defined
        buf = filled(rank, count)
        return buf, lambda: dist.reduce(buf, dst=0), lambda: total(count) if rank == 0 else None
    if op == "all_to_all":  # block j of my input goes to rank j
        out, inp = torch.empty(count, dtype=dtype, device=device), filled(rank, count)
        return out, lambda: dist.all_to_all_single(out, inp), \
            lambda: torch.cat([filled(r, count)[rank * part:(rank + 1) * part].double() for r in range(n)])
    if op == "sendrecv":  # every rank sends right and receives from the left, at once
        out, inp = torch.empty(count, dtype=dtype, device=device), filled(rank, count)
        def call():
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, inp, right),
                                                dist.P2POp(dist.irecv, out, left)]):
                work.wait()
        return out, call, lambda: filled(left, count).double()
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
    esize = torch.tensor([], dtype=dtype).element_size()
    tolerance = {torch.float32: 1e-6, torch.float64: 1e-12}.get(dtype, 1e-2)

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
            result, call, expected = make_call(op, count, dtype, ctx.device, rank, n)
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

            # The check: rebuild the inputs (the timed calls changed them), call once more, compare.
            result, call, expected = make_call(op, count, dtype, ctx.device, rank, n)
            call()
            want = expected()
            if args.corrupt_for_testing and rank == n - 1 and op == ops[-1] and size == sizes[-1]:
                result.view(-1)[:1].neg_()  # testing only: a wrong value the check must catch
            wrong = want is not None and not torch.allclose(result.double().cpu(), want.cpu(), rtol=tolerance, atol=0)
            if wrong:
                bad = (result.double().cpu() - want.cpu()).abs().argmax().item()
                print(f"[rank {rank}] {op} of {count * esize} bytes returned a wrong value at index {bad}: "
                      f"{result.view(-1)[bad].item()} instead of {want[bad].item()}", flush=True)
            wrong_ranks = torch.tensor([int(wrong)], device=ctx.device)
            dist.all_reduce(wrong_ranks)  # every rank learns of it, so none goes on to print OK
            if wrong_ranks.item():
                raise RuntimeError(f"rank {rank}: wrong result of {op} at {count * esize} bytes on "
                                   f"{int(wrong_ranks.item())} rank(s)")

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
    parser = lesson_parser(__doc__)
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
