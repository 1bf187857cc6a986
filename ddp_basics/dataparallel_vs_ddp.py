"""nn.DataParallel against DistributedDataParallel.

DataParallel: ONE process, one thread per GPU. Every step it copies the model from GPU 0 to
every GPU (replicate), splits the batch (scatter), runs the replicas in threads, gathers the
outputs on GPU 0 and sums the gradients there: the Python GIL and GPU 0 are bottlenecks and it
works on one machine only. DDP: one process per GPU, the model copied once at the start, only
gradients travel (all_reduce in buckets, overlapped with backward), any number of machines.
With at least 2 GPUs on the node the lesson times both on the same global batches and the same
GPUs, one after the other: DDP with one rank per GPU, then DataParallel driven by rank 0 alone
over as many GPUs while the other ranks wait in a barrier of a Gloo group, that is on the CPU
(an NCCL barrier would keep a kernel spinning on their GPUs, which DataParallel's replicas would
then share). What it measures: wall-clock time per training step (host-to-device copy of the
batch, forward, backward, optimizer step), for DDP that of the slowest rank. With fewer than 2
GPUs (a CPU-only machine, for example) DataParallel has nothing to split over: it times DDP only.

    torchrun --nproc_per_node=2 ddp_basics/dataparallel_vs_ddp.py
    python ddp_basics/dataparallel_vs_ddp.py --nproc 2 --width 1024 --batch 4096

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/notes/cuda.html#cuda-nn-ddp-instead
"""

import copy
import datetime
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.dist_setup import float_in, int_in, lesson_parser, print0, run
from toy import MLP, fp32_tolerance, make_data


def timed_steps(model, opt, batches, devices):
    """Run the steps (inputs go to devices[0]); return seconds per step over all but the first
    (warm-up) step, after waiting for the work queued on every device in `devices`."""
    for i, (xb, yb) in enumerate(batches):
        if i == 1:
            synchronize(devices)
            start = time.perf_counter()
        F.cross_entropy(model(xb.to(devices[0])), yb.to(devices[0])).backward()
        opt.step()
        opt.zero_grad()
    synchronize(devices)
    return (time.perf_counter() - start) / (len(batches) - 1)


def synchronize(devices):
    for device in devices:
        if device.type != "cpu":
            torch.accelerator.synchronize(device)


def main(args, ctx):
    W, B = ctx.world_size, args.batch
    ctx.require(B % W == 0, f"--batch {B} must divide by {W} ranks")
    x, y = make_data(B * args.steps, seed=0)  # on the CPU; each step copies its batch to the GPU(s)
    torch.manual_seed(0)
    start = MLP(args.width).to(ctx.device)
    full = [(x[s * B : (s + 1) * B], y[s * B : (s + 1) * B]) for s in range(args.steps)]

    # DDP: one process per GPU, each rank its B/W rows of every global batch.
    ddp = DDP(copy.deepcopy(start))
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    lo, hi = ctx.rank * B // W, (ctx.rank + 1) * B // W
    mine = [(xb[lo:hi], yb[lo:hi]) for xb, yb in full]
    t = torch.tensor([timed_steps(ddp, opt, mine, [ctx.device])], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    print0(
        f"DDP, {W} processes on {ctx.device.type}: {1e3 * t.item():.2f} ms/step (global batch {B})"
    )

    # DataParallel: ONE process (rank 0) drives n GPUs of this node, the replicas in threads.
    n = min(ctx.local_world_size, torch.cuda.device_count()) if ctx.device.type == "cuda" else 0
    # the other ranks wait in a barrier on the CPU, so that their GPUs stay idle
    cpu_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.timeout))
    dp = None
    if n >= 2 and ctx.rank == 0:
        dp = nn.DataParallel(copy.deepcopy(start), device_ids=list(range(n)))  # start: on cuda:0
        opt = torch.optim.SGD(dp.parameters(), lr=args.lr)
        dp_time = timed_steps(dp, opt, full, [torch.device("cuda", i) for i in range(n)])
        print0(
            f"DataParallel over {n} GPUs, 1 process: {1e3 * dp_time:.2f} ms/step (while the other "
            f"{W - 1} ranks waited on the CPU)"
        )
    elif n < 2:
        print0(
            f"DataParallel: needs at least 2 GPUs, this node has {n} for this job: timing DDP only"
        )
    dist.barrier(group=cpu_group)
    check_against_one_process(start, full, ddp, dp, args, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_against_one_process(start, full, ddp, dp, args, ctx):
    """One process on ctx.device, the whole global batch each step: DDP (every rank) and
    DataParallel (rank 0, when it ran) end with its parameters. Same device and float32; the runs
    differ by summation order only (shard gradients averaged, or summed on GPU 0, vs one batch),
    measured 1e-7 after 20 steps on CPU; --tol 1e-4 leaves room for larger --width/--batch."""
    single = copy.deepcopy(start)
    opt = torch.optim.SGD(single.parameters(), lr=args.lr)
    for xb, yb in full:
        F.cross_entropy(single(xb.to(ctx.device)), yb.to(ctx.device)).backward()
        opt.step()
        opt.zero_grad()
    tol = fp32_tolerance(args.tol)  # widened only if TF32 matmuls are on (see toy.py)
    for name, model in [("DDP", ddp.module), ("DataParallel", dp and dp.module)]:
        if model is not None:
            worst = max(
                (p.detach() - q.detach()).abs().max().item()
                for p, q in zip(model.parameters(), single.parameters())
            )
            if not worst <= tol:  # `not <=`: a NaN fails too
                raise RuntimeError(
                    f"{name} parameters differ from single-process training by {worst:.2e}"
                )
    both = " and DataParallel" if dp else ""
    not_run = "" if dp or ctx.rank else "; DataParallel not run"
    print0(
        f"OK: DDP over {ctx.world_size} processes{both} trained {args.steps} steps matching "
        f"single-process training (tolerance {tol:g}){not_run}"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--batch",
        type=int_in(1, 10**6),
        default=96,
        help="global batch (divisible by the world size)",
    )
    parser.add_argument(
        "--steps", type=int_in(2, 10_000), default=20, help="steps (the first is a warm-up)"
    )
    parser.add_argument("--width", type=int_in(1, 16384), default=64, help="hidden width")
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.1)
    parser.add_argument(
        "--tol",
        type=float_in(0, 1),
        default=1e-4,
        help="max |param diff| (GPU matmuls are less exact)",
    )
    run(main, parser.parse_args())
