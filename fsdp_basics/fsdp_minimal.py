"""FSDP2 in its smallest form: fully_shard each block, then the root; train; match DDP.

fully_shard(block) turns the block's parameters into DTensors sharded on dim 0 (rank r
keeps rows r*ceil(n/N) up to (r+1)*ceil(n/N); the last ranks fewer, or none) and groups
them: one all_gather before the block's forward, one reduce_scatter of its gradients in
backward. fully_shard(model) last takes the rest
(here the input and head layers) and makes the root, which runs the first all_gather.
reshard_after_forward=True (the default for all but the root) frees a block's full
parameters after its forward and gathers them again in backward: least memory, one more
all_gather per block. False keeps them from forward to backward: no second all_gather, more
memory (as ZeRO-2); an int N' reshards to groups of N' ranks (e.g. a node) in between.
The lesson measures what a block holds between forward and backward under both, and
checks that FSDP trains like DDP on the same data (within --tol).

    torchrun --nproc_per_node=3 fsdp_basics/fsdp_minimal.py
    python fsdp_basics/fsdp_minimal.py --nproc 4 --width 256 --depth 4 --steps 50

Docs: https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
"""
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.dist_setup import lesson_parser, print0, print_in_order, run
from toy import BlockMLP, make_data


def held_bytes(module):
    """Bytes of the parameters a module holds right now (a DTensor counts its local shard)."""
    tensors = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def shard(reference, mesh, reshard_after_forward):
    model = copy.deepcopy(reference)
    for block in model.blocks:  # one communication group per block
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh)  # the root (inp, head); default None: False for the root, needed first in backward
    return model


def check_matches_ddp(model, ddp, worst_loss, args):
    """Both run on ctx.device, same data, same initial weights, same kernels: their forward and backward
    compute the same numbers, and only the order of summation in the gradient reduction differs
    (reduce_scatter vs all_reduce): float32 rounding, ~1e-7 relative, which training amplifies (measured on
    CPU at 4 ranks: 1e-7 after the default 10 steps, 8e-6 after 50 steps at --width 256 --depth 4). Hence
    --tol 1e-4. float32 matmuls run in full float32 on GPUs too: TF32 is off by default since torch 1.12
    (docs notes/cuda.html, "TensorFloat-32 (TF32) on Ampere (and later) devices"); a user who turns it on
    rounds matmul inputs to 10 bits, and ulp-level differences between the two runs may then grow past 1e-4."""
    # full_tensor() all_gathers a DTensor: every rank calls it.
    worst = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ddp.module.parameters()))
    print0(f"max |loss FSDP - loss DDP| over {args.steps} steps {worst_loss:.2e}, "
           f"max |param FSDP - param DDP| {worst:.2e} (tolerance {args.tol:g})")
    if worst > args.tol or worst_loss > args.tol:
        raise RuntimeError(f"FSDP and DDP differ by {max(worst, worst_loss):.2e}")
    return worst


def main(args, ctx):
    ctx.require(args.batch % ctx.world_size == 0,
                f"--batch {args.batch} must divide by {ctx.world_size} ranks (FSDP averages the ranks' gradients)")
    x, y = (t.to(ctx.device) for t in make_data(args.batch * args.steps))
    torch.manual_seed(0)  # the same initial model on every rank (drawn on the CPU, then moved)
    reference = BlockMLP(args.width, args.depth).to(ctx.device)
    # Without a mesh FSDP builds one for the accelerator, even when this run uses CPU + Gloo.
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    model = shard(reference, mesh, reshard_after_forward=True)
    ddp = DDP(copy.deepcopy(reference))

    print0("global shapes: " + ", ".join(f"{n} {tuple(p.shape)}" for n, p in model.named_parameters()))
    param = model.blocks[0].fc.weight
    print_in_order(f"{type(param).__name__} placements {param.placements}; local shards: "
                   + ", ".join(f"{n} {tuple(p.to_local().shape)}" for n, p in model.named_parameters()))

    def batch(step):  # this rank's share of the step's global batch
        lo = step * args.batch + ctx.rank * (args.batch // ctx.world_size)
        return x[lo:lo + args.batch // ctx.world_size], y[lo:lo + args.batch // ctx.world_size]

    # reshard_after_forward, measured: what block 0 holds between forward and backward.
    held = {}
    for reshard in (True, False):
        probe = shard(reference, mesh, reshard)
        loss = F.cross_entropy(probe(batch(0)[0]), batch(0)[1])
        held[reshard] = held_bytes(probe.blocks[0])
        loss.backward()  # every rank runs the same collectives, then the probe is dropped
    print0(f"block 0 between forward and backward: {held[True]} B with reshard_after_forward=True "
           f"(its shard), {held[False]} B with False (the full block; no all_gather in backward)")

    opt = torch.optim.Adam(model.parameters(), lr=args.lr)  # built after fully_shard: it sees the DTensors
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    worst_loss = 0.0
    for step in range(args.steps):
        losses = []
        for net, optimizer in ((model, opt), (ddp, ddp_opt)):
            loss = F.cross_entropy(net(batch(step)[0]), batch(step)[1])
            loss.backward()  # FSDP: reduce_scatter per block; DDP: all_reduce per bucket
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        both = torch.stack(losses)
        dist.all_reduce(both, op=dist.ReduceOp.AVG)  # the loss of the global batch
        worst_loss = max(worst_loss, (both[0] - both[1]).abs().item())
        if step in (0, args.steps - 1):
            print0(f"step {step}: loss FSDP {both[0]:.6f}, DDP {both[1]:.6f}")

    worst = check_matches_ddp(model, ddp, worst_loss, args)
    if ctx.world_size > 1 and not held[True] < held[False]:  # at 1 rank the shard is the block
        raise RuntimeError("reshard_after_forward=True should hold less between forward and backward")
    print0(f"OK: fully_shard per block + root on {ctx.world_size} ranks trains like DDP for {args.steps} steps "
           f"(max diff {max(worst, worst_loss):.1e}); a block holds {held[True]} B instead of {held[False]} B "
           f"between forward and backward when resharded")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=48, help="global batch, divisible by the world size")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--tol", type=float, default=1e-4, help="largest |FSDP - DDP| (loss, params) allowed")
    run(main, parser.parse_args())
