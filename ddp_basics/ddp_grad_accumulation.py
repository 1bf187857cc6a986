"""Gradient accumulation with DDP: no_sync() on the micro-batches, one all_reduce per step.

Each optimizer step sees a global batch of world_size * accum * micro examples. Every rank
runs `accum` micro-batches; the first accum-1 run under `model.no_sync()` (gradients add up
locally, nothing is sent), the last one lets DDP all_reduce (average) the summed gradients.
Each micro-batch loss is divided by `accum`, so the result is the gradient of the mean loss
over the whole global batch. A comm hook that counts its calls shows the communication.

    torchrun --nproc_per_node=3 ddp_basics/ddp_grad_accumulation.py
    python ddp_basics/ddp_grad_accumulation.py --nproc 2 --accum 8

Docs: https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html#torch.nn.parallel.DistributedDataParallel.no_sync
"""
import copy

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.dist_setup import lesson_parser, print0, run
from toy import MLP, fp32_tolerance, make_data


def counting_allreduce(state, bucket):
    """The default all_reduce hook, counting each bucket it sends (state is a dict)."""
    state["calls"] += 1
    return default_hooks.allreduce_hook(None, bucket)  # None: the default (WORLD) group


def train(args, ctx, x, y, reference, use_no_sync):
    """Train a DDP copy of `reference` for args.steps steps; return (model, all_reduces per step)."""
    model = DDP(copy.deepcopy(reference).to(ctx.device))
    state = {"calls": 0}
    model.register_comm_hook(state, counting_allreduce)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    per_rank = args.accum * args.micro
    for step in range(args.steps):
        start = (step * ctx.world_size + ctx.rank) * per_rank  # this rank's share of the global batch
        for i in range(args.accum):
            lo = start + i * args.micro
            xb, yb = x[lo:lo + args.micro].to(ctx.device), y[lo:lo + args.micro].to(ctx.device)
            last = i == args.accum - 1
            if use_no_sync and not last:
                with model.no_sync():  # gradients accumulate in .grad, no communication
                    (F.cross_entropy(model(xb), yb) / args.accum).backward()
            else:
                (F.cross_entropy(model(xb), yb) / args.accum).backward()
        opt.step()
        opt.zero_grad()
    return model.module, state["calls"] / args.steps


def main(args, ctx):
    ctx.require(args.accum >= 1 and args.micro >= 1, "--accum and --micro must be at least 1")
    global_batch = ctx.world_size * args.accum * args.micro
    x, y = make_data(global_batch * args.steps, seed=0)
    torch.manual_seed(0)  # the same initial model on every rank (DDP would broadcast rank 0's anyway)
    reference = MLP(args.width).to(ctx.device)

    model, sends = train(args, ctx, x, y, reference, use_no_sync=True)
    _, sends_without = train(args, ctx, x, y, reference, use_no_sync=False)

    # Independent check: one process on ctx.device, plain SGD on the whole global batch at each step.
    # Same device and float32 arithmetic: the runs differ by summation order only (micro-batch means
    # added, rank sums averaged, vs one mean), a few ulp per step: measured 6e-8 after 20 steps on CPU.
    tol = fp32_tolerance(args.tol)  # widened only if TF32 matmuls are on (see toy.py)
    single = copy.deepcopy(reference)
    opt = torch.optim.SGD(single.parameters(), lr=args.lr)
    for step in range(args.steps):
        lo = step * global_batch
        xb, yb = x[lo:lo + global_batch].to(ctx.device), y[lo:lo + global_batch].to(ctx.device)
        F.cross_entropy(single(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    worst = max((p.detach() - q.detach()).abs().max().item() for p, q in zip(model.parameters(), single.parameters()))
    print0(f"global batch {global_batch} = {ctx.world_size} ranks x {args.accum} micro-batches x {args.micro}")
    print0(f"all_reduce calls per step: {sends:g} with no_sync, {sends_without:g} without")
    print0(f"max |param - single-process param| after {args.steps} steps: {worst:.2e} (tolerance {tol:g})")
    if not worst <= tol:  # `not <=`: a NaN fails too
        raise RuntimeError(f"accumulated DDP training differs from the large batch by {worst:.2e}")
    if sends_without != args.accum * sends:
        raise RuntimeError(f"expected {args.accum}x fewer all_reduces with no_sync, got {sends} vs {sends_without}")
    print0(f"OK: {args.accum} micro-batches per step under no_sync match the large batch "
           f"(max diff {worst:.1e}) with {sends:g} all_reduce(s) per step instead of {sends_without:g} without it")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--micro", type=int, default=16, help="examples per micro-batch per rank")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--tol", type=float, default=1e-5)
    run(main, parser.parse_args())
