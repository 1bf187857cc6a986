"""Mixed precision with DDP: torch.autocast with bf16, and fp16 with GradScaler (CPU and GPU).

Under autocast, matrix multiplies run in a 16-bit type while the parameters, the optimizer
and the gradients DDP all_reduces stay fp32. bf16 has fp32's exponent range, so it needs no
loss scaling. fp16 does: small gradients underflow to zero, so GradScaler multiplies the
loss before backward and divides the gradients again in `scaler.step` -- and before gradient
clipping you must call `scaler.unscale_(opt)`, or you would clip the scaled gradients.
The lesson trains the same model in fp32 and in each 16-bit mode and compares the loss. Both
modes run on CPU too in torch 2.13 (autocast's CPU dtypes are bf16 and fp16, torch/amp/autocast_mode.py;
GradScaler takes "cpu", torch/amp/grad_scaler.py), so the same checks run on every device.

    torchrun --nproc_per_node=3 ddp_basics/ddp_mixed_precision.py
    python ddp_basics/ddp_mixed_precision.py --nproc 2 --steps 300

Docs: https://pytorch.org/docs/stable/amp.html
"""
import copy

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.dist_setup import lesson_parser, print0, run
from toy import MLP, make_data


def train(args, ctx, start, x, y, dtype):
    """Train a DDP copy of start; dtype None is plain fp32. Returns (held-out loss in fp32, scaler)."""
    model = DDP(copy.deepcopy(start))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=dtype == torch.float16)
    for step in range(args.steps):
        lo = (step * ctx.world_size + ctx.rank) * args.batch
        xb, yb = x[lo:lo + args.batch].to(ctx.device), y[lo:lo + args.batch].to(ctx.device)
        with torch.autocast(ctx.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(model(xb), yb)  # linear in 16 bits, cross_entropy in fp32 (amp docs' op lists)
        scaler.scale(loss).backward()  # without fp16 the scaler is disabled: plain backward
        scaler.unscale_(opt)           # true gradients now, so clipping sees their real norm
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(opt)               # skips the step if fp16 gradients overflowed
        scaler.update()
        opt.zero_grad()
    xt, yt = make_data(2000, seed=1)
    with torch.no_grad():  # DDP keeps the replicas identical: every rank computes the same loss
        held_out = F.cross_entropy(model.module(xt.to(ctx.device)), yt.to(ctx.device))
    return held_out.item(), scaler


def main(args, ctx):
    x, y = make_data(args.steps * ctx.world_size * args.batch, seed=0)
    torch.manual_seed(0)
    start = MLP(args.width).to(ctx.device)
    fp32, _ = train(args, ctx, start, x, y, None)
    print0(f"fp32: held-out loss {fp32:.4f}")
    check_16_bit_modes(args, ctx, start, x, y, fp32)


def check_16_bit_modes(args, ctx, start, x, y, fp32):
    """Each 16-bit mode ends near the fp32 run, all on ctx.device. Bound: 16-bit matmuls round to
    8 (bf16) or 11 (fp16) significant bits, and the runs drift apart by about that much; measured
    |diff| <= 2e-3 after 150 steps on CPU at 1-3 ranks (CUDA's fp16/bf16 matmuls round the same
    formats, accumulating in fp32). fp16: with the default scale 2**16 the largest scaled gradient
    measured 19136, below fp16's 65504, so no step overflows; if one does (DDP averages the
    gradients before unscale_, so every rank finds the same inf and all skip it together),
    GradScaler skips it and halves the scale: one or two skipped steps early on were measured to
    move the final loss by 0.007-0.013 (by 0.047 at --steps 60, hence the 150 steps): --tol 0.05."""
    worst = 0.0
    for name, dtype in [("bf16 autocast", torch.bfloat16), ("fp16 autocast + GradScaler", torch.float16)]:
        loss, scaler = train(args, ctx, start, x, y, dtype)
        diff = abs(loss - fp32)
        worst = max(worst, diff)
        first = torch.amp.GradScaler(ctx.device.type).get_scale()  # the default initial scale
        scale = f"; GradScaler scale {first:g} -> {scaler.get_scale():g} (halved at each skipped step)"
        print0(f"{name}: held-out loss {loss:.4f} (|diff| to fp32 {diff:.4f}, tolerance {args.tol:g})"
               + (scale if scaler.is_enabled() else ""))
        if not diff <= args.tol:  # `not <=`: a NaN fails too
            raise RuntimeError(f"{name} ends {diff:.4f} away from the fp32 loss {fp32:.4f}")
    print0(f"OK: bf16 autocast and fp16 autocast + GradScaler under DDP on {ctx.device.type} end at the fp32 "
           f"held-out loss {fp32:.3f} within {worst:.3f} (tolerance {args.tol:g})")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=32, help="examples per rank per step")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--clip", type=float, default=1.0, help="max gradient norm")
    parser.add_argument("--tol", type=float, default=0.05, help="allowed |loss - fp32 loss|")
    run(main, parser.parse_args())
