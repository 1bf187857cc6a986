"""How much does data parallelism cost? Step times of four ways to train the same model.

  (a) by hand, one all_reduce per parameter after backward (many small messages);
  (b) by hand, gradients flattened into buckets of --bucket-mb, one all_reduce per bucket;
  (c) DDP: buckets too, but each is all_reduced as soon as its gradients are ready,
      overlapping communication with the rest of backward;
  (d) every rank trains on its 1/N of the batch with no communication at all: the ideal.
Speed-up is against one process on the whole global batch (the same work, one worker);
scaling efficiency = speed-up / N. Also checks that (a), (b), (c) train the same parameters
as that one process. Numbers are this machine's: on a shared CPU they are noisy.

    torchrun --nproc_per_node=2 ddp_basics/benchmark_ddp.py
    torchrun --nproc_per_node=8 ddp_basics/benchmark_ddp.py --width 4096 --depth 8 --batch 8192

Docs: https://pytorch.org/docs/stable/notes/ddp.html
"""

import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.dist_setup import lesson_parser, print0, run
from toy import MLP, fp32_tolerance, make_data


def per_parameter(model, W):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= W


def bucketed(model, W, cap_bytes):
    grads = [p.grad for p in model.parameters()]
    buckets, size = [[]], 0
    for g in reversed(
        grads
    ):  # backward produces the last layers' gradients first, as DDP orders them
        if buckets[-1] and size + g.numel() * g.element_size() > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel() * g.element_size()
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat /= W
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(part.view_as(g))


def timed(model, x, y, args, device, sync=None):
    """Train args.warmup + args.steps steps on (x, y) batches; return (seconds per timed step, model)."""
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    n = len(x) // (args.warmup + args.steps)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if device.type != "cpu":
                torch.accelerator.synchronize()
            start = time.perf_counter()
        xb, yb = x[step * n : (step + 1) * n].to(device), y[step * n : (step + 1) * n].to(device)
        F.cross_entropy(model(xb), yb).backward()
        if sync is not None:
            sync(model)
        opt.step()
        opt.zero_grad()
    if device.type != "cpu":
        torch.accelerator.synchronize()
    return (time.perf_counter() - start) / args.steps, model


def main(args, ctx):
    W, B = ctx.world_size, args.batch
    ctx.require(B % W == 0, f"--batch {B} must divide by {W} ranks")
    ctx.require(args.steps >= 1 and args.warmup >= 1, "--steps and --warmup must be at least 1")
    steps = args.warmup + args.steps
    x, y = make_data(B * steps, seed=0)
    per = B // W
    # this rank's rows of every global batch, laid out step after step
    mine = torch.cat(
        [
            torch.arange(s * B + ctx.rank * per, s * B + (ctx.rank + 1) * per, device="cpu")
            for s in range(steps)
        ]
    )
    xr, yr = x[mine], y[mine]
    torch.manual_seed(0)
    start = MLP(args.width, depth=args.depth).to(ctx.device)
    n_params = sum(p.numel() for p in start.parameters())
    print0(
        f"model: {n_params / 1e6:.2f} M parameters ({4 * n_params / 2**20:.1f} MiB of gradients), "
        f"global batch {B}, {W} rank(s), {args.steps} timed steps"
    )

    # One process on the whole global batch (rank 0 alone, the others wait): the baseline and the reference.
    ref = torch.zeros(n_params, device=ctx.device)
    single = torch.zeros(1, device=ctx.device)
    if ctx.rank == 0:
        single[0], model = timed(copy.deepcopy(start), x, y, args, ctx.device)
        ref = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    dist.broadcast(ref, src=0)
    dist.broadcast(single, src=0)

    cap = int(args.bucket_mb * 2**20)
    runs = {
        "(a) per-parameter all_reduce": (copy.deepcopy(start), lambda m: per_parameter(m, W)),
        "(b) flat buckets by hand": (copy.deepcopy(start), lambda m: bucketed(m, W, cap)),
        "(c) DDP": (DDP(copy.deepcopy(start), bucket_cap_mb=args.bucket_mb), None),
        f"(d) 1/{W} of the data, no communication": (copy.deepcopy(start), None),
    }
    times = {}
    for name, (model, sync) in runs.items():
        dist.barrier()
        t, model = timed(model, xr, yr, args, ctx.device, sync)
        t = torch.tensor([t], device=ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
        times[name] = t.item()
        if not name.startswith("(d)"):
            got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            worst = (
                (got - ref).abs().max().item()
            )  # both on ctx.device, float32: summation order only
            if not worst <= fp32_tolerance(args.tol):  # `not <=`: a NaN fails too
                raise RuntimeError(
                    f"{name}: parameters differ from one-process training by {worst:.2e}"
                )

    print0(f"{'method':40s} {'ms/step':>9s} {'speed-up':>9s} {'efficiency':>10s}")
    print0(f"{'one process, whole batch':40s} {1e3 * single.item():9.2f} {1.0:9.2f}x {'':>10s}")
    for name, t in times.items():
        speedup = single.item() / t
        print0(f"{name:40s} {1e3 * t:9.2f} {speedup:9.2f}x {speedup / W:10.0%}")
    dist.barrier()  # leave together: without it gloo's teardown here sometimes aborted (seen 1 run in 5)
    ideal, ddp = times[f"(d) 1/{W} of the data, no communication"], times["(c) DDP"]
    print0(
        f"OK: DDP step {1e3 * ddp:.2f} ms at {W} ranks, {ddp / ideal - 1:+.0%} over no communication "
        f"({1e3 * ideal:.2f} ms); (a), (b), (c) match one-process training (tolerance {fp32_tolerance(args.tol):g})"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=3, help="hidden width x width layers")
    parser.add_argument(
        "--batch", type=int, default=192, help="global batch (divisible by the world size)"
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size for (b) and DDP")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument(
        "--tol", type=float, default=1e-4, help="max |param diff| against one process"
    )
    run(main, parser.parse_args())
