"""ZeRO stages 1 and 2 by hand: shard the optimizer state, then the gradients too.

Every rank keeps the whole model, its parameters laid out in one flat buffer (padded with zeros
to a multiple of N), and Adam steps only this rank's 1/N slice of it, so Adam's state is 1/N
(ZeRO-1); the new slices are all_gathered back into every rank's buffer. ZeRO-1 all_reduces the
full gradient and each rank reads its slice; ZeRO-2 reduce_scatters it, so each rank receives
only its slice of the average and drops the rest (ZeRO-3, zero_by_hand.py, shards the parameters
too). Both match one process's Adam; the bytes each rank holds are measured for DDP and ZeRO-1/2/3.

    torchrun --nproc_per_node=3 fsdp_basics/zero_stages.py
    python fsdp_basics/zero_stages.py --nproc 4 --width 256 --depth 4

Docs: https://arxiv.org/abs/1910.02054 (ZeRO: stages P_os, P_os+g, P_os+g+p)
      https://pytorch.org/docs/stable/distributed.html (all_reduce, reduce_scatter_single, all_gather_single)
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch.dist_setup import lesson_parser, print0, print_in_order, run, test_flags
from toy import BlockMLP, make_data, rank_batch, step_bytes, storage_bytes, train_one_process
from zero_by_hand import ShardedLinear


def main(args, ctx):
    ctx.require(
        args.batch % ctx.world_size == 0,
        f"--batch {args.batch} must divide by {ctx.world_size} ranks",
    )
    x, y = (t.to(ctx.device) for t in make_data(args.batch * args.steps))
    torch.manual_seed(0)  # the same initial model on every rank (drawn on the CPU, then moved)
    start = BlockMLP(args.width, args.depth).to(ctx.device)
    # torch 2.13 names; before it reduce_scatter_tensor / all_gather_into_tensor (same arguments)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    trained, held = {}, {}
    for stage in (1, 2):  # the same start and batches; only where the gradient lives differs
        model = copy.deepcopy(start)
        params = list(model.parameters())
        numel = sum(p.numel() for p in params)
        flat = torch.zeros(
            numel + -numel % ctx.world_size, device=ctx.device
        )  # N divides its length
        view_into(params, flat)  # each parameter becomes a view of its piece of `flat`
        size = len(flat) // ctx.world_size
        mine = slice(ctx.rank * size, (ctx.rank + 1) * size)
        shard = nn.Parameter(flat[mine])  # a view: Adam's updates land in `flat`
        # Adam is elementwise (docs torch.optim.Adam, the algorithm), so stepping a slice of the flat buffer
        # equals stepping the parameters in it; its state is for my slice only: 1/N
        opt = torch.optim.Adam([shard], lr=args.lr)
        losses = []
        for step in range(args.steps):
            xb, yb = rank_batch(x, y, step, args.batch, ctx)
            grads = torch.zeros_like(flat)
            # an existing .grad is accumulated into in place (`variable_grad += new_grad` in AccumulateGrad,
            # torch/csrc/autograd/functions/accumulate_grad.h), so backward fills `grads`
            view_into(params, grads, as_grad=True)
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            if stage == 1:
                dist.all_reduce(
                    grads, op=dist.ReduceOp.AVG
                )  # every rank: the whole averaged gradient
                shard.grad = grads[mine]
            else:
                shard.grad = torch.empty_like(shard)
                reduce_scatter(
                    shard.grad, grads, op=dist.ReduceOp.AVG
                )  # only my slice of the average
                if not args.keep_full_grads:
                    model.zero_grad(
                        set_to_none=True
                    )  # drop the views: `grads` is freed, 1/N remains
                del grads
            opt.step()  # my slice of the parameters
            if not args.skip_all_gather:
                all_gather(
                    flat, shard.detach().clone()
                )  # every rank's new slice; a separate input buffer
            losses.append(loss.detach())
        trained[stage], held[stage] = (model, losses), step_bytes_zero(model, opt, shard)

    worst = check_matches_one_process(trained, start, x, y, args)
    check_memory(held, start, x, y, args, ctx)
    print0(
        f"OK: ZeRO-1 and ZeRO-2 by hand on {ctx.world_size} ranks match single-process Adam after "
        f"{args.steps} steps (max diff {worst:.1e}); bytes per rank as the formula says"
    )


def view_into(params, flat, as_grad=False):
    """Point each parameter (or its .grad) at its piece of `flat`, in order; parameters are copied in."""
    offset = 0
    for p in params:
        piece = flat[offset : offset + p.numel()].view_as(p)
        if as_grad:
            p.grad = piece
        else:
            p.data = piece.copy_(p.detach())
        offset += p.numel()


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
        dist.all_reduce(
            diff, op=dist.ReduceOp.MAX
        )  # every rank's copy of the model: all must agree
        worst[stage] = diff.item()
    print0(
        f"max |loss or param - single process| over {args.steps} steps: ZeRO-1 {worst[1]:.2e}, "
        f"ZeRO-2 {worst[2]:.2e} (tolerance {args.tol:g})"
    )
    # Same device, same kernels: only the order of float32 sums differs (my share's gradient, then the
    # average over ranks, against one full batch), ~1e-7 relative, which training amplifies (as in
    # zero_by_hand.py). Hence --tol 1e-4. TF32 is off by default on GPUs (docs notes/cuda.html,
    # "TensorFloat-32 (TF32) on Ampere (and later) devices"). Without the all_gather the slices of
    # the other ranks never move on this rank: off by ~lr per step.
    if max(worst.values()) > args.tol:
        raise RuntimeError(
            f"ZeRO by hand differs from single-process training by {max(worst.values()):.2e}"
        )
    return max(worst.values())


def check_memory(held, start, x, y, args, ctx):
    """Bytes per rank measured for DDP, ZeRO-1, ZeRO-2, ZeRO-3 against the formula of the ZeRO paper."""
    xb, yb = rank_batch(x, y, 0, args.batch, ctx)
    ddp = copy.deepcopy(start)  # what every DDP rank holds: the plain model and Adam
    held["DDP"] = step_bytes(ddp, torch.optim.Adam(ddp.parameters()), xb, yb)
    zero3, memo = copy.deepcopy(start), {"gathered": [], "peak": 0}
    for parent in list(
        zero3.modules()
    ):  # zero_by_hand.py's ZeRO-3: every Linear keeps 1/N of itself
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                setattr(
                    parent, name, ShardedLinear(child, ctx, memo)
                )  # device: cut from child, on ctx.device
    held[3] = step_bytes(zero3, torch.optim.Adam(zero3.parameters()), xb, yb)
    psi, n, tensors = (
        sum(p.numel() for p in start.parameters()),
        ctx.world_size,
        len(list(start.parameters())),
    )
    layers = len(list(zero3.parameters()))  # one flat shard per Linear
    # bytes per parameter (fp32, Adam: 4 param + 4 grad + 8 state) and what padding and Adam's 4-byte
    # `step` counters (a float32 scalar tensor per optimized tensor, torch/optim/adam.py `_init_group`)
    # may add on top: under N elements per flat buffer. DDP here: the plain model and Adam, what every DDP
    # rank holds with gradient_as_bucket_view=True (without it, DDP's buckets add 4Ψ: DDP docs).
    rows = [
        ("DDP", "DDP", "16Ψ", 16, 0, tensors),
        ("ZeRO-1", 1, "(8+8/N)Ψ", 8 + 8 / n, 1, 1),
        ("ZeRO-2", 2, "(4+12/N)Ψ", 4 + 12 / n, 1, 1),
        ("ZeRO-3", 3, "16Ψ/N", 16 / n, layers, layers),
    ]
    print_in_order(", ".join(f"{label} {sum(held[key]):,} B" for label, key, *_ in rows))
    lines = [
        f"bytes per rank, Ψ = {psi:,} parameters on N = {n} ranks (measured from the tensors each holds)",
        f"{'':8}{'params':>9}{'grads':>9}{'Adam':>9}{'total':>9}  formula",
    ]
    bad = []
    for label, key, text, per_param, flats, counters in rows:
        total, formula = sum(held[key]), per_param * psi
        lines.append(
            f"{label:8}"
            + "".join(f"{b:>9,}" for b in held[key])
            + f"{total:>9,}  {text} = {formula:,.0f}"
        )
        if not 0 <= total - formula <= 16 * n * flats + 4 * counters:
            bad.append(f"{label} holds {total:,} B, the formula says {formula:,.0f} B")
    print0("\n".join(lines))
    if bad:
        raise RuntimeError("; ".join(bad))


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--width", type=int, default=30, help="hidden width (30: layers that N=4 does not divide)"
    )
    parser.add_argument("--depth", type=int, default=2, help="residual blocks")
    parser.add_argument(
        "--batch", type=int, default=48, help="global batch, divisible by the world size"
    )
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument(
        "--tol", type=float, default=1e-4, help="largest |ZeRO - one process| (loss, params)"
    )
    broken = test_flags(parser)
    broken.add_argument(
        "--skip-all-gather", action="store_true", help="never share the updated slices"
    )
    broken.add_argument(
        "--keep-full-grads", action="store_true", help="ZeRO-2 keeps the full gradient"
    )
    run(main, parser.parse_args())
