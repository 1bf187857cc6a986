"""DDP communication hooks: compress the gradients before DDP all_reduces them.

A comm hook replaces what DDP does with each gradient bucket. By default DDP divides the
gradients by the world size first (while copying them into the bucket: reducer.cpp), then
all_reduces the bucket with SUM; the built-in allreduce_hook does the same, dividing first "to
avoid overflow, especially for FP16" (torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py,
torch 2.13). The built-in compression hooks trade precision for bytes on the wire:
  fp16_compress_hook / bf16_compress_hook   send 16-bit gradients (half the bytes);
  PowerSGD                                  sends two thin matrices P, Q per weight matrix
                                            (a rank-r approximation), with error feedback.
The lesson counts the bytes actually handed to all_reduce per step by wrapping
torch.distributed.all_reduce (the hooks call it), and checks the model still learns.

    torchrun --nproc_per_node=3 ddp_basics/ddp_comm_hooks.py
    python ddp_basics/ddp_comm_hooks.py --nproc 2 --width 256

Docs: https://pytorch.org/docs/stable/ddp_comm_hooks.html
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.dist_setup import lesson_parser, print0, run
from toy import MLP, accuracy, make_data


def train(args, ctx, start, x, y, register):
    """Train a DDP copy of start with the hook `register` installs; return (accuracy, bytes/step)."""
    model = DDP(copy.deepcopy(start))
    register(model)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sent = []
    plain_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *rest, **kwargs):  # what every hook ends up calling
        sent[-1] += tensor.numel() * tensor.element_size()
        return plain_all_reduce(tensor, *rest, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        for step in range(args.steps):
            sent.append(0)
            lo = (step * ctx.world_size + ctx.rank) * args.batch
            xb, yb = x[lo : lo + args.batch].to(ctx.device), y[lo : lo + args.batch].to(ctx.device)
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()
    finally:
        dist.all_reduce = plain_all_reduce
    xt, yt = make_data(2000, seed=1)
    return accuracy(model.module, xt.to(ctx.device), yt.to(ctx.device)), sent[
        -1
    ]  # last step: past warm-up


def main(args, ctx):
    x, y = make_data(args.steps * ctx.world_size * args.batch, seed=0)
    torch.manual_seed(0)
    start = MLP(args.width).to(ctx.device)
    n_params = sum(p.numel() for p in start.parameters())

    def power_sgd(model):
        state = powerSGD.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.rank, start_powerSGD_iter=2
        )  # plain all_reduce for the first step(s)
        model.register_comm_hook(state, powerSGD.powerSGD_hook)

    hooks = {
        # DDP's built-in all_reduce runs in C++; allreduce_hook is the same thing in Python, so it is counted
        "allreduce_hook (fp32)": lambda model: model.register_comm_hook(
            None, default_hooks.allreduce_hook
        ),
        "fp16_compress_hook": lambda model: model.register_comm_hook(
            None, default_hooks.fp16_compress_hook
        ),
        f"PowerSGD rank {args.rank}": power_sgd,
    }
    if (
        ctx.backend == "nccl"
    ):  # DDP refuses it elsewhere: "required CUDA 11+ and NCCL 2.10+ or XPU and XCCL"
        hooks["bf16_compress_hook"] = lambda model: model.register_comm_hook(
            None, default_hooks.bf16_compress_hook
        )
    else:
        print0(f"bf16_compress_hook: needs NCCL (or XCCL), skipped on {ctx.backend}")
    print0(f"model: {n_params} parameters = {4 * n_params} bytes of fp32 gradients per step")
    results = {}
    for name, register in hooks.items():
        results[name] = train(args, ctx, start, x, y, register)
        acc, sent = results[name]
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
        if "16" in name and sent != base // 2:
            raise RuntimeError(f"{name} sent {sent} bytes, expected half of {base}")
        if "PowerSGD" in name and not sent < base:
            raise RuntimeError(f"PowerSGD sent {sent} bytes, not fewer than {base}")
        if acc < args.target:
            raise RuntimeError(
                f"{name}: held-out accuracy {acc:.3f} is below the target {args.target}"
            )
    ratio = results[f"PowerSGD rank {args.rank}"][1] / base
    print0(
        f"OK: {'fp16/bf16' if ctx.backend == 'nccl' else 'fp16'} compression sends half the bytes, PowerSGD {ratio:.0%}; every run reaches held-out "
        f"accuracy >= {args.target} (lowest {min(a for a, _ in results.values()):.3f})"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=32, help="examples per rank per step")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD's matrix approximation rank")
    parser.add_argument(
        "--target", type=float, default=0.75, help="held-out accuracy every run must reach"
    )
    run(main, parser.parse_args())
