"""How much does data parallelism cost? Step times of four ways to train the same model.

  (a) one all_reduce per parameter after backward (many small messages);
  (b) gradients flattened by hand into buckets of --bucket-mb, one all_reduce per bucket;
  (c) DDP: buckets too, each all_reduced as soon as its gradients are ready (overlapped);
  (d) every rank trains on its 1/N of the batch with no communication at all: the ideal.
Speed-up is against one process on the whole global batch; scaling efficiency = speed-up / N.
(a), (b), (c) must train one process's parameters. On a shared CPU the numbers are noisy.

    torchrun --nproc_per_node=2 ddp_basics/benchmark_ddp.py
    torchrun --nproc_per_node=8 ddp_basics/benchmark_ddp.py --width 4096 --depth 8 --batch 8192

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/notes/ddp.html
"""

import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.dist_setup import float_in, int_in, lesson_parser, print0, run
from toy import MLP, flat, fp32_tolerance, make_data


def per_parameter(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def bucketed(model, cap_mb):
    buckets, size = [[]], 0
    # backward produces the last layers' gradients first: reversed, as DDP orders its buckets
    for g in reversed([p.grad for p in model.parameters()]):
        if buckets[-1] and size + g.nbytes > cap_mb * 2**20:
            buckets, size = buckets + [[]], 0
        buckets[-1].append(g)
        size += g.nbytes
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(part.view_as(g))


def timed(model, x, y, args, device, sync=None):
    """Train args.warmup + args.steps steps on (x, y) batches; return (seconds per timed step,
    model)."""
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
    x, y = make_data(B * (args.warmup + args.steps), seed=0)
    lo, hi = ctx.rank * B // W, (ctx.rank + 1) * B // W  # this rank's rows of each global batch
    xr, yr = x.view(-1, B, 2)[:, lo:hi].reshape(-1, 2), y.view(-1, B)[:, lo:hi].reshape(-1)
    torch.manual_seed(0)
    start = MLP(args.width, depth=args.depth).to(ctx.device)
    single = torch.zeros(1, device=ctx.device)  # one process, the whole batch: the baseline
    if ctx.rank == 0:  # rank 0 alone, the others wait
        single[0], _ = timed(copy.deepcopy(start), x, y, args, ctx.device)
    dist.broadcast(single, src=0)
    runs = {
        "(a) per-parameter all_reduce": (copy.deepcopy(start), per_parameter),
        "(b) flat buckets by hand": (copy.deepcopy(start), lambda m: bucketed(m, args.bucket_mb)),
        "(c) DDP": (DDP(copy.deepcopy(start), bucket_cap_mb=args.bucket_mb), None),
        f"(d) 1/{W} of the data, no communication": (copy.deepcopy(start), None),
    }
    times, models = {}, {}
    for name, (model, sync) in runs.items():
        dist.barrier()
        t, models[name] = timed(model, xr, yr, args, ctx.device, sync)
        t = torch.tensor([t], device=ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
        times[name] = t.item()
    print_table(start, single.item(), times, args, ctx)
    check_against_one_process(start, x, y, models, times, args, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


def print_table(start, single, times, args, ctx):
    n_params = sum(p.numel() for p in start.parameters())
    print0(
        f"model: {n_params / 1e6:.2f} M parameters ({4 * n_params / 2**20:.1f} MiB of gradients), "
        f"global batch {args.batch}, {ctx.world_size} rank(s), {args.steps} timed steps"
    )
    print0(f"{'method':40s} {'ms/step':>9s} {'speed-up':>9s} {'efficiency':>10s}")
    print0(f"{'one process, whole batch':40s} {1e3 * single:9.2f} {1.0:9.2f}x {'':>10s}")
    for name, t in times.items():
        speedup = single / t
        print0(f"{name:40s} {1e3 * t:9.2f} {speedup:9.2f}x {speedup / ctx.world_size:10.0%}")


def check_against_one_process(start, x, y, models, times, args, ctx):
    """(a), (b), (c) end with the parameters of one process trained on the whole global batches
    (trained again here, on every rank: no collective). Both on ctx.device in float32: summation
    order only; --tol 1e-4, widened only if TF32 matmuls are on (toy.fp32_tolerance)."""
    _, single = timed(copy.deepcopy(start), x, y, args, ctx.device)
    tol, failures = fp32_tolerance(args.tol), []
    for name, model in models.items():
        worst = (flat(model) - flat(single)).abs().max().item()
        if not name.startswith("(d)") and not worst <= tol:  # `not <=`: a NaN fails too
            failures.append(f"{name}: parameters differ from one-process training by {worst:.2e}")
    # leave together: without it gloo's teardown here sometimes aborted (seen 1 run in 5)
    dist.barrier()
    if failures:
        raise RuntimeError("; ".join(failures))
    ideal, ddp = times[f"(d) 1/{ctx.world_size} of the data, no communication"], times["(c) DDP"]
    print0(
        f"OK: DDP step {1e3 * ddp:.2f} ms at {ctx.world_size} ranks, {ddp / ideal - 1:+.0%} over "
        f"no communication ({1e3 * ideal:.2f} ms); (a), (b), (c) match one-process training "
        f"(tolerance {tol:g})"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--width", type=int_in(1, 16384), default=256, help="hidden width")
    parser.add_argument(
        "--depth", type=int_in(0, 64), default=3, help="hidden width x width layers"
    )
    parser.add_argument(
        "--batch",
        type=int_in(1, 10**6),
        default=192,
        help="global batch (divisible by the world size)",
    )
    parser.add_argument("--steps", type=int_in(1, 10_000), default=20, help="timed steps")
    parser.add_argument(
        "--warmup", type=int_in(1, 1000), default=3, help="untimed steps before them"
    )
    parser.add_argument(
        "--bucket-mb",
        type=float_in(0, 4096, low_open=True),
        default=25.0,
        help="bucket size for (b) and DDP",
    )
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.05)
    parser.add_argument(
        "--tol", type=float_in(0, 1), default=1e-4, help="max |param diff| against one process"
    )
    run(main, parser.parse_args())
