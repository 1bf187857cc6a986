"""DDP communication hooks: compress the gradients before DDP all_reduces them.

A comm hook replaces what DDP does with each gradient bucket. By default DDP divides the
gradients by the world size first (while copying them into the bucket: reducer.cpp), then
all_reduces the bucket with SUM; the built-in allreduce_hook does the same, dividing first "to
avoid overflow, especially for FP16" (torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py,
torch 2.13). The built-in compression hooks trade precision for bytes on the wire:
  fp16_compress_hook / bf16_compress_hook   send 16-bit gradients (half the bytes);
  PowerSGD                                  sends two thin matrices P, Q per weight matrix
                                            (rank r: --powersgd-rank), with error feedback.
The lesson counts the bytes actually handed to all_reduce per step by wrapping
torch.distributed.all_reduce (the hooks call it), and checks the model still learns.

    torchrun --nproc_per_node=3 ddp_basics/ddp_comm_hooks.py
    python ddp_basics/ddp_comm_hooks.py --nproc 2 --width 256

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/ddp_comm_hooks.html
"""

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.dist_setup import float_in, int_in, lesson_parser, print0, run
from toy import MLP, accuracy, make_data


def train(args, ctx, start, x, y, state, hook):
    """Train a DDP copy of start with a comm hook; return (held-out accuracy, bytes handed to
    all_reduce in the last step, past PowerSGD's plain first steps)."""
    model = DDP(copy.deepcopy(start))
    model.register_comm_hook(state, hook)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    with counting_all_reduce() as sent:  # bytes per step, by wrapping dist.all_reduce
        for step in range(args.steps):
            sent.append(0)
            lo = (step * ctx.world_size + ctx.rank) * args.batch
            xb, yb = x[lo : lo + args.batch].to(ctx.device), y[lo : lo + args.batch].to(ctx.device)
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()
    xt, yt = make_data(2000, seed=1)
    return accuracy(model.module, xt.to(ctx.device), yt.to(ctx.device)), sent[-1]


def main(args, ctx):
    # powerSGD_hook.py's _should_compress: a width x width matrix only if (2 width) r * 2 < width^2
    ctx.require(4 * args.powersgd_rank < args.width, "needs --powersgd-rank < --width / 4")
    x, y = make_data(args.steps * ctx.world_size * args.batch, seed=0)
    torch.manual_seed(0)
    start = MLP(args.width).to(ctx.device)
    # PowerSGD: plain all_reduce for the first 2 steps, then the rank-r factors P and Q
    power_sgd = powerSGD.PowerSGDState(
        process_group=None, matrix_approximation_rank=args.powersgd_rank, start_powerSGD_iter=2
    )
    hooks = {  # name: (state, hook); allreduce_hook: DDP's own all_reduce, in Python (counted)
        "allreduce_hook (fp32)": (None, default_hooks.allreduce_hook),
        "fp16_compress_hook": (None, default_hooks.fp16_compress_hook),
        f"PowerSGD (matrix rank {args.powersgd_rank})": (power_sgd, powerSGD.powerSGD_hook),
    }
    if ctx.backend == "nccl":  # DDP refuses it elsewhere: "required CUDA 11+ and NCCL 2.10+ ..."
        hooks["bf16_compress_hook"] = (None, default_hooks.bf16_compress_hook)
    else:
        print0(f"bf16_compress_hook: needs NCCL (or XCCL), skipped on {ctx.backend}")
    results = {}
    for name, (state, hook) in hooks.items():
        results[name] = train(args, ctx, start, x, y, state, hook)  # (accuracy, bytes sent)
    check(results, start, args, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


@contextlib.contextmanager
def counting_all_reduce():
    """Inside: torch.distributed.all_reduce (what every hook ends up calling) adds the bytes it is
    handed to the last entry of the list it yields."""
    sent, plain_all_reduce = [], dist.all_reduce

    def counting(tensor, *rest, **kwargs):
        sent[-1] += tensor.numel() * tensor.element_size()
        return plain_all_reduce(tensor, *rest, **kwargs)

    dist.all_reduce = counting
    try:
        yield sent
    finally:
        dist.all_reduce = plain_all_reduce


def check(results, start, args, ctx):
    """Plain DDP sends every fp32 gradient, fp16/bf16 half of that, PowerSGD less; every run
    reaches --target held-out accuracy."""
    n_params = sum(p.numel() for p in start.parameters())
    print0(f"model: {n_params} parameters = {4 * n_params} bytes of fp32 gradients per step")
    for name, (acc, sent) in results.items():
        print0(
            f"{name:24s} bytes sent per step {sent:8d} ({sent / (4 * n_params):5.1%}), "
            f"held-out accuracy {acc:.3f}"
        )
    base = results["allreduce_hook (fp32)"][1]
    if base != 4 * n_params:
        raise RuntimeError(
            f"plain DDP sent {base} bytes per step, expected every fp32 gradient: {4 * n_params}"
        )
    for name, (acc, sent) in results.items():
        if name in ("fp16_compress_hook", "bf16_compress_hook") and sent != base // 2:
            raise RuntimeError(f"{name} sent {sent} bytes, expected half of {base}")
        if "PowerSGD" in name and not sent < base:
            raise RuntimeError(f"PowerSGD sent {sent} bytes, not fewer than {base}")
        if acc < args.target:
            raise RuntimeError(
                f"{name}: held-out accuracy {acc:.3f} is below the target {args.target}"
            )
    ratio = results[f"PowerSGD (matrix rank {args.powersgd_rank})"][1] / base
    half = "fp16/bf16" if ctx.backend == "nccl" else "fp16"
    lowest = min(a for a, _ in results.values())
    print0(
        f"OK: {half} compression sends half the bytes, PowerSGD {ratio:.0%}; every run reaches "
        f"held-out accuracy >= {args.target} (lowest {lowest:.3f})"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--steps",
        type=int_in(3, 10_000),
        default=120,
        help="training steps (PowerSGD compresses from the third on)",
    )
    parser.add_argument(
        "--batch", type=int_in(1, 10**5), default=32, help="examples per rank per step"
    )
    parser.add_argument("--width", type=int_in(1, 16384), default=64, help="hidden width")
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.01)
    parser.add_argument(
        "--powersgd-rank",
        type=int_in(1, 1024),
        default=2,
        help="PowerSGD's matrix_approximation_rank (not a process's rank)",
    )
    parser.add_argument(
        "--target", type=float_in(0, 1), default=0.75, help="held-out accuracy every run must reach"
    )
    run(main, parser.parse_args())
