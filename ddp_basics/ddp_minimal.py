"""The same job as manual_data_parallel.py with DistributedDataParallel and DistributedSampler.

DDP broadcasts rank 0's weights when it wraps the model and averages the gradients during
backward; DistributedSampler gives each rank its own 1/N of a shuffled data set, and
`set_epoch(epoch)` reshuffles it each epoch (without it every epoch repeats epoch 0's order:
measured below). Rank 0 alone draws a tqdm bar; the evaluation is split across the ranks
and its sums are all_reduced, so every rank gets the same metric. Checks: the parameters
equal one process trained on the same global batches (rebuilt by hand from the sampler's
order, from rank 0's initial weights), they are identical on every rank, and the
all_reduced metric equals the whole held-out set scored by each rank alone.
--show-eval-hang first shows the classic bug, an evaluation on rank 0 only: a hang (here under
a timeout of a few seconds).

    torchrun --nproc_per_node=2 ddp_basics/ddp_minimal.py
    python ddp_basics/ddp_minimal.py --nproc 3 --epochs 10 --show-eval-hang

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/tutorials/intermediate/ddp_tutorial.html
      https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler
"""

import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from tqdm import tqdm

from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run
from toy import MLP, check_matches_single_process, flat, make_data, spread


def main(args, ctx):
    x, y = make_data(args.train, seed=0)  # every rank builds the same data, on the CPU
    dataset = TensorDataset(x, y)
    # this rank's 1/N of the data set (the rank and N come from the process group)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
    torch.manual_seed(ctx.rank)  # different on purpose: DDP's constructor broadcasts rank 0's
    model = MLP(args.width).to(ctx.device)
    model = DDP(model, device_ids=None if ctx.device.type == "cpu" else [ctx.device])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch
        bar = tqdm(loader, f"epoch {epoch}", disable=ctx.rank != 0, file=sys.stderr, mininterval=1)
        for xb, yb in bar:
            xb, yb = xb.to(ctx.device), yb.to(ctx.device)
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()  # DDP all_reduces (averages) the gradients here, bucket by bucket
            opt.step()
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)  # rank 0's local loss only
    test_x, test_y = make_data(args.test, seed=1)  # held out
    correct, count, loss_sum = evaluate(model, test_x, test_y, ctx).tolist()  # on every rank
    print_in_order(
        f"held-out accuracy {correct / count:.4f} ({correct:.0f}/{count:.0f}, all_reduced), "
        f"loss {loss_sum / count:.4f}; sum of params {flat(model).double().sum().item():+.6f}"
    )
    check(model, x, y, sampler, test_x, test_y, (correct, count, loss_sum), args, ctx)


def evaluate(model, x, y, ctx):
    """Each rank scores x[rank::N]; the sums are all_reduced, so every rank gets the whole set's."""
    xs, ys = x[ctx.rank :: ctx.world_size], y[ctx.rank :: ctx.world_size]
    xs, ys = xs.to(ctx.device), ys.to(ctx.device)
    with torch.no_grad():
        out = model(xs)
    correct = (out.argmax(1) == ys).sum().item()
    loss_sum = F.cross_entropy(out, ys, reduction="sum").item()
    sums = torch.tensor([correct, len(ys), loss_sum], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(sums)  # every rank must call this, not just the one that logs
    return sums


# ---- The lesson ends here. What follows is how it checks itself. ----


def show_eval_hang(args, ctx):
    """--show-eval-hang, the classic bug before the lesson: `if rank == 0: evaluate(...)`. What
    evaluate does, on rank 0 alone, on a Gloo group (CPU tensors) whose timeout is --hang-timeout:
    its all_reduce waits for ranks that never come, and fails within seconds instead of hanging
    for the default group's timeout. Then the lesson runs as usual."""
    # the other ranks wait for rank 0 in main's first collective meanwhile, under --timeout
    ctx.require(args.hang_timeout < args.timeout, "--hang-timeout must be below --timeout")
    short = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.hang_timeout))
    if ctx.rank == 0:
        test_x, test_y = make_data(args.test, seed=1)
        model = MLP(args.width).to("cpu")  # on the CPU: the Gloo group takes CPU tensors
        with torch.no_grad():
            correct = (model(test_x).argmax(1) == test_y).sum().item()
        sums = torch.tensor([correct, len(test_y)], dtype=torch.float64, device="cpu")
        try:
            dist.all_reduce(sums, group=short)
            print0("evaluation on rank 0 only: 1 rank, so nobody was missing")
        except RuntimeError:
            print0(
                "evaluation on rank 0 only: its all_reduce waited for ranks that never came, "
                f"and failed after the {args.hang_timeout:g} s timeout (a hang with the default "
                "timeout)"
            )
    main(args, ctx)


def check(model, x, y, sampler, test_x, test_y, sums, args, ctx):
    """Every check below, reported before any raises."""
    correct, count, loss_sum = sums
    check_set_epoch(sampler, len(x))
    diff, tol = check_matches_single_process(model, x, y, sampler, args, ctx)
    whole, failures = check_metric(model, test_x, test_y, sums, ctx)
    param_spread = spread(flat(model))
    metric_spread = spread(torch.tensor(whole, device=ctx.device))
    print0(
        f"max |param - single process| {diff:.2e} (tolerance {tol:g}); spread across ranks: "
        f"params {param_spread:.2e}, metric {metric_spread:.2e}; chance accuracy {1 / 4:.2f}"
    )
    if not diff <= tol:  # `not <=`: a NaN fails too
        failures.append(f"DDP training differs from single-process training by {diff:.2e}")
    if param_spread != 0.0 or metric_spread != 0.0:
        failures.append(f"ranks disagree (params {param_spread:.2e}, metric {metric_spread:.2e})")
    if failures:
        raise RuntimeError("; ".join(failures))
    print0(
        f"OK: DDP + DistributedSampler on {ctx.world_size} ranks, {args.epochs} epochs: params "
        f"match single-process training on the same batches (max diff {diff:.1e}) and are "
        f"identical across ranks; all_reduced held-out accuracy {correct / count:.3f} equals the "
        "whole set's, on every rank"
    )


def check_set_epoch(sampler, n):
    """What goes wrong without set_epoch: the shuffle depends on seed + epoch only."""
    sampler.set_epoch(0)
    epoch0, again = list(sampler), list(sampler)
    sampler.set_epoch(1)
    moved = sum(a != b for a, b in zip(epoch0, list(sampler))) / len(epoch0)
    print0(
        f"DistributedSampler: {len(epoch0)} of {n} examples per rank per epoch; without set_epoch "
        f"epoch 1 repeats epoch 0's order: {epoch0 == again}; with set_epoch(1) {moved:.0%} of "
        "positions change"
    )
    if epoch0 != again or (len(epoch0) > 1 and moved < 0.5):
        raise RuntimeError("DistributedSampler did not behave as described")


def check_metric(model, test_x, test_y, sums, ctx):
    """The whole held-out set scored by this rank alone (no collective): [correct, mean loss],
    compared with the all_reduced sums. Returns it (its spread across ranks is not 0 by
    construction: it differs wherever the parameters do) and the failures found."""
    correct, count, loss_sum = sums
    with torch.no_grad():
        out, yd = model.module(test_x.to(ctx.device)), test_y.to(ctx.device)
        whole = [(out.argmax(1) == yd).sum().item(), F.cross_entropy(out, yd).item()]
    # float32 sums of 1000 losses in two orders: the means differ by ~1e-7; bound 1e-5
    if whole[0] != correct or count != len(test_y) or not abs(whole[1] - loss_sum / count) <= 1e-5:
        return whole, [
            f"all_reduced metric ({correct:.0f} correct, loss {loss_sum / count:.6f}) differs "
            f"from the whole set's ({whole[0]:.0f}, {whole[1]:.6f})"
        ]
    return whole, []


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--train", type=int_in(1, 10**7), default=1200, help="training examples")
    parser.add_argument("--test", type=int_in(1, 10**7), default=1000, help="held-out examples")
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
    parser.add_argument(
        "--show-eval-hang",
        action="store_true",
        help="first the classic bug: evaluate on rank 0 only, and see the wait fail",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float_in(0, 600, low_open=True),
        default=3.0,
        help="seconds before --show-eval-hang's wait fails",
    )
    args = parser.parse_args()
    run(show_eval_hang if args.show_eval_hang else main, args)
