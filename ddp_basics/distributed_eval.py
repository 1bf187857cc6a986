"""Exact evaluation across ranks: sums over the real samples, not the mean of the ranks' means.

DistributedSampler (drop_last=False) pads the index list to a multiple of the world size by
repeating its first indices (`indices += indices[:padding_size]` in __iter__ of
torch/utils/data/distributed.py, torch 2.13), so with 100 samples on 3 ranks two samples are
scored twice. Averaging each rank's mean loss with all_reduce(AVG) counts them twice: wrong
(measured below). Exact: mask the padding, all_reduce the SUMs of loss, correct and count,
then divide. Then gather_object brings every prediction to rank 0, in data set order.

    torchrun --nproc_per_node=3 ddp_basics/distributed_eval.py
    python ddp_basics/distributed_eval.py --nproc 4 --samples 1000 --batch 64

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler
      https://pytorch.org/docs/stable/distributed.html#torch.distributed.gather_object
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from launch.dist_setup import int_in, lesson_parser, print0, run
from toy import MLP, fp32_tolerance, make_data


def main(args, ctx):
    model = trained_model(args, ctx)  # the same weights on every rank
    x, y = make_data(args.samples, seed=1)  # the held-out set, the same on every rank
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, shuffle=False)  # drop_last=False: pads, scores all
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
    losses, preds = [], []
    with torch.no_grad():
        for xb, yb in loader:
            out = model(xb.to(ctx.device))
            losses.append(F.cross_entropy(out, yb.to(ctx.device), reduction="none"))
            preds.append(out.argmax(1))
    loss, pred = torch.cat(losses), torch.cat(preds)
    index = torch.tensor(list(sampler), device=ctx.device)  # what the loader read, in its order
    correct = pred == y.to(ctx.device)[index]
    # naive: each rank's means, padding included, then the mean of the ranks' means
    naive = torch.stack([loss.mean(), correct.float().mean()])
    dist.all_reduce(naive, op=dist.ReduceOp.AVG)
    # Exact: this rank's k-th index sits at position rank + k * N of the padded list; positions from
    # len(dataset) on are the padding (the same slicing as the sampler's __iter__). The other way:
    # no padding (each rank takes range(rank, n, N)), the same SUMs: never a mean of means.
    positions = torch.arange(ctx.rank, sampler.total_size, ctx.world_size, device=ctx.device)
    real = positions < len(dataset)
    loss_sum = loss[real].sum().reshape(1)
    counts = torch.stack([correct[real].sum(), real.sum()])  # int64: counts stay exact at any size
    dist.all_reduce(loss_sum)  # SUM, the default
    dist.all_reduce(counts)
    (n_correct, n), mean_loss = counts.tolist(), loss_sum.item() / counts[1].item()
    # Every prediction to rank 0. gather_object pickles, and unpickling can run code: use it between
    # your own job's ranks only. Plain ints travel, not device tensors.
    gathered = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object((index[real].tolist(), pred[real].tolist()), gathered, dst=0)
    by_index = None
    if ctx.rank == 0:  # (index, prediction) pairs in data set order
        by_index = sorted(pair for indices, values in gathered for pair in zip(indices, values))
    check(model, x, y, sampler, naive.tolist(), (mean_loss, n_correct, n), by_index, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


def trained_model(args, ctx):
    """Something to evaluate: full-batch Adam on a training set, the same seed and float32 steps
    on every rank."""
    torch.manual_seed(0)
    model = MLP(32).to(ctx.device)
    x, y = (t.to(ctx.device) for t in make_data(500, seed=0))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(args.train_steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval()


def check(model, x, y, sampler, naive, exact, by_index, ctx):
    """One process, plain torch, the whole data set at once: no sampler, no collective."""
    (mean_loss, n_correct, n), padded = exact, sampler.total_size - len(x)
    print0(
        f"{len(x)} samples, {ctx.world_size} rank(s), {sampler.num_samples} each, {padded} padded\n"
        f"naive (mean of the ranks' means): loss {naive[0]:.6f}, accuracy {naive[1]:.6f}\n"
        f"exact (SUMs, padding masked):     loss {mean_loss:.6f}, accuracy {n_correct / n:.6f} "
        f"({n_correct}/{n})"
    )
    with torch.no_grad():
        out, yd = model(x.to(ctx.device)), y.to(ctx.device)
    ref_each, ref_pred = F.cross_entropy(out, yd, reduction="none"), out.argmax(1)
    ref_loss, ref_hit, top2 = F.cross_entropy(out, yd).item(), ref_pred == yd, out.topk(2).values
    # Same device and float32 arithmetic, summed in another order, matmuls of other batch shapes:
    # ~1e-7 relative measured, bound 1e-5 (toy.fp32_tolerance widens it 2**13x under TF32:
    # rounding that much coarser).
    rel, tol = fp32_tolerance(1e-5), fp32_tolerance(1e-5) * abs(ref_loss)
    # An argmax whose top two logits lie within rounding may flip between the two runs (none
    # measured in float32): counts must match exactly, up to that many such ties.
    ties = (top2[:, 0] - top2[:, 1] <= rel * top2[:, 0].abs()).sum().item()
    failures = check_exact(exact, ref_loss, ref_hit, tol, ties)
    failures += check_naive(naive, ref_each, ref_hit, tol, ties, ctx)
    if ctx.rank == 0:  # only rank 0 holds them
        failures += check_predictions(by_index, ref_pred, ties)
    # rank 0 has printed its findings before any rank raises (and the launcher stops the rest)
    dist.barrier()
    if failures:
        raise RuntimeError("; ".join(f"[rank {ctx.rank}] {f}" for f in failures))
    print0(
        f"OK: exact distributed evaluation on {ctx.world_size} rank(s) of {len(x)} samples equals "
        f"one process (loss {mean_loss:.6f}, {n_correct}/{n} correct); the naive mean of means is "
        f"off by {abs(naive[0] - ref_loss):.2e}; rank 0 holds one prediction per sample, in data "
        "set order"
    )


def check_exact(exact, ref_loss, ref_hit, tol, ties):
    (mean_loss, n_correct, count), ref_correct, n = exact, ref_hit.sum().item(), len(ref_hit)
    print0(
        f"one process, whole set:           loss {ref_loss:.6f}, accuracy {ref_correct / n:.6f} "
        f"({ref_correct}/{n}); |exact - one process| {abs(mean_loss - ref_loss):.2e} "
        f"(tolerance {tol:.1e})"
    )
    bad = count != n or abs(n_correct - ref_correct) > ties or not abs(mean_loss - ref_loss) <= tol
    return [
        f"exact metrics (loss {mean_loss:.6f}, {n_correct}/{count}) differ from one process's "
        f"(loss {ref_loss:.6f}, {ref_correct}/{n})"
    ] * bad


def check_naive(naive, ref_each, ref_hit, tol, ties, ctx):
    """The naive figures are the padded list's means (by hand): off when the padding repeats some
    samples."""
    n, size = len(ref_each), -(-len(ref_each) // ctx.world_size) * ctx.world_size
    padded = (list(range(n)) * -(-size // n))[:size]
    by_hand = [ref_each[padded].mean().item(), ref_hit[padded].float().mean().item()]
    off, shift = naive[0] - ref_each.mean().item(), by_hand[0] - ref_each.mean().item()
    print0(
        f"naive - one process: loss {off:+.2e}, "
        f"accuracy {naive[1] - ref_hit.float().mean().item():+.2e}; the padded list's means by "
        f"hand: loss {by_hand[0]:.6f} ({shift:+.2e}), accuracy {by_hand[1]:.6f}"
    )
    failures = []
    # the accuracies to a sample
    if not (abs(naive[0] - by_hand[0]) <= tol and abs(naive[1] - by_hand[1]) * size < ties + 0.5):
        failures.append(f"the naive figures {naive} are not the padded list's means {by_hand}")
    if size % n == 0 and not abs(off) <= tol:  # no padding, or every sample repeated alike (n < N)
        failures.append(
            f"every sample counted {size // n}x, yet the naive loss is off by {off:.2e}"
        )
    # whenever the bound can see the shift (in float32: at the defaults)
    if abs(shift) > 2 * tol and not abs(off) > tol:
        failures.append(f"{size - n} padded samples, yet the naive loss is off by only {off:.2e}")
    return failures


def check_predictions(by_index, ref_pred, ties):
    """Rank 0's (index, prediction) pairs, sorted: indices 0..n-1 once each, the argmax of one
    process."""
    indices, pred, n = [i for i, _ in by_index], dict(by_index), len(ref_pred)
    twice, missing = len(indices) - len(set(indices)), n - len(set(indices) & set(range(n)))
    wrong = sum(pred[i] != r for i, r in enumerate(ref_pred.tolist()) if i in pred)
    print0(
        f"rank 0 gathered {len(indices)} predictions for {n} samples: {twice} duplicates, "
        f"{missing} missing, {wrong} differ from one process's argmax"
    )
    if twice or missing or wrong > ties:
        return [f"gathered predictions: {twice} duplicates, {missing} missing, {wrong} wrong"]
    return []


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--samples",
        type=int_in(1, 10**7),
        default=100,
        help="data set size (100: 3 ranks do not divide it)",
    )
    parser.add_argument(
        "--batch", type=int_in(1, 10**6), default=16, help="evaluation batch per rank"
    )
    parser.add_argument(
        "--train-steps",
        type=int_in(0, 10_000),
        default=50,
        help="full-batch Adam steps before evaluating (0: an untrained model)",
    )
    run(main, parser.parse_args())
