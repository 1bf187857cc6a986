"""SyncBatchNorm: batch statistics over the whole global batch, not each rank's share.

BatchNorm in training normalises with the mean and variance of the batch it sees; under DDP
that is only this rank's share, so small per-rank batches give noisy statistics.
`nn.SyncBatchNorm.convert_sync_batchnorm(model)` swaps every BatchNorm for one that
all-gathers the statistics, so each rank normalises with those of the global batch.
In this torch SyncBatchNorm runs on GPUs (and XPU) only; on CPU the lesson says so and
computes the same statistics by hand: one all_reduce of [sum, sum of squares, count].

    torchrun --nproc_per_node=3 ddp_basics/syncbatchnorm.py
    python ddp_basics/syncbatchnorm.py --nproc 2 --channels 8

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/generated/torch.nn.SyncBatchNorm.html
"""

import torch
import torch.distributed as dist
from torch import nn

from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    C, sizes = args.channels, [args.batch + r for r in range(ctx.world_size)]  # uneven: allowed
    g = torch.Generator().manual_seed(0)  # a CPU generator: the same data on every device
    # each channel its own mean
    full = torch.randn(sum(sizes), C, generator=g, device="cpu") * 3 + torch.arange(C, device="cpu")
    lo = sum(sizes[: ctx.rank])
    x = full[lo : lo + sizes[ctx.rank]].to(ctx.device)

    bn = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(C)).to(ctx.device))
    try:
        out = bn(x)
        running_mean, running_var = bn[0].running_mean, bn[0].running_var
        how = "nn.SyncBatchNorm"
    except ValueError as error:  # CPU tensors: "SyncBatchNorm expected input tensor to be on GPU"
        print0(f"SyncBatchNorm on {ctx.device.type}: {str(error).splitlines()[0]}; by hand instead")
        ones = torch.ones(C, device=x.device)
        stats = torch.stack([x.sum(0), (x * x).sum(0), len(x) * ones])
        dist.all_reduce(stats)  # SUM over ranks: global sum, sum of squares, count
        total, squares, count = stats
        mean = total / count
        var = squares / count - mean * mean  # biased variance normalises, as BatchNorm does
        out = (x - mean) / torch.sqrt(var + 1e-5)  # weight 1, bias 0 at initialisation
        m = 0.1  # BatchNorm's default momentum; running_var keeps the unbiased variance
        running_mean = m * mean
        running_var = (1 - m) * ones + m * var * count / (count - 1)
        how = "all_reduce of [sum, sum of squares, count]"
    print_in_order(
        f"{len(x)} rows; channel-0 mean of my rows {x.mean(0)[0].item():+.3f}, "
        f"global {running_mean[0].item() / 0.1:+.3f}"
    )
    check(out, running_mean, running_var, full, lo, how, sizes, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


def check(out, running_mean, running_var, full, lo, how, sizes, ctx):
    """Independent reference: one BatchNorm on the whole global batch, in one process, on
    ctx.device. Same device, float32: the statistics differ by summation order only (sums over
    ranks, or SyncBatchNorm's per-rank Welford merge, vs one pass), values |x| < ~15: about 1e-6;
    bound 1e-4."""
    ref = nn.BatchNorm1d(full.shape[1]).to(ctx.device)
    ref_out = ref(full.to(ctx.device))[lo : lo + sizes[ctx.rank]]
    diffs = [
        (out.detach() - ref_out.detach()).abs().max().item(),
        (running_mean - ref.running_mean).abs().max().item(),
        (running_var - ref.running_var).abs().max().item(),
    ]
    print0(
        f"max diff against BatchNorm on the whole batch: output {diffs[0]:.1e}, "
        f"running mean {diffs[1]:.1e}, running var {diffs[2]:.1e}"
    )
    if not max(diffs) <= 1e-4:
        raise RuntimeError(
            f"statistics over {ctx.world_size} ranks differ from those of the whole batch: {diffs}"
        )
    print0(
        f"OK: batch statistics over {ctx.world_size} ranks ({how}) equal BatchNorm on the whole "
        f"batch of {sum(sizes)} rows (max diff {max(diffs):.1e})"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--batch",
        type=int_in(2, 10**6),
        default=6,
        help="rows on rank 0; rank r has batch + r (2 or more: a variance needs two)",
    )
    parser.add_argument("--channels", type=int_in(1, 4096), default=4, help="features per row")
    run(main, parser.parse_args())
