"""Gradient accumulation with DDP: no_sync() on the micro-batches, one all_reduce per step.

Each optimizer step sees a global batch of world_size * accum * batch examples. Every rank
runs `accum` micro-batches; the first accum-1 run under `model.no_sync()` (gradients add up
locally, nothing is sent), the last one lets DDP all_reduce (average) the summed gradients.
Each micro-batch loss is divided by `accum`, so the result is the gradient of the mean loss
over the whole global batch. A comm hook that counts its calls shows the communication.

    torchrun --nproc_per_node=3 ddp_basics/ddp_grad_accumulation.py
    python ddp_basics/ddp_grad_accumulation.py --nproc 2 --accum 8

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs (DistributedDataParallel.no_sync):
  https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html
"""

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from launch.dist_setup import float_in, int_in, lesson_parser, print0, run
from toy import MLP, flat, fp32_tolerance, global_batches, make_data


def main(args, ctx):
    x, y = make_data(args.train, seed=0)  # every rank builds the same data, on the CPU
    dataset = TensorDataset(x, y)
    # this rank's 1/N of the data set (the rank and N come from the process group)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)  # micro-batches
    ctx.require(
        len(sampler) % args.batch == 0 and len(loader) % args.accum == 0,
        f"{len(sampler)} examples per rank do not make whole steps of --accum {args.accum} x "
        f"--batch {args.batch}: make --train a multiple of {args.accum * args.batch} x ranks",
    )
    torch.manual_seed(0)
    model = MLP(args.width).to(ctx.device)
    model = DDP(model, device_ids=None if ctx.device.type == "cpu" else [ctx.device])
    sends = count_all_reduces(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch
        for i, (xb, yb) in enumerate(loader):
            xb, yb = xb.to(ctx.device), yb.to(ctx.device)
            if (i + 1) % args.accum:
                # the forward too: DDP decides in forward whether backward syncs
                # (DistributedDataParallel.forward, torch/nn/parallel/distributed.py, torch 2.13)
                with model.no_sync():  # gradients add up in .grad, nothing is sent
                    # the step's loss is the mean over its accum micro-batches
                    loss = F.cross_entropy(model(xb), yb) / args.accum
                    loss.backward()
            else:
                loss = F.cross_entropy(model(xb), yb) / args.accum
                loss.backward()  # DDP all_reduces (averages) the accumulated gradients
                opt.step()
                opt.zero_grad()
    steps = args.epochs * len(loader) // args.accum
    sends_without = count_without_no_sync(loader, args, ctx)
    check_matches_large_batch(model, x, y, args, ctx, sends["calls"] / steps, sends_without)


# ---- The lesson ends here. What follows is how it checks itself. ----


def count_all_reduces(model):
    """A comm hook (ddp_comm_hooks.py teaches them) replaces DDP's all_reduce of each gradient
    bucket: this one counts, then does the default all_reduce."""
    state = {"calls": 0}

    def hook(state, bucket):
        state["calls"] += 1
        return default_hooks.allreduce_hook(None, bucket)  # None: the default (WORLD) group

    model.register_comm_hook(state, hook)
    return state


def count_without_no_sync(loader, args, ctx):
    """The same micro-batches without no_sync: all_reduces per optimizer step."""
    device_ids = None if ctx.device.type == "cpu" else [ctx.device]
    model = DDP(MLP(args.width).to(ctx.device), device_ids=device_ids)
    sends = count_all_reduces(model)
    for i, (xb, yb) in enumerate(loader):
        (F.cross_entropy(model(xb.to(ctx.device)), yb.to(ctx.device)) / args.accum).backward()
        if (i + 1) % args.accum == 0:
            model.zero_grad()
    return sends["calls"] / (len(loader) // args.accum)


def check_matches_large_batch(model, x, y, args, ctx, sends, sends_without):
    """Independent: one process on ctx.device, at each step the whole global batch (every rank's
    accum micro-batches, rebuilt by hand with toy.global_batches). Same device and float32
    arithmetic: the runs differ by summation order only (micro-batch means added, rank sums
    averaged, vs one mean), a few ulp per step; measured 1-2e-7 after 3 epochs on CPU; --tol 1e-5,
    widened only if TF32 matmuls are on."""
    torch.manual_seed(0)
    single = MLP(args.width).to(ctx.device)
    opt = torch.optim.SGD(single.parameters(), lr=args.lr, momentum=0.9)
    xd, yd = x.to(ctx.device), y.to(ctx.device)
    for epoch in range(args.epochs):
        micro = global_batches(len(x), ctx.world_size, args.seed, epoch, args.batch)
        for s in range(0, len(micro), args.accum):
            idx = [i for m in micro[s : s + args.accum] for i in m]
            F.cross_entropy(single(xd[idx]), yd[idx]).backward()
            opt.step()
            opt.zero_grad()
    worst, tol = (flat(model) - flat(single)).abs().max().item(), fp32_tolerance(args.tol)
    print0(
        f"global batch {ctx.world_size * args.accum * args.batch} = {ctx.world_size} ranks x "
        f"{args.accum} micro-batches x {args.batch}"
    )
    print0(f"all_reduce calls per step: {sends:g} with no_sync, {sends_without:g} without")
    print0(
        f"max |param - single-process param| after {args.epochs} epochs: {worst:.2e} "
        f"(tolerance {tol:g})"
    )
    if not worst <= tol:  # `not <=`: a NaN fails too
        raise RuntimeError(f"accumulated DDP training differs from the large batch by {worst:.2e}")
    if sends_without != args.accum * sends:
        raise RuntimeError(
            f"expected {args.accum}x fewer all_reduces with no_sync, got {sends} vs {sends_without}"
        )
    print0(
        f"OK: {args.accum} micro-batches per step under no_sync match the large batch "
        f"(max diff {worst:.1e}) with {sends:g} all_reduce(s) per step instead of "
        f"{sends_without:g} without it"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--accum",
        type=int_in(2, 1024),
        default=4,
        help="micro-batches per optimizer step (one alone would accumulate nothing)",
    )
    parser.add_argument(
        "--train",
        type=int_in(1, 10**7),
        default=1536,
        help="training examples (a multiple of accum x batch x ranks)",
    )
    parser.add_argument(
        "--batch", type=int_in(1, 10**6), default=16, help="examples per rank per micro-batch"
    )
    parser.add_argument("--epochs", type=int_in(1, 1000), default=3)
    parser.add_argument("--width", type=int_in(1, 16384), default=32, help="hidden width")
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.2)
    parser.add_argument(
        "--seed", type=int_in(0, 2**31 - 1), default=0, help="DistributedSampler's shuffle seed"
    )
    parser.add_argument(
        "--tol", type=float_in(0, 1), default=1e-5, help="max |param difference| allowed (float32)"
    )
    run(main, parser.parse_args())
