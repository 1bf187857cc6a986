"""Build a model no rank could hold whole: meta device, fully_shard, to_empty, init; CPUOffloadPolicy.

Under torch.device("meta") modules get parameters with shapes and no storage: nothing is
allocated, no random number drawn. fully_shard shards those meta parameters; to_empty()
then allocates each rank's shards only (uninitialised) and the init fills them. Random
init of sharded parameters depends on the device (on CPU shards, as offloaded ones are,
each rank draws the first numbers of its own generator: measured below), so the lesson draws
each full parameter in turn, in the order a normal build draws them, and keeps its own
shard: at most one full parameter exists at a time.
CPUOffloadPolicy keeps the sharded parameters, gradients and Adam state in CPU memory and
steps the optimizer there; FSDP copies a block's shards to the GPU just for its all_gather.
That saves GPU memory and is meaningful on a GPU; on CPU it is accepted and changes
nothing (its pinned memory needs an accelerator: pin_memory=False there).

    torchrun --nproc_per_node=4 fsdp_basics/fsdp_offload.py
    python fsdp_basics/fsdp_offload.py --nproc 2 --width 1024 --depth 8

Docs: https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html#torch.distributed.fsdp.CPUOffloadPolicy
      https://pytorch.org/docs/stable/meta.html
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor

from launch.dist_setup import lesson_parser, print0, print_in_order, run
from toy import BlockMLP, make_data


def init_linear_(weight, bias):
    """The draws nn.Linear.reset_parameters makes, on full tensors."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    bound = 1 / math.sqrt(weight.shape[1])
    nn.init.uniform_(bias, -bound, bound)


@torch.no_grad()
def compare(sharded, plain, device):
    """(largest |sharded - plain|, L2 norm of sharded - plain) over all ranks.

    Shard by shard: each rank compares the slice it holds with the same slice of the plain
    parameter, on `device`. full_tensor() would all_gather the offloaded CPU shards, which NCCL
    refuses, and would build every full parameter, which this lesson is about avoiding."""
    diffs = [torch.zeros(1, device=device)]  # a shard may be empty (more ranks than rows)
    for p, q in zip(sharded.parameters(), plain.parameters()):
        mine = distribute_tensor(q.detach(), p.device_mesh, p.placements, src_data_rank=None).to_local()
        diffs.append((p.to_local().to(device) - mine).abs().flatten())
    diff = torch.cat(diffs)
    worst, square = diff.max(), diff.square().sum()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    dist.all_reduce(square, op=dist.ReduceOp.SUM)
    return worst.item(), square.sqrt().item()


def check_trained_like_one_process(model, reference, start, args):
    """Relative L2, not the largest element: Adam's step lr * m / sqrt(v) is about lr whatever the size
    of the gradient, so where a gradient is nearly 0 its rounding (N shards reduced on ctx.device, Adam
    on the CPU shards; the reference: one batch, Adam on ctx.device) can turn that element's step around.
    Measured on CPU: at --width 1024 --depth 8 the largest element is 3.3e-4 off, yet |diff| is 3.4e-5
    of the distance trained; at the defaults ~1e-6. A rank that does not average is ~1 off. Hence 1e-3."""
    worst, l2 = compare(model, reference, start[0].device)
    moved = torch.cat([(p.detach() - p0).flatten() for p, p0 in zip(reference.parameters(), start)]).norm().item()
    print0(f"after {args.steps} Adam steps: max |param - single process| = {worst:.2e}; "
           f"|param - single process| / |param moved| = {l2 / moved:.1e} (tolerance {args.tol:g})")
    return l2 / moved


def build_sharded(args, mesh, offload):
    with torch.device("meta"):
        model = BlockMLP(args.width, args.depth)  # shapes only
    for block in model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=offload)
    fully_shard(model, mesh=mesh, offload_policy=offload)
    model.to_empty(device="cpu")  # this rank's shards, uninitialised; offloaded shards live on CPU
    return model


def main(args, ctx):
    ctx.require(args.batch % ctx.world_size == 0, f"--batch {args.batch} must divide by {ctx.world_size} ranks")
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))  # the device FSDP gathers and computes on
    offload = CPUOffloadPolicy(pin_memory=ctx.device.type != "cpu")  # pinning needs an accelerator
    if ctx.device.type == "cpu":
        print0("CPUOffloadPolicy: meaningful on GPU (it keeps shards and the optimizer step off the GPU); "
               "on CPU it is accepted, with pin_memory=False, and changes nothing")
    model = build_sharded(args, mesh, offload)
    held = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())

    torch.manual_seed(args.seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):  # modules() runs in the order the constructor drew
                # Full shapes, drawn on the CPU as a normal build draws them (same numbers on any machine)
                weight, bias = torch.empty(module.weight.shape, device="cpu"), torch.empty(module.bias.shape, device="cpu")
                init_linear_(weight, bias)
                for sharded, full in ((module.weight, weight), (module.bias, bias)):
                    # src_data_rank=None: every rank drew the same full tensor and keeps its slice, no traffic
                    mine = distribute_tensor(full, sharded.device_mesh, sharded.placements, src_data_rank=None)
                    sharded.to_local().copy_(mine.to_local())  # into my shard, wherever it lives (CPU: offloaded)

    torch.manual_seed(args.seed)
    reference = BlockMLP(args.width, args.depth).to(ctx.device)  # built normally, in one process
    full_bytes = sum(p.untyped_storage().nbytes() for p in reference.parameters())
    init_diff = compare(model, reference, ctx.device)[0]

    # What reset_parameters() on the shards would have given, for comparison.
    naive = build_sharded(args, mesh, offload)
    torch.manual_seed(args.seed)
    for module in naive.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
    naive_diff = compare(naive, reference, ctx.device)[0]
    del naive

    x, y = (t.to(ctx.device) for t in make_data(args.batch * args.steps))
    per_rank = args.batch // ctx.world_size
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=args.lr)
    start = [p.detach().clone() for p in reference.parameters()]
    for step in range(args.steps):
        lo = step * args.batch
        mine = slice(lo + ctx.rank * per_rank, lo + (ctx.rank + 1) * per_rank)
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()  # on the offloaded shards: on CPU
        opt.zero_grad()
        F.cross_entropy(reference(x[lo:lo + args.batch]), y[lo:lo + args.batch]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    param = model.blocks[0].fc.weight
    devices = {param.device.type, next(iter(opt.state.values()))["exp_avg"].device.type}
    print_in_order(f"allocated {held:,} B of parameters ({held / full_bytes:.3f} of the full {full_bytes:,} B); "
                   f"shards and Adam state on {', '.join(sorted(devices))}")
    print0(f"init one parameter at a time: max |param - normal build| = {init_diff:.1e}; "
           f"reset_parameters() on the {param.device.type} shards instead: {naive_diff:.1e}")
    train_diff = check_trained_like_one_process(model, reference, start, args)
    if init_diff != 0 or train_diff > args.tol or devices != {"cpu"}:
        raise RuntimeError(f"meta init or offloaded training is off: init {init_diff}, training {train_diff}, "
                           f"state on {devices}")
    print0(f"OK: built sharded from the meta device on {ctx.world_size} ranks (each allocating "
           f"{held / full_bytes:.3f} of the parameters), equal to the normal build; trained offloaded like one process")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=48, help="global batch, divisible by the world size")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tol", type=float, default=1e-3,
                        help="largest |param - single process| / |param moved by training| allowed")
    run(main, parser.parse_args())
