"""Mixed precision with DDP: torch.autocast (bf16 on CPU and GPU; fp16 + GradScaler on GPU).

Under autocast, matrix multiplies run in a 16-bit type while the parameters, the optimizer
and the gradients DDP all_reduces stay fp32. bf16 has fp32's exponent range, so it needs no
loss scaling. fp16 does: small gradients underflow to zero, so GradScaler multiplies the
loss before backward and divides the gradients again in `scaler.step` -- and before gradient
clipping you must call `scaler.unscale_(opt)`, or you would clip the scaled gradients.
The lesson trains the same model in fp32 and in each 16-bit mode and compares the loss.

    torchrun --nproc_per_node=3 ddp_basics/ddp_mixed_precision.py
    python ddp_basics/ddp_mixed_precision.py --nproc 2 --steps 200

Docs: https://pytorch.org/docs/stable/amp.html
"""
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.dist_setup import lesson_parser, print0, run
from toy import MLP, make_data


def train(args, ctx, start, x, y, dtype):
    """Train a DDP copy of start; dtype None is plain fp32. Returns the held-out loss (fp32)."""
    model = DDP(copy.deepcopy(start).to(ctx.device))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=dtype == torch.float16)
    for step in range(args.steps):
        lo = (step * ctx.world_size + ctx.rank) * args.batch
        xb, yb = x[lo:lo + args.batch].to(ctx.device), y[lo:lo + args.batch].to(ctx.device)
        with torch.autocast(ctx.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(model(xb), yb)
        scaler.scale(loss).backward()  # without fp16 the scaler is disabled: plain backward
        scaler.unscale_(opt)           # true gradients now, so clipping sees their real norm
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(opt)               # skips the step if fp16 gradients overflowed
        scaler.update()
        opt.zero_grad()
    xt, yt = make_data(2000, seed=1)
    with torch.no_grad():
        held_out = F.cross_entropy(model.module(xt.to(ctx.device)), yt.to(ctx.device))
    dist.all_reduce(held_out, op=dist.ReduceOp.AVG)  # identical on every rank; AVG shows they agree
    return held_out.item()


def main(args, ctx):
    x, y = make_data(args.steps * ctx.world_size * args.batch, seed=0)
    torch.manual_seed(0)
    start = MLP(args.width)
    fp32 = train(args, ctx, start, x, y, None)
    print0(f"fp32: held-out loss {fp32:.4f}")
    modes = [("bf16 autocast", torch.bfloat16)]
    if ctx.device.type == "cuda":
        modes.append(("fp16 autocast + GradScaler", torch.float16))
    else:
        print0(f"fp16 + GradScaler: GPU only in this lesson, skipped on {ctx.device.type}")
    worst = 0.0
    for name, dtype in modes:
        loss = train(args, ctx, start, x, y, dtype)
        diff = abs(loss - fp32)
        worst = max(worst, diff)
        print0(f"{name}: held-out loss {loss:.4f} (|diff| to fp32 {diff:.4f}, tolerance {args.tol:g})")
        if diff > args.tol:
            raise RuntimeError(f"{name} ends {diff:.4f} away from the fp32 loss {fp32:.4f}")
    print0(f"OK: {' and '.join(n for n, _ in modes)} under DDP end at the fp32 held-out loss "
           f"{fp32:.3f} within {worst:.3f} (tolerance {args.tol:g})")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32, help="examples per rank per step")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--clip", type=float, default=1.0, help="max gradient norm")
    parser.add_argument("--tol", type=float, default=0.05, help="allowed |loss - fp32 loss|")
    run(main, parser.parse_args())
