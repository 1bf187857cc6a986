"""Data parallelism by hand, without DDP: what DistributedDataParallel does for you.

1. broadcast the initial parameters from rank 0, so every replica starts the same;
2. each rank computes the gradient of the mean loss on its own shard of the global batch;
3. all_reduce every gradient: SUM then divide by world_size (or ReduceOp.AVG in one call),
   which gives the gradient of the mean loss over the whole global batch;
4. the same optimizer step on every rank keeps the replicas identical.
It checks that after --steps steps the parameters equal those of one process training on
the whole batch, and that all ranks hold identical parameters (max and min all_reduce).
--no-average skips step 3, to show that both checks then fail.

    torchrun --nproc_per_node=3 ddp_basics/manual_data_parallel.py
    python ddp_basics/manual_data_parallel.py --nproc 2 --no-average   # fails on purpose

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from launch.dist_setup import lesson_parser, print0, print_in_order, run
from toy import MLP, fp32_tolerance, make_data


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def spread_across_ranks(vector):
    """max over elements of (max over ranks - min over ranks): 0.0 iff all ranks hold the same vector."""
    high, low = vector.clone(), vector.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return (high - low).abs().max().item()


def train(args, ctx, x, y, op):
    torch.manual_seed(ctx.rank)  # deliberately different initial weights on each rank...
    model = MLP(args.width).to(ctx.device)
    before = spread_across_ranks(flat(model))
    for p in model.parameters():  # ...so that the broadcast visibly matters
        dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    shard = args.batch // ctx.world_size
    for step in range(args.steps):
        lo = step * args.batch + ctx.rank * shard  # this rank's slice of the step's global batch
        xb, yb = x[lo:lo + shard].to(ctx.device), y[lo:lo + shard].to(ctx.device)
        F.cross_entropy(model(xb), yb).backward()  # mean over this rank's shard only
        if not args.no_average:
            for p in model.parameters():
                if op == "sum":
                    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                    p.grad /= ctx.world_size  # equal shards: mean of shard means = mean of the batch
                else:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        opt.step()
        opt.zero_grad()
    return model, before


def single_process(args, ctx, x, y):
    """Independent reference: one process, rank 0's initial weights, the whole batch each step, on
    ctx.device (so that a GPU run compares GPU arithmetic with GPU arithmetic)."""
    torch.manual_seed(0)
    single = MLP(args.width).to(ctx.device)
    opt = torch.optim.SGD(single.parameters(), lr=args.lr)
    for step in range(args.steps):
        lo = step * args.batch
        xb, yb = x[lo:lo + args.batch].to(ctx.device), y[lo:lo + args.batch].to(ctx.device)
        F.cross_entropy(single(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    return flat(single)


def main(args, ctx):
    ctx.require(args.batch % ctx.world_size == 0,
                f"--batch {args.batch} must divide by {ctx.world_size} ranks (equal shards): pick a multiple")
    x, y = make_data(args.batch * args.steps, seed=0)  # every rank builds the same data, on the CPU
    runs = {op: train(args, ctx, x, y, op) for op in ("sum", "avg")}

    expected = single_process(args, ctx, x, y)
    # Same device, same float32 arithmetic: the runs differ only in summation order (shard means
    # averaged vs one mean), a few ulp per step; measured 6e-8 after 20 steps on CPU. Tolerance:
    tol = fp32_tolerance(args.tol)  # widened only if TF32 matmuls are on (see toy.py)
    failures = []
    for op, (model, before) in runs.items():
        params = flat(model)
        diff = (params - expected).abs().max().item()
        spread = spread_across_ranks(params)
        name = "none (--no-average)" if args.no_average else {"sum": "SUM then /N", "avg": "AVG"}[op]
        print_in_order(f"{name}: sum of params {params.double().sum().item():+.6f}, "
                       f"max |param - single process| {diff:.2e}")
        print0(f"{name}: spread across ranks before broadcast {before:.2e}, after {args.steps} steps {spread:.2e}")
        if not diff <= tol:  # `not <=`: a NaN fails too
            failures.append(f"{name}: params differ from single-process training by {diff:.2e} > {tol:g}")
        if spread != 0.0:
            failures.append(f"{name}: ranks hold different params (spread {spread:.2e})")
        if args.no_average:
            break  # the op is never used
    if failures:
        raise RuntimeError("; ".join(failures))
    print0(f"OK: {ctx.world_size} ranks, {args.steps} steps, all_reduce SUM/N and AVG of the gradients both "
           f"match single-process training on the whole batch of {args.batch} (tolerance {tol:g}); "
           f"params identical across ranks")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--batch", type=int, default=96, help="global batch per step (divides by 1, 2, 3, 4)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--tol", type=float, default=1e-5, help="max |param difference| allowed (float32 sums)")
    parser.add_argument("--no-average", action="store_true",
                        help="skip the gradient all_reduce (each rank steps on its own shard): the checks fail")
    run(main, parser.parse_args())
