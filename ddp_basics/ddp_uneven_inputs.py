"""Ranks with different numbers of batches: the hang, and the Join context manager that fixes it.

Every backward of a DDP model all_reduces the gradients, a collective that every rank must join.
If rank 0 runs out of data first, the others wait in that all_reduce for a partner that never
comes: a hang (until the group's timeout), shown here on a group with a short timeout. Then
`Join([model])`: a rank that runs out of batches "joins" and shadows the others' all_reduces
with zero gradients until every rank is done (gradients are divided by the initial world size).

    torchrun --nproc_per_node=3 ddp_basics/ddp_uneven_inputs.py
    python ddp_basics/ddp_uneven_inputs.py --nproc 2 --hang-timeout 2

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/tutorials/advanced/generic_join.html
"""

import copy
import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run
from toy import MLP, fp32_tolerance, make_data


def first_batch(rank, batches):
    """Rank r owns batches + r batches, laid out rank after rank: it starts after
    sum over q < r of (batches + q) = r * batches + r * (r - 1) / 2 of them."""
    return rank * batches + rank * (rank - 1) // 2


def batch(x, y, args, rank, step):
    lo = (first_batch(rank, args.batches) + step) * args.batch
    return x[lo : lo + args.batch], y[lo : lo + args.batch]


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    ctx.require(args.hang_timeout < args.timeout, "--hang-timeout must be below --timeout")
    mine = args.batches + ctx.rank  # uneven on purpose: rank 0 has the fewest
    x, y = make_data(sum(args.batches + r for r in range(ctx.world_size)) * args.batch, seed=0)
    torch.manual_seed(0)
    start = MLP(args.width).to(ctx.device)

    # 1. Without Join, on a Gloo group (CPU tensors): its short timeout fails cleanly, NCCL's aborts
    short = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.hang_timeout))
    model = DDP(copy.deepcopy(start).cpu(), process_group=short)
    outcome = f"finished its {mine} batches and left"
    try:
        for step in range(mine):
            xb, yb = batch(x, y, args, ctx.rank, step)
            F.cross_entropy(model(xb), yb).backward()
    except RuntimeError as error:  # the ranks still inside the all_reduce of step `batches`
        why = str(error).strip().splitlines()[0].split("] ")[-1][:70]
        outcome = f"stuck in backward's all_reduce at batch {step}, failed after "
        outcome += f"{args.hang_timeout:g}s: {why}"
    print_in_order(f"without Join: {outcome}")

    # 2. With Join: the same uneven loop finishes on every rank.
    model = DDP(copy.deepcopy(start))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    with Join([model]):
        for step in range(mine):
            xb, yb = batch(x, y, args, ctx.rank, step)
            F.cross_entropy(model(xb.to(ctx.device)), yb.to(ctx.device)).backward()
            opt.step()
            opt.zero_grad()
    first, total = first_batch(ctx.rank, args.batches), len(x) // args.batch
    print_in_order(
        f"with Join: ran its {mine} batches ({first}..{first + mine - 1} of 0..{total - 1}); "
        "joined ranks shadowed the all_reduces they lacked"
    )
    check_without_join(outcome, ctx)
    check_against_one_process(model, start, x, y, args, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_without_join(outcome, ctx):
    if ctx.rank > 0 and outcome.startswith("finished"):
        raise RuntimeError("expected the ranks with more batches to wait and time out")


def check_against_one_process(model, start, x, y, args, ctx):
    """One process on ctx.device, the data cut into the ranks' shares by torch.split (not by
    `batch` above): at step s the gradient is the sum over the ranks that still had a batch of
    their mean-loss gradient, divided by the initial world size W. Same device and float32
    arithmetic, so only summation order differs: measured 3e-8 on CPU, bound 1e-5."""
    W, B = ctx.world_size, args.batch
    sizes = [(args.batches + r) * B for r in range(W)]
    shares = list(zip(torch.split(x, sizes), torch.split(y, sizes)))
    single = copy.deepcopy(start)
    opt = torch.optim.SGD(single.parameters(), lr=args.lr)
    for step in range(args.batches + W - 1):
        live = [
            (xs[step * B : (step + 1) * B], ys[step * B : (step + 1) * B])
            for xs, ys in shares
            if step * B < len(xs)
        ]
        loss = sum(F.cross_entropy(single(xb.to(ctx.device)), yb.to(ctx.device)) for xb, yb in live)
        (loss / W).backward()
        opt.step()
        opt.zero_grad()
    worst = max(
        (p.detach() - q.detach()).abs().max().item()
        for p, q in zip(model.module.parameters(), single.parameters())
    )
    tol = fp32_tolerance(1e-5)  # widened only if TF32 matmuls are on (see toy.py)
    print0(f"max |param - single-process param| = {worst:.2e} (tolerance {tol:g})")
    if not worst <= tol:  # `not <=`: a NaN (an empty batch's loss) fails too
        raise RuntimeError(
            f"training under Join differs from the single-process computation by {worst:.2e}"
        )
    print0(
        f"OK: uneven inputs ({args.batches}..{args.batches + W - 1} batches per rank) time out "
        "without Join and finish with Join, matching single-process training "
        f"(max diff {worst:.1e})"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument(
        "--batches",
        type=int_in(1, 10_000),
        default=3,
        help="batches on rank 0; rank r has batches + r",
    )
    parser.add_argument("--batch", type=int_in(1, 10**5), default=16, help="examples per batch")
    parser.add_argument("--width", type=int_in(1, 16384), default=32, help="hidden width")
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.5)
    parser.add_argument(
        "--hang-timeout",
        type=float_in(0, 600, low_open=True),
        default=3.0,
        help="seconds before the hang fails",
    )
    run(main, parser.parse_args())
