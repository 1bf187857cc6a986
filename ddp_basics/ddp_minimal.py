"""The same job as manual_data_parallel.py with DistributedDataParallel and DistributedSampler.

DDP broadcasts rank 0's weights when it wraps the model and averages the gradients during
backward; DistributedSampler gives each rank its own 1/N of a shuffled data set, and
`set_epoch(epoch)` reshuffles it each epoch (without it every epoch repeats epoch 0's order:
measured below). Rank 0 alone draws a tqdm bar; the evaluation is split across the ranks
and its sums are all_reduced, so every rank gets the same metric. Checks: the parameters
equal one process trained on the same global batches (rebuilt by hand from the sampler's
order, from rank 0's initial weights), they are identical on every rank, and the
all_reduced metric equals the whole held-out set scored by each rank alone.

    torchrun --nproc_per_node=2 ddp_basics/ddp_minimal.py
    python ddp_basics/ddp_minimal.py --nproc 3 --epochs 10 --show-eval-hang

Docs: https://pytorch.org/tutorials/intermediate/ddp_tutorial.html
      https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler
"""

import copy
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from tqdm import tqdm

from launch.dist_setup import lesson_parser, print0, print_in_order, run, test_flags
from toy import MLP, check_matches_single_process, flat, make_data, spread


def main(args, ctx):
    x, y = make_data(args.train, seed=0)  # every rank builds the same data, on the CPU
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(
        dataset, shuffle=True, seed=args.seed
    )  # this rank's 1/N (rank, N from the group)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
    torch.manual_seed(
        ctx.rank
    )  # different on purpose: DDP's constructor broadcasts rank 0's weights
    model = MLP(args.width).to(ctx.device)
    model = DDP(model, device_ids=None if ctx.device.type == "cpu" else [ctx.device])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch
        bar = tqdm(
            loader, desc=f"epoch {epoch}", disable=ctx.rank != 0, file=sys.stderr, mininterval=1
        )
        for xb, yb in bar:
            xb, yb = xb.to(ctx.device), yb.to(ctx.device)
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()  # DDP all_reduces (averages) the gradients here, bucket by bucket
            opt.step()
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)  # rank 0's local loss only
    test_x, test_y = make_data(args.test, seed=1)  # held out
    if args.show_eval_hang:
        show_eval_hang(model, test_x, test_y, args, ctx)
    correct, count, loss_sum = evaluate(model, test_x, test_y, ctx).tolist()  # on every rank
    print_in_order(
        f"held-out accuracy {correct / count:.4f} ({correct:.0f}/{count:.0f}, all_reduced), "
        f"loss {loss_sum / count:.4f}; sum of params {flat(model).double().sum().item():+.6f}"
    )

    check(model, x, y, sampler, test_x, test_y, (correct, count, loss_sum), args, ctx)


def evaluate(model, x, y, ctx, group=None, device=None):
    """Each rank scores x[rank::N]; the sums are all_reduced, so every rank gets the whole set's."""
    device = device or ctx.device
    xs, ys = x[ctx.rank :: ctx.world_size].to(device), y[ctx.rank :: ctx.world_size].to(device)
    with torch.no_grad():
        out = model(xs)
    sums = torch.tensor(
        [
            (out.argmax(1) == ys).sum().item(),
            len(ys),
            F.cross_entropy(out, ys, reduction="sum").item(),
        ],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(sums, group=group)  # every rank must call this, not just the one that logs
    return sums


def show_eval_hang(model, test_x, test_y, args, ctx):
    """The classic bug, `if rank == 0: evaluate(...)`, on a Gloo group with a short timeout (CPU tensors)."""
    short = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.hang_timeout))
    if ctx.rank == 0:
        try:
            evaluate(
                copy.deepcopy(model.module).cpu(), test_x, test_y, ctx, short, torch.device("cpu")
            )
        except RuntimeError:
            print0(
                f"evaluation on rank 0 only: its all_reduce waited for ranks that never came, "
                f"and failed after the {args.hang_timeout:g} s timeout (a hang with the default timeout)"
            )


def check(model, x, y, sampler, test_x, test_y, sums, args, ctx):
    """Every check below, reported before any raises."""
    correct, count, loss_sum = sums
    if (
        args.corrupt_for_testing
    ):  # each rank moves its parameters by a different amount: every check must fail
        with torch.no_grad():
            for p in model.parameters():
                p += 0.01 * (ctx.rank + 1)
    check_set_epoch(sampler, len(x))
    diff, tol = check_matches_single_process(model, x, y, sampler, args, ctx)
    whole, failures = check_metric(model, test_x, test_y, sums, ctx)
    param_spread, metric_spread = (
        spread(flat(model)),
        spread(torch.tensor(whole, device=ctx.device)),
    )
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
        f"OK: DDP + DistributedSampler on {ctx.world_size} ranks, {args.epochs} epochs: params match "
        f"single-process training on the same batches (max diff {diff:.1e}) and are identical across ranks; "
        f"all_reduced held-out accuracy {correct / count:.3f} equals the whole set's, on every rank"
    )


def check_set_epoch(sampler, n):
    """What goes wrong without set_epoch: the shuffle depends on seed + epoch only."""
    sampler.set_epoch(0)
    epoch0, again = list(sampler), list(sampler)
    sampler.set_epoch(1)
    moved = sum(a != b for a, b in zip(epoch0, list(sampler))) / len(epoch0)
    print0(
        f"DistributedSampler: {len(epoch0)} of {n} examples per rank per epoch; without set_epoch "
        f"epoch 1 repeats epoch 0's order: {epoch0 == again}; with set_epoch(1) {moved:.0%} of positions change"
    )
    if epoch0 != again or moved < 0.5:
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
    parser.add_argument("--train", type=int, default=1200, help="training examples")
    parser.add_argument("--test", type=int, default=1000, help="held-out examples")
    parser.add_argument("--batch", type=int, default=16, help="examples per rank per step")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0, help="DistributedSampler's shuffle seed")
    parser.add_argument(
        "--tol", type=float, default=1e-5, help="max |param difference| allowed (float32)"
    )
    tests = test_flags(parser)
    tests.add_argument(
        "--show-eval-hang",
        action="store_true",
        help="first evaluate on rank 0 only, under a short timeout: the hang it causes",
    )
    tests.add_argument("--hang-timeout", type=float, default=3.0)
    tests.add_argument(
        "--corrupt-for-testing",
        action="store_true",
        help="after training each rank moves its params by a different amount: every check fails",
    )
    run(main, parser.parse_args())
