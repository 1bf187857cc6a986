"""ZeRO stages 1 and 2 by hand: shard the optimizer state, then the gradients too.

Every rank keeps the whole model, its parameters laid out in one flat buffer (padded with zeros
to a multiple of N), and Adam steps only this rank's 1/N slice of it, so Adam's state is 1/N
(ZeRO-1); the new slices are all_gathered back into every rank's buffer. ZeRO-1 all_reduces the
full gradient and each rank reads its slice; ZeRO-2 reduce_scatters it, so each rank receives
only its slice of the average and drops the rest (ZeRO-3, zero_by_hand.py, shards the parameters
too). Both match one process's Adam; the bytes each rank holds are measured for DDP and ZeRO-1/2/3.

    torchrun --nproc_per_node=3 fsdp_basics/zero_stages.py
    python fsdp_basics/zero_stages.py --nproc 4 --width 256 --depth 4

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://arxiv.org/abs/1910.02054 (ZeRO: stages P_os, P_os+g, P_os+g+p)
      https://pytorch.org/docs/stable/distributed.html (all_reduce, reduce_scatter_single, ...)
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run
from toy import BlockMLP, make_data, rank_batch, step_bytes, storage_bytes, train_one_process
from zero_by_hand import shard_linears


def main(args, ctx):
    ctx.require(
        args.batch % ctx.world_size == 0,
        f"--batch {args.batch} must divide by {ctx.world_size} ranks",
    )
    x, y = (t.to(ctx.device) for t in make_data(args.batch * args.steps))
    torch.manual_seed(0)  # the same initial model on every rank (drawn on the CPU, then moved)
    start = BlockMLP(args.width, args.depth).to(ctx.device)

    trained, held = {}, {}
    for stage in (1, 2):  # the same start and batches; only where the gradient lives differs
        model = copy.deepcopy(start)
        params = list(model.parameters())
        flat, mine = flat_buffer(params, ctx)  # each parameter becomes a view of its piece of flat
        shard = nn.Parameter(flat[mine])  # a view: Adam's updates land in `flat`
        # Adam is elementwise (docs torch.optim.Adam, the algorithm), so stepping a slice of the
        # flat buffer equals stepping the parameters in it; its state is for my slice only: 1/N
        opt = torch.optim.Adam([shard], lr=args.lr)
        losses = []
        for step in range(args.steps):
            xb, yb = rank_batch(x, y, step, args.batch, ctx)
            grads = torch.zeros_like(flat)
            view_into(params, grads, as_grad=True)  # backward accumulates into `grads`
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            shard.grad = averaged_slice(stage, grads, mine)
            if stage == 2:
                model.zero_grad(set_to_none=True)  # drop the views: `grads` is freed, 1/N remains
            del grads
            opt.step()  # my slice of the parameters
            # every rank's new slice (from a separate input)
            dist.all_gather_single(flat, shard.detach().clone())
            losses.append(loss.detach())
        trained[stage], held[stage] = (model, losses), step_bytes_zero(model, opt, shard)

    worst = check_matches_one_process(trained, start, x, y, args)
    grad_diff = check_averaged_gradients(start, x, y, args, ctx)
    check_memory(held, start, x, y, args, ctx)
    print0(
        f"OK: ZeRO-1 and ZeRO-2 by hand on {ctx.world_size} ranks match single-process Adam after "
        f"{args.steps} steps (max diff {worst:.1e}), their averaged gradient slices match one "
        f"process's gradient ({grad_diff:.1e}); bytes per rank as the formula says"
    )


def flat_buffer(params, ctx):
    """One zero-padded buffer (N divides its length) that `params` become views of; my slice."""
    numel = sum(p.numel() for p in params)
    flat = torch.zeros(numel + -numel % ctx.world_size, device=params[0].device)
    view_into(params, flat)
    size = len(flat) // ctx.world_size
    return flat, slice(ctx.rank * size, (ctx.rank + 1) * size)


def averaged_slice(stage, grads, mine):
    """My slice of the gradient averaged over the ranks. ZeRO-1: all of it reaches every rank;
    ZeRO-2: only my slice of it reaches me."""
    if stage == 1:
        dist.all_reduce(grads, op=dist.ReduceOp.AVG)
        return grads[mine]
    mine_only = grads.new_empty(mine.stop - mine.start)
    dist.reduce_scatter_single(mine_only, grads, op=dist.ReduceOp.AVG)
    return mine_only


def view_into(params, flat, as_grad=False):
    """Point each parameter (or its .grad) at its piece of `flat`, in order; parameters are
    copied in. An existing .grad is accumulated into in place (`variable_grad += new_grad` in
    AccumulateGrad, torch/csrc/autograd/functions/accumulate_grad.h), so backward fills it."""
    offset = 0
    for p in params:
        piece = flat[offset : offset + p.numel()].view_as(p)
        if as_grad:
            p.grad = piece
        else:
            p.data = piece.copy_(p.detach())
        offset += p.numel()


# ---- The lesson ends here. What follows is how it checks itself. ----


def step_bytes_zero(model, opt, shard):
    """[parameters, gradients, optimizer state]: the bytes this rank holds after its last step."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None] + [shard.grad]
    return [
        storage_bytes(params),
        storage_bytes(grads),
        storage_bytes(t for s in opt.state.values() for t in s.values()),
    ]


def check_matches_one_process(trained, start, x, y, args):
    reference = copy.deepcopy(start)
    ref_losses = train_one_process(reference, x, y, args.batch, args.steps, args.lr)
    worst = {}
    for stage, (model, losses) in trained.items():
        losses = torch.stack(losses)
        dist.all_reduce(losses, op=dist.ReduceOp.AVG)  # equal shares: the loss of the global batch
        diffs = [(p - r).abs().max() for p, r in zip(model.parameters(), reference.parameters())]
        diff = torch.stack([(losses - ref_losses).abs().max(), *diffs]).max()
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)  # every rank's copy of the model must agree
        worst[stage] = diff.item()
    print0(
        f"max |loss or param - single process| over {args.steps} steps: ZeRO-1 {worst[1]:.2e}, "
        f"ZeRO-2 {worst[2]:.2e} (tolerance {args.tol:g})"
    )
    # Same device, same kernels: only the order of float32 sums differs (my share's gradient, then
    # the average over ranks, against one full batch), ~1e-7 relative, which training amplifies
    # (as in zero_by_hand.py). Hence --tol 1e-4. TF32 is off by default on GPUs (docs
    # notes/cuda.html, "TensorFloat-32 (TF32) on Ampere (and later) devices"). Without the
    # all_gather the slices of the other ranks never move on this rank: off by ~lr per step.
    # Adam hides a gradient's scale (lr * m / sqrt(v)): check_averaged_gradients looks at it.
    if max(worst.values()) > args.tol:
        raise RuntimeError(
            f"ZeRO by hand differs from single-process training by {max(worst.values()):.2e}"
        )
    return max(worst.values())


def check_averaged_gradients(start, x, y, args, ctx):
    """averaged_slice against one process: the gradient of `start` on step 0's whole global batch,
    laid out as the flat buffer, my slice. The average of equal shares' mean-loss gradients is the
    whole batch's: float32 rounding only (~1e-8 here), hence 1e-6. A SUM instead of an AVG is N
    times too large, which Adam's step (lr * m / sqrt(v)) would hide."""
    reference = copy.deepcopy(start)
    F.cross_entropy(reference(x[: args.batch]), y[: args.batch]).backward()
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()])
    xb, yb = rank_batch(x, y, 0, args.batch, ctx)
    worst = torch.zeros((), device=ctx.device)
    for stage in (1, 2):
        model = copy.deepcopy(start)
        params = list(model.parameters())
        flat, mine = flat_buffer(params, ctx)  # the lesson's layout
        grads = torch.zeros_like(flat)
        view_into(params, grads, as_grad=True)
        F.cross_entropy(model(xb), yb).backward()
        got = averaged_slice(stage, grads, mine)
        want = F.pad(expected, (0, len(flat) - len(expected)))[mine]
        worst = torch.maximum(worst, (got - want).abs().max())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    print0(
        f"averaged gradient slice of step 0 (ZeRO-1 and ZeRO-2) - one process's gradient: "
        f"max {worst.item():.2e} (tolerance 1e-6)"
    )
    if worst.item() > 1e-6:
        raise RuntimeError(
            f"the averaged gradient slices differ from one process's gradient by {worst.item():.2e}"
        )
    return worst.item()


def check_memory(held, start, x, y, args, ctx):
    """Bytes per rank measured for DDP, ZeRO-1, ZeRO-2, ZeRO-3 against the ZeRO paper's formula."""
    xb, yb = rank_batch(x, y, 0, args.batch, ctx)
    ddp = copy.deepcopy(start)  # what every DDP rank holds: the plain model and Adam
    held["DDP"] = step_bytes(ddp, torch.optim.Adam(ddp.parameters()), xb, yb)
    zero3 = shard_linears(copy.deepcopy(start), ctx)  # zero_by_hand.py's ZeRO-3
    held[3] = step_bytes(zero3, torch.optim.Adam(zero3.parameters()), xb, yb)
    psi, n = sum(p.numel() for p in start.parameters()), ctx.world_size
    tensors, layers = len(list(start.parameters())), len(list(zero3.parameters()))
    # bytes per parameter (fp32, Adam: 4 param + 4 grad + 8 state) and what padding and Adam's
    # 4-byte `step` counters (a float32 scalar tensor per optimized tensor, torch/optim/adam.py
    # `_init_group`) may add on top: under N elements per flat buffer. DDP here: the plain model
    # and Adam, what every DDP rank holds with gradient_as_bucket_view=True (without it, DDP's
    # buckets add 4Ψ: DDP docs).
    rows = [
        ("DDP", "DDP", "16Ψ", 16, 0, tensors),
        ("ZeRO-1", 1, "(8+8/N)Ψ", 8 + 8 / n, 1, 1),
        ("ZeRO-2", 2, "(4+12/N)Ψ", 4 + 12 / n, 1, 1),
        ("ZeRO-3", 3, "16Ψ/N", 16 / n, layers, layers),
    ]
    print_in_order(", ".join(f"{label} {sum(held[key]):,} B" for label, key, *_ in rows))
    print0(f"bytes per rank, Ψ = {psi:,} parameters on N = {n} ranks (measured from the tensors)")
    lines, bad = [f"{'':8}{'params':>9}{'grads':>9}{'Adam':>9}{'total':>9}  formula"], []
    for label, key, text, per_param, flats, counters in rows:
        total, formula = sum(held[key]), per_param * psi
        sizes = "".join(f"{b:>9,}" for b in held[key])
        lines.append(f"{label:8}{sizes}{total:>9,}  {text} = {formula:,.0f}")
        if not 0 <= total - formula <= 16 * n * flats + 4 * counters:
            bad.append(f"{label} holds {total:,} B, the formula says {formula:,.0f} B")
    print0("\n".join(lines))
    if bad:
        raise RuntimeError("; ".join(bad))


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--width",
        type=int_in(1, 4096),
        default=30,
        help="hidden width (30: layers that N=4 does not divide)",
    )
    parser.add_argument("--depth", type=int_in(1, 64), default=2, help="residual blocks")
    parser.add_argument(
        "--batch", type=int_in(1, 65536), default=48, help="global batch, divisible by N"
    )
    parser.add_argument("--steps", type=int_in(1, 10_000), default=15)
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=1e-2)
    parser.add_argument(
        "--tol",
        type=float_in(0, 1, low_open=True),
        default=1e-4,
        help="largest |ZeRO - one process| (loss, params)",
    )
    run(main, parser.parse_args())
