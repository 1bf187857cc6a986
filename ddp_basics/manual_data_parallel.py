"""Data parallelism by hand, without DDP: what DistributedDataParallel does for you.

1. broadcast the initial parameters from rank 0, so every replica starts the same;
2. each rank computes the gradient of the mean loss on its own batch (DistributedSampler
   gives each rank its own 1/N of the data, reshuffled each epoch by set_epoch);
3. all_reduce every gradient: SUM then divide by world_size (--op sum), or ReduceOp.AVG in
   one call (--op avg): the gradient of the mean loss over the whole global batch;
4. the same optimizer step on every rank keeps the replicas identical.
Checks: the parameters equal one process trained on the concatenation of every rank's batch
(rebuilt by hand from the sampler's order), and all ranks hold identical parameters (max and min
all_reduce).

    torchrun --nproc_per_node=3 ddp_basics/manual_data_parallel.py
    python ddp_basics/manual_data_parallel.py --nproc 2 --op avg

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run
from toy import MLP, check_matches_single_process, flat, make_data, spread


def main(args, ctx):
    x, y = make_data(args.train, seed=0)  # every rank builds the same data, on the CPU
    dataset = TensorDataset(x, y)
    # this rank's 1/N of the data set (the rank and N come from the process group)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
    torch.manual_seed(ctx.rank)  # different on purpose: the broadcast makes them rank 0's
    model = MLP(args.width).to(ctx.device)
    for p in model.parameters():  # 1. every replica starts from rank 0's weights
        dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch
        for xb, yb in loader:
            xb, yb = xb.to(ctx.device), yb.to(ctx.device)
            loss = F.cross_entropy(model(xb), yb)  # 2. the mean over this rank's batch only
            opt.zero_grad()
            loss.backward()
            # 3. the mean over every rank's batch (equal sizes: the mean of the ranks' means)
            for p in model.parameters():
                if args.op == "avg":
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
                else:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                    p.grad /= ctx.world_size
            opt.step()  # 4. the same update everywhere
    check(model, x, y, sampler, args, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


def check(model, x, y, sampler, args, ctx):
    """One process on the global batches (toy.check_matches_single_process), and the spread of the
    parameters across ranks, now and before the broadcast (each rank's own initial weights, built
    again with its seed)."""
    name = {"sum": "SUM then /N", "avg": "AVG"}[args.op]
    torch.manual_seed(ctx.rank)
    before = spread(flat(MLP(args.width).to(ctx.device)))
    diff, tol = check_matches_single_process(model, x, y, sampler, args, ctx)
    after = spread(flat(model))
    print_in_order(
        f"{name}: sum of params {flat(model).double().sum().item():+.6f}, "
        f"max |param - single process| {diff:.2e}"
    )
    print0(
        f"{name}: spread across ranks before broadcast {before:.2e}, "
        f"after {args.epochs} epochs {after:.2e}"
    )
    failures = []
    if not diff <= tol:  # `not <=`: a NaN fails too
        failures.append(
            f"{name}: params differ from single-process training by {diff:.2e} > {tol:g}"
        )
    if after != 0.0:
        failures.append(f"{name}: ranks hold different params (spread {after:.2e})")
    if failures:
        raise RuntimeError("; ".join(failures))
    print0(
        f"OK: {ctx.world_size} ranks, {args.epochs} epochs, all_reduce {name} of the gradients "
        f"matches single-process training on the global batches (tolerance {tol:g}); params "
        "identical across ranks"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--op",
        choices=["sum", "avg"],
        default="sum",
        help="all_reduce SUM then divide by world_size, or ReduceOp.AVG",
    )
    parser.add_argument("--train", type=int_in(1, 10**7), default=1200, help="training examples")
    parser.add_argument(
        "--batch", type=int_in(1, 10**6), default=16, help="examples per rank per step"
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
