"""Mixed precision with DDP: torch.autocast with bf16, and fp16 with GradScaler (CPU and GPU).

Under autocast, matrix multiplies run in a 16-bit type while the parameters, the optimizer
and the gradients DDP all_reduces stay fp32. bf16 has fp32's exponent range, so it needs no
loss scaling. fp16 does: small gradients underflow to zero, so GradScaler multiplies the
loss before backward and divides the gradients again in `scaler.step` -- and before gradient
clipping you must call `scaler.unscale_(opt)`, or you would clip the scaled gradients.
The lesson trains the same model in fp32 and in each 16-bit mode and compares the loss. Both
modes run on CPU too in torch 2.13 (autocast's CPU dtypes are bf16 and fp16,
torch/amp/autocast_mode.py; GradScaler takes "cpu", torch/amp/grad_scaler.py), so the same checks
run on every device.
Its skeleton is ddp_minimal.py's: `diff ddp_minimal.py ddp_mixed_precision.py` shows the lines
mixed precision adds.

    torchrun --nproc_per_node=3 ddp_basics/ddp_mixed_precision.py
    python ddp_basics/ddp_mixed_precision.py --nproc 2 --epochs 6

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/amp.html
"""

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from launch.dist_setup import float_in, int_in, lesson_parser, print0, run
from toy import MLP, make_data

MODES = [
    ("fp32", None),
    ("bf16 autocast", torch.bfloat16),
    ("fp16 autocast + GradScaler", torch.float16),
]


def main(args, ctx):
    x, y = make_data(args.train, seed=0)  # every rank builds the same data, on the CPU
    dataset = TensorDataset(x, y)
    # this rank's 1/N of the data set (the rank and N come from the process group)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
    test_x, test_y = make_data(args.test, seed=1)  # held out
    results = {}
    for name, dtype in MODES:  # the same start, data and steps in each mode
        torch.manual_seed(0)
        model = MLP(args.width).to(ctx.device)
        model = DDP(model, device_ids=None if ctx.device.type == "cpu" else [ctx.device])
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        # disabled (fp32, bf16), every call of the scaler below passes its input through
        scaler = torch.amp.GradScaler(ctx.device.type, enabled=dtype == torch.float16)
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)  # a new shuffle each epoch
            for xb, yb in loader:
                xb, yb = xb.to(ctx.device), yb.to(ctx.device)
                # linear in 16 bits, cross_entropy in fp32 (the op lists of the amp docs)
                with torch.autocast(ctx.device.type, dtype=dtype, enabled=dtype is not None):
                    loss = F.cross_entropy(model(xb), yb)
                opt.zero_grad()
                scaler.scale(loss).backward()  # DDP all_reduces the (scaled) fp32 gradients here
                scaler.unscale_(opt)  # true gradients now, so clipping sees their real norm
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                scaler.step(opt)  # skips the step if fp16 gradients overflowed
                scaler.update()
        results[name] = held_out_loss(model, test_x, test_y, ctx), scaler
    check_16_bit_modes(results, args, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


def held_out_loss(model, x, y, ctx):
    """In fp32. DDP keeps the replicas identical, so every rank computes the same value."""
    with torch.no_grad():
        return F.cross_entropy(model.module(x.to(ctx.device)), y.to(ctx.device)).item()


def check_16_bit_modes(results, args, ctx):
    """Each 16-bit mode ends near the fp32 run, all on ctx.device. Bound: 16-bit matmuls round to
    8 (bf16) or 11 (fp16) significant bits and the runs drift apart by about that much: measured
    |diff| 0.0049/0.0054/0.0004/0.0000 (bf16) and <= 0.0006 (fp16) at 1/2/3/4 ranks on CPU with the
    defaults (`python ddp_basics/ddp_mixed_precision.py --nproc N`); CUDA's fp16/bf16 matmuls round
    to the same formats, accumulating in fp32. --tol 0.05 is 10x the worst measured, since the drift
    of a training run is not smooth in its rounding (at --lr 0.2 one rank drifted 0.27), and far
    below what a missing unscale_ gives (0.65 at 2 ranks, measured with that line left out). A
    step whose fp16 gradients overflow is skipped by GradScaler on every rank alike (DDP averages
    the gradients before unscale_, so every rank finds the same inf), and the scale is halved."""
    fp32 = results["fp32"][0]
    print0(f"fp32: held-out loss {fp32:.4f}")
    worst = 0.0
    for name, _ in MODES[1:]:
        loss, scaler = results[name]
        diff = abs(loss - fp32)
        worst = max(worst, diff)
        first = torch.amp.GradScaler(ctx.device.type).get_scale()  # the default initial scale
        scale = (
            f"; GradScaler scale {first:g} -> {scaler.get_scale():g} (halved at each skipped step)"
        )
        print0(
            f"{name}: held-out loss {loss:.4f} (|diff| to fp32 {diff:.4f}, tolerance {args.tol:g})"
            + (scale if scaler.is_enabled() else "")
        )
        if not diff <= args.tol:  # `not <=`: a NaN fails too
            raise RuntimeError(f"{name} ends {diff:.4f} away from the fp32 loss {fp32:.4f}")
    print0(
        f"OK: bf16 autocast and fp16 autocast + GradScaler under DDP on {ctx.device.type} end at "
        f"the fp32 held-out loss {fp32:.3f} within {worst:.3f} (tolerance {args.tol:g})"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--train", type=int_in(1, 10**7), default=1200, help="training examples")
    parser.add_argument("--test", type=int_in(1, 10**7), default=1000, help="held-out examples")
    parser.add_argument(
        "--batch", type=int_in(1, 10**6), default=16, help="examples per rank per step"
    )
    parser.add_argument("--epochs", type=int_in(1, 1000), default=3)
    parser.add_argument("--width", type=int_in(1, 16384), default=32, help="hidden width")
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.1)
    parser.add_argument(
        "--seed", type=int_in(0, 2**31 - 1), default=0, help="DistributedSampler's shuffle seed"
    )
    parser.add_argument(
        "--clip", type=float_in(0, 10**6, low_open=True), default=1.0, help="max gradient norm"
    )
    parser.add_argument(
        "--tol", type=float_in(0, 10), default=0.05, help="allowed |loss - fp32 loss|"
    )
    run(main, parser.parse_args())
