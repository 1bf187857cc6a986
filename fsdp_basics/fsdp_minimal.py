"""FSDP2 in its smallest form: fully_shard each block, then the root; train; match one process.

fully_shard(block) shards the block's parameters on dim 0 (rank r keeps rows r*ceil(n/N) up
to (r+1)*ceil(n/N); the last ranks fewer, or none) and groups them: one all_gather before the
block's forward, one reduce_scatter of its gradients in backward. fully_shard(model) last
takes the rest (the input and head layers) and makes the root. zero_by_hand.py does the same
by hand, one Linear at a time. reshard_after_forward=True (the default for all but the root)
frees a block's full parameters after its forward and gathers them again in backward; False
keeps them until backward: no second all_gather, more memory (as ZeRO-2). The lesson
measures both, and checks that FSDP trains like one process on the whole batch (as DDP does).

    torchrun --nproc_per_node=3 fsdp_basics/fsdp_minimal.py
    python fsdp_basics/fsdp_minimal.py --nproc 4 --width 256 --depth 4 --steps 50

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
      https://pytorch.org/docs/stable/distributed.tensor.html (DTensor)
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run
from toy import BlockMLP, make_data, rank_batch, storage_bytes, train_one_process


def main(args, ctx):
    ctx.require(
        args.batch % ctx.world_size == 0,
        f"--batch {args.batch} must divide by {ctx.world_size} ranks",
    )
    x, y = (t.to(ctx.device) for t in make_data(args.batch * args.steps))
    torch.manual_seed(0)  # the same initial model on every rank (drawn on the CPU, then moved)
    model = BlockMLP(args.width, args.depth).to(ctx.device)
    reference = copy.deepcopy(model)  # for the checks

    # Without a mesh FSDP builds one for the accelerator, even when this run is on the CPU.
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)  # its parameters become DTensors, Shard(0) (see print_shards)
    fully_shard(model, mesh=mesh)  # the root: inp and head
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)  # after fully_shard: it sees the shards
    losses = []
    for step in range(args.steps):
        xb, yb = rank_batch(x, y, step, args.batch, ctx)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()  # per block, last to first: all_gather, gradients, reduce_scatter
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())

    print_shards(model)
    held = measure_reshard_after_forward(reference, mesh, x, y, args, ctx)
    worst = check_matches_one_process(model, losses, reference, x, y, args)
    print0(
        f"OK: fully_shard per block + root on {ctx.world_size} ranks trains like one process for "
        f"{args.steps} steps (max diff {worst:.1e}); a block holds {held[True]} B instead of "
        f"{held[False]} B between forward and backward when resharded"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def print_shards(model):
    # A DTensor is a torch.Tensor that also knows its device mesh and its placement on it;
    # Shard(0): each rank holds a slice of dim 0 (docs: distributed.tensor.html).
    print0(
        "global shapes: " + ", ".join(f"{n} {tuple(p.shape)}" for n, p in model.named_parameters())
    )
    param = model.blocks[0].fc.weight
    print_in_order(
        f"{type(param).__name__} placements {param.placements}; local shards: "
        + ", ".join(f"{n} {tuple(p.to_local().shape)}" for n, p in model.named_parameters())
    )


def measure_reshard_after_forward(reference, mesh, x, y, args, ctx):
    """Bytes of block 0's parameters between forward and backward, for reshard_after_forward
    True and False."""
    held = {}
    for reshard in (True, False):
        probe = copy.deepcopy(reference)
        for block in probe.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        # the root: default None, i.e. False (backward needs it first)
        fully_shard(probe, mesh=mesh)
        xb, yb = rank_batch(x, y, 0, args.batch, ctx)
        loss = F.cross_entropy(probe(xb), yb)
        held[reshard] = storage_bytes(probe.blocks[0].parameters())
        loss.backward()  # every rank runs the same collectives, then the probe is dropped
    print0(
        f"block 0 between forward and backward: {held[True]} B with reshard_after_forward=True "
        f"(its shard), {held[False]} B with False (the full block; no all_gather in backward)"
    )
    if ctx.world_size > 1 and not held[True] < held[False]:  # at 1 rank the shard is the block
        raise RuntimeError(
            "reshard_after_forward=True should hold less between forward and backward"
        )
    return held


def check_matches_one_process(model, losses, reference, x, y, args):
    """Same device, same data, same initial weights, same kernels: only the order of summation in
    the gradient average differs (my share, then reduce_scatter, against one full batch): float32
    rounding, ~1e-7 relative, which training amplifies (measured on CPU at 4 ranks: 1e-7 after the
    default 10 steps, 8e-6 after 50 steps at --width 256 --depth 4). Hence --tol 1e-4. float32
    matmuls run in full float32 on GPUs too: TF32 is off by default (docs notes/cuda.html,
    "TensorFloat-32 (TF32) on Ampere (and later) devices"); with it on, ulp-level differences may
    grow past 1e-4."""
    ref_losses = train_one_process(reference, x, y, args.batch, args.steps, args.lr)
    losses = torch.stack(losses)
    dist.all_reduce(losses, op=dist.ReduceOp.AVG)  # equal shares: the loss of the global batch
    worst_loss = (losses - ref_losses).abs().max().item()
    # full_tensor() all_gathers a DTensor's shards into the whole tensor: every rank calls it.
    worst = max(
        (p.full_tensor() - q).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters())
    )
    for step in (0, args.steps - 1):
        print0(f"step {step}: loss FSDP {losses[step]:.6f}, one process {ref_losses[step]:.6f}")
    print0(
        f"max |loss FSDP - loss one process| over {args.steps} steps {worst_loss:.2e}, "
        f"max |param FSDP - param one process| {worst:.2e} (tolerance {args.tol:g})"
    )
    if worst > args.tol or worst_loss > args.tol:
        raise RuntimeError(f"FSDP and one process differ by {max(worst, worst_loss):.2e}")
    return max(worst, worst_loss)


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--width", type=int_in(1, 4096), default=64)
    parser.add_argument("--depth", type=int_in(1, 64), default=2)
    parser.add_argument(
        "--batch", type=int_in(1, 65536), default=48, help="global batch, divisible by N"
    )
    parser.add_argument("--steps", type=int_in(1, 10_000), default=10)
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=1e-2)
    parser.add_argument(
        "--tol",
        type=float_in(0, 1, low_open=True),
        default=1e-4,
        help="largest |FSDP - one process| (loss, params)",
    )
    run(main, parser.parse_args())
