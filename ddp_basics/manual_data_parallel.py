"""Data parallelism by hand, without DDP: what DistributedDataParallel does for you.

1. broadcast the initial parameters from rank 0, so every replica starts the same;
2. each rank computes the gradient of the mean loss on its own batch (DistributedSampler
   gives each rank its own 1/N of the data, reshuffled each epoch by set_epoch);
3. all_reduce every gradient: SUM then divide by world_size (--op sum), or ReduceOp.AVG in
   one call (--op avg): the gradient of the mean loss over the whole global batch;
4. the same optimizer step on every rank keeps the replicas identical.
Checks: the parameters equal one process trained on the concatenation of every rank's batch
(rebuilt by hand from the sampler's order), and all ranks hold identical parameters (max and min
all_reduce). --no-average skips step 3, to show that both checks then fail.

    torchrun --nproc_per_node=3 ddp_basics/manual_data_parallel.py
    python ddp_basics/manual_data_parallel.py --nproc 2 --op avg
    python ddp_basics/manual_data_parallel.py --nproc 2 --no-average   # fails on purpose

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from launch.dist_setup import lesson_parser, print0, print_in_order, run, test_flags
from toy import MLP, check_matches_single_process, flat, make_data, spread


def main(args, ctx):
    x, y = make_data(args.train, seed=0)  # every rank builds the same data, on the CPU
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(
        dataset, shuffle=True, seed=args.seed
    )  # this rank's 1/N (rank, N from the group)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
    torch.manual_seed(ctx.rank)  # different on purpose: the broadcast makes them rank 0's
    model = MLP(args.width).to(ctx.device)
    before = spread(flat(model))
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
            if (
                not args.no_average
            ):  # 3. the mean over every rank's batch (equal sizes: the mean of the means)
                for p in model.parameters():
                    if args.op == "avg":
                        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
                    else:
                        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                        p.grad /= ctx.world_size
            opt.step()  # 4. the same update everywhere

    name = (
        "none (--no-average)" if args.no_average else {"sum": "SUM then /N", "avg": "AVG"}[args.op]
    )
    diff, tol = check_matches_single_process(model, x, y, sampler, args, ctx)
    after = spread(flat(model))
    print_in_order(
        f"{name}: sum of params {flat(model).double().sum().item():+.6f}, "
        f"max |param - single process| {diff:.2e}"
    )
    print0(
        f"{name}: spread across ranks before broadcast {before:.2e}, after {args.epochs} epochs {after:.2e}"
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
        f"OK: {ctx.world_size} ranks, {args.epochs} epochs, all_reduce {name} of the gradients matches "
        f"single-process training on the global batches (tolerance {tol:g}); params identical across ranks"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--op",
        choices=["sum", "avg"],
        default="sum",
        help="all_reduce SUM then divide by world_size, or ReduceOp.AVG",
    )
    parser.add_argument("--train", type=int, default=1200, help="training examples")
    parser.add_argument("--batch", type=int, default=16, help="examples per rank per step")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0, help="DistributedSampler's shuffle seed")
    parser.add_argument(
        "--tol", type=float, default=1e-5, help="max |param difference| allowed (float32)"
    )
    test_flags(parser).add_argument(
        "--no-average",
        action="store_true",
        help="skip the gradient all_reduce (each rank steps on its own batch): the checks fail",
    )
    run(main, parser.parse_args())
