"""ZeRO stage 3 by hand: what FSDP does, written with all_gather and reduce_scatter.

Each rank keeps 1/N of every Linear layer (weight and bias flattened, padded with zeros to a
multiple of N, cut in N). Its forward all_gathers the layer, computes and frees it; its
backward all_gathers it again and reduce_scatters the gradients, so each rank receives the
averaged gradient of its own shard. Adam steps on the shards: its state is 1/N too. (ZeRO-1
shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3 also the parameters, for an
all_gather per layer in forward and in backward: 1.5x the bytes DDP sends.)

    torchrun --nproc_per_node=3 fsdp_basics/zero_by_hand.py
    python fsdp_basics/zero_by_hand.py --nproc 4 --width 256 --depth 4

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://arxiv.org/abs/1910.02054 (ZeRO)
      https://pytorch.org/docs/stable/distributed.html (all_gather_single, reduce_scatter_single)
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run
from toy import BlockMLP, make_data, rank_batch, step_bytes, storage_bytes, train_one_process


class GatheredLinear(torch.autograd.Function):
    """y = x W^T + b, where W and b exist in full only while this layer computes."""

    @staticmethod
    def forward(saved, x, shard, layer):  # saved: autograd's context, not the distributed ctx
        saved.save_for_backward(x, shard)  # the input and my shard: never the gathered weight
        saved.layer = layer
        weight, bias, full = layer.gather(shard)
        out = F.linear(x, weight, bias)
        full.untyped_storage().resize_(0)  # free the full layer now, as FSDP does after forward
        return out

    @staticmethod
    def backward(saved, grad_out):
        x, shard = saved.saved_tensors
        layer = saved.layer
        weight, _, full = layer.gather(shard)  # all_gather again: the forward's copy is gone
        grad_x = grad_out @ weight
        full_grad = torch.cat(
            [(grad_out.T @ x).flatten(), grad_out.sum(0), grad_out.new_zeros(layer.pad)]
        )
        full.untyped_storage().resize_(0)
        grad_shard = torch.empty_like(shard)
        # my slice of the average
        dist.reduce_scatter_single(grad_shard, full_grad, op=dist.ReduceOp.AVG)
        return grad_x, grad_shard, None


class ShardedLinear(nn.Module):
    """Replaces an nn.Linear; holds only this rank's shard of [weight.flatten(), bias, zeros]."""

    def __init__(self, linear, ctx):
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        flat = torch.cat([linear.weight.detach().flatten(), linear.bias.detach()])
        self.pad = -len(flat) % ctx.world_size  # zeros so that N divides the length
        flat = torch.cat([flat, flat.new_zeros(self.pad)])
        # clone: keep 1/N, not a view of the whole
        self.shard = nn.Parameter(flat.chunk(ctx.world_size)[ctx.rank].clone())
        self.world_size = ctx.world_size

    def gather(self, shard):
        full = shard.new_empty(shard.numel() * self.world_size)
        dist.all_gather_single(full, shard.detach())  # every rank's shard, in rank order
        n_weight = self.out_features * self.in_features
        weight = full[:n_weight].view(self.out_features, self.in_features)
        return weight, full[n_weight : n_weight + self.out_features], full

    def forward(self, x):
        return GatheredLinear.apply(x, self.shard, self)


def shard_linears(model, ctx):
    """Replace every nn.Linear of model by a ShardedLinear that keeps 1/N of it."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                setattr(parent, name, ShardedLinear(child, ctx))  # device: cut from child
    return model


def main(args, ctx):
    ctx.require(
        args.batch % ctx.world_size == 0,
        f"--batch {args.batch} must divide by {ctx.world_size} ranks",
    )
    x, y = (t.to(ctx.device) for t in make_data(args.batch * args.steps))
    torch.manual_seed(0)  # the same initial model on every rank (drawn on the CPU, then moved)
    model = BlockMLP(args.width, args.depth).to(ctx.device)
    reference = copy.deepcopy(model)  # for the checks

    shard_linears(model, ctx)  # every Linear keeps 1/N of itself
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)  # the shards only: its state is 1/N
    losses = []
    for step in range(args.steps):
        xb, yb = rank_batch(x, y, step, args.batch, ctx)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()  # per layer, last to first: all_gather, gradients, reduce_scatter
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())

    grad_diff = check_reduced_gradient(reference, x, y, args, ctx)
    worst = check_matches_one_process(model, losses, reference, x, y, args)
    share = check_memory(model, opt, reference, x, y, args, ctx)
    print0(
        f"OK: ZeRO-3 by hand on {ctx.world_size} ranks (each holding {share:.3f} of the state) "
        f"matches single-process Adam after {args.steps} steps (max diff {worst:.1e}); its "
        f"reduce_scattered gradient shards match one process's gradient ({grad_diff:.1e})"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_reduced_gradient(start, x, y, args, ctx):
    """Step 0's shard.grad (the reduce_scatter's result) against one process's gradient of the whole
    batch, cut as the shards: float32 rounding only, hence 1e-6. A SUM for the AVG is N times too
    large, which Adam's step (lr * m / sqrt(v)) hides from check_matches_one_process."""
    one, sharded = copy.deepcopy(start), shard_linears(copy.deepcopy(start), ctx)
    F.cross_entropy(one(x[: args.batch]), y[: args.batch]).backward()
    xb, yb = rank_batch(x, y, 0, args.batch, ctx)
    F.cross_entropy(sharded(xb), yb).backward()
    worst = torch.zeros((), device=ctx.device)
    plain = [m for m in one.modules() if isinstance(m, nn.Linear)]
    for mine, ref in zip([m for m in sharded.modules() if isinstance(m, ShardedLinear)], plain):
        full = torch.cat([ref.weight.grad.flatten(), ref.bias.grad, ref.bias.new_zeros(mine.pad)])
        want = full.chunk(ctx.world_size)[ctx.rank]
        worst = torch.maximum(worst, (mine.shard.grad - want).abs().max())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    worst = worst.item()
    print0(f"reduce_scattered gradient of step 0 - one process's: {worst:.2e} (tolerance 1e-6)")
    if worst > 1e-6:
        raise RuntimeError(f"the reduced gradient shards differ from one process's by {worst:.2e}")
    return worst


def check_matches_one_process(model, losses, reference, x, y, args):
    ref_losses = train_one_process(reference, x, y, args.batch, args.steps, args.lr)
    losses = torch.stack(losses)
    dist.all_reduce(losses, op=dist.ReduceOp.AVG)  # equal shares: the loss of the global batch
    worst_loss, worst = (losses - ref_losses).abs().max().item(), 0.0
    plain = [m for m in reference.modules() if isinstance(m, nn.Linear)]
    for mine, ref in zip([m for m in model.modules() if isinstance(m, ShardedLinear)], plain):
        weight, bias, _ = mine.gather(mine.shard.detach())
        worst = max(
            worst, (weight - ref.weight).abs().max().item(), (bias - ref.bias).abs().max().item()
        )
    print0(
        f"max |loss - single-process loss| over {args.steps} steps: {worst_loss:.2e}; "
        f"max |param - single-process param|: {worst:.2e} (tolerance {args.tol:g})"
    )
    # Same device, same kernels: only the order of float32 sums differs (my share's gradient, then
    # the average over ranks, against one full batch), ~1e-7 relative, which training amplifies
    # (measured on CPU at 4 ranks: ~1e-7 at the defaults, 1.1e-5 at --width 256 --depth 4). Hence
    # --tol 1e-4. TF32 is off by default on GPUs (docs notes/cuda.html, "TensorFloat-32 (TF32) on
    # Ampere (and later) devices").
    if worst > args.tol or worst_loss > args.tol:
        raise RuntimeError(
            f"ZeRO-3 by hand differs from single-process training by {max(worst, worst_loss):.2e}"
        )
    return max(worst, worst_loss)


def watch_gathers(model):
    """{"gathered": the full layers gathered so far (freed ones hold 0 B), "peak": the most bytes
    alive at once}, kept up to date by wrapping each ShardedLinear's gather."""
    memo = {"gathered": [], "peak": 0}

    def watched(shard, gather):
        weight, bias, full = gather(shard)
        memo["gathered"].append(full)
        memo["peak"] = max(memo["peak"], storage_bytes(memo["gathered"]))
        return weight, bias, full

    for m in model.modules():
        if isinstance(m, ShardedLinear):
            m.gather = lambda shard, gather=m.gather: watched(shard, gather)
    return memo


def check_memory(model, opt, reference, x, y, args, ctx):
    """About 1/N of the unsharded state per rank; one gathered layer at a time, freed after use."""
    memo = watch_gathers(model)
    held = step_bytes(model, opt, *rank_batch(x, y, 0, args.batch, ctx))
    ref = step_bytes(
        reference, torch.optim.Adam(reference.parameters()), x[: args.batch], y[: args.batch]
    )
    largest = max(
        storage_bytes(m.parameters()) for m in reference.modules() if isinstance(m, nn.Linear)
    )
    share = sum(held) / sum(ref)
    print_in_order(
        f"params {held[0]} B, grads {held[1]} B, Adam state {held[2]} B = {sum(held)} B "
        f"({share:.3f} of unsharded); peak gathered at once {memo['peak']} B"
    )
    print0(
        f"unsharded (one process): params {ref[0]} B, grads {ref[1]} B, Adam state {ref[2]} B "
        f"= {sum(ref)} B; 1/N = {1 / ctx.world_size:.3f}; the largest layer is {largest} B"
    )
    one_layer = largest + 4 * ctx.world_size  # plus its padding: under N floats
    if (
        storage_bytes(memo["gathered"])
        or memo["peak"] > one_layer
        or abs(share * ctx.world_size - 1) > 0.1
    ):
        raise RuntimeError(
            "a gathered layer outlived its use, or a rank holds more than 1/N of the state"
        )
    return share


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
        "--tol", type=float_in(0, 1, low_open=True), default=1e-4, help="max |ZeRO-3 - one process|"
    )
    run(main, parser.parse_args())
