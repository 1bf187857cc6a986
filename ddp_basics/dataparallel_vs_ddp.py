"""nn.DataParallel against DistributedDataParallel.

DataParallel: ONE process, one thread per GPU. Every step it copies the model from GPU 0 to
every GPU (replicate), splits the batch (scatter), runs the replicas in threads, gathers the
outputs on GPU 0 and sums the gradients there: the Python GIL and GPU 0 are bottlenecks and it
works on one machine only. DDP: one process per GPU, the model copied once at the start, only
gradients travel (all_reduce in buckets, overlapped with backward), any number of machines.
With at least 2 GPUs the lesson times both on the same global batch; with fewer (a CPU-only
machine, for example) DataParallel has nothing to split over, so it says so and times DDP only.

    torchrun --nproc_per_node=2 ddp_basics/dataparallel_vs_ddp.py
    python ddp_basics/dataparallel_vs_ddp.py --nproc 2 --width 1024 --batch 4096

Docs: https://pytorch.org/docs/stable/notes/cuda.html#cuda-nn-ddp-instead
"""
import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.dist_setup import lesson_parser, print0, run
from toy import MLP, make_data


def timed_steps(model, opt, batches, device):
    """Run the steps; return seconds per step over all but the first (warm-up) step."""
    for i, (xb, yb) in enumerate(batches):
        if i == 1:
            if device.type != "cpu":
                torch.accelerator.synchronize()
            start = time.perf_counter()
        F.cross_entropy(model(xb.to(device)), yb.to(device)).backward()
        opt.step()
        opt.zero_grad()
    if device.type != "cpu":
        torch.accelerator.synchronize()
    return (time.perf_counter() - start) / (len(batches) - 1)


def main(args, ctx):
    W, B = ctx.world_size, args.batch
    ctx.require(B % W == 0, f"--batch {B} must divide by {W} ranks")
    ctx.require(args.steps >= 2, "--steps must be at least 2 (the first one is a warm-up)")
    x, y = make_data(B * args.steps, seed=0)
    torch.manual_seed(0)
    start = MLP(args.width)
    gpus = torch.cuda.device_count() if ctx.device.type == "cuda" else 0

    # DataParallel, on rank 0 alone (one process drives all GPUs); the others wait at the barrier.
    if gpus >= 2 and ctx.rank == 0:
        dp = nn.DataParallel(copy.deepcopy(start).cuda(0), device_ids=list(range(min(W, gpus))))
        opt = torch.optim.SGD(dp.parameters(), lr=args.lr)
        batches = [(x[s * B:(s + 1) * B], y[s * B:(s + 1) * B]) for s in range(args.steps)]
        dp_time = timed_steps(dp, opt, batches, torch.device("cuda", 0))
        print0(f"DataParallel over {min(W, gpus)} GPUs, 1 process: {1e3 * dp_time:.2f} ms/step")
    elif gpus < 2:
        print0(f"DataParallel: needs at least 2 GPUs, this machine has {gpus}: timing DDP only")
    dist.barrier()

    # DDP: each rank takes its B/W rows of the same global batches.
    ddp = DDP(copy.deepcopy(start).to(ctx.device))
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    per = B // W
    batches = [(x[s * B + ctx.rank * per:s * B + (ctx.rank + 1) * per],
                y[s * B + ctx.rank * per:s * B + (ctx.rank + 1) * per]) for s in range(args.steps)]
    t = torch.tensor([timed_steps(ddp, opt, batches, ctx.device)], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    print0(f"DDP, {W} processes on {ctx.device.type}: {1e3 * t.item():.2f} ms/step (global batch {B})")

    # Independent check: one process, whole global batch, same steps -> same parameters.
    single = copy.deepcopy(start)
    opt = torch.optim.SGD(single.parameters(), lr=args.lr)
    for s in range(args.steps):
        F.cross_entropy(single(x[s * B:(s + 1) * B]), y[s * B:(s + 1) * B]).backward()
        opt.step()
        opt.zero_grad()
    worst = max((p.detach().cpu() - q.detach()).abs().max().item()
                for p, q in zip(ddp.module.parameters(), single.parameters()))
    if worst > args.tol:
        raise RuntimeError(f"DDP parameters differ from single-process training by {worst:.2e}")
    print0(f"OK: DDP over {W} processes trained {args.steps} steps in {1e3 * t.item():.2f} ms/step, matching "
           f"single-process training (max diff {worst:.1e}){'' if gpus >= 2 else '; DataParallel skipped (< 2 GPUs)'}")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--batch", type=int, default=96, help="global batch (divisible by the world size)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--tol", type=float, default=1e-4, help="max |param diff| (GPU matmuls are less exact)")
    run(main, parser.parse_args())
