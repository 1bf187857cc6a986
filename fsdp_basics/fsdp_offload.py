"""Build a model no rank could hold whole: meta device, fully_shard, to_empty, init; CPUOffloadPolicy.

Under torch.device("meta") modules get parameters with shapes and no storage: nothing is
allocated, no random number drawn. fully_shard shards those meta parameters; to_empty()
then allocates each rank's shards only (uninitialised) and the init fills them. Random
init of sharded parameters depends on the device (on CPU each rank draws its own numbers:
measured below), so the lesson draws each full parameter in turn, in the order a normal
build draws them, and keeps its own shard: at most one full parameter exists at a time.
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
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor

from launch.dist_setup import lesson_parser, print0, print_in_order, run
from toy import BlockMLP, make_data


def init_linear_(weight, bias):
    """The draws nn.Linear.reset_parameters makes, on full tensors."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    bound = 1 / math.sqrt(weight.shape[1])
    nn.init.uniform_(bias, -bound, bound)


def max_diff(sharded, plain):
    """Largest |difference| between a sharded model and a plain one (full_tensor(): a collective)."""
    return max((p.full_tensor() - q).abs().max().item() for p, q in zip(sharded.parameters(), plain.parameters()))


def build_sharded(args, offload):
    with torch.device("meta"):
        model = BlockMLP(args.width, args.depth)  # shapes only
    for block in model.blocks:
        fully_shard(block, offload_policy=offload)
    fully_shard(model, offload_policy=offload)
    model.to_empty(device="cpu")  # this rank's shards, uninitialised; offloaded shards live on CPU
    return model


def main(args, ctx):
    offload = CPUOffloadPolicy(pin_memory=ctx.device.type != "cpu")  # pinning needs an accelerator
    if ctx.device.type == "cpu":
        print0("CPUOffloadPolicy: meaningful on GPU (it keeps shards and the optimizer step off the GPU); "
               "on CPU it is accepted, with pin_memory=False, and changes nothing")
    model = build_sharded(args, offload)
    held = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())

    torch.manual_seed(args.seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):  # modules() runs in the order the constructor drew
                weight, bias = torch.empty(module.weight.shape), torch.empty(module.bias.shape)  # full shapes
                init_linear_(weight, bias)
                for sharded, full in ((module.weight, weight), (module.bias, bias)):
                    # src_data_rank=None: every rank drew the same full tensor and keeps its slice, no traffic
                    sharded.copy_(distribute_tensor(full, sharded.device_mesh, sharded.placements, src_data_rank=None))

    torch.manual_seed(args.seed)
    reference = BlockMLP(args.width, args.depth)  # built normally, in one process
    full_bytes = sum(p.untyped_storage().nbytes() for p in reference.parameters())
    init_diff = max_diff(model, reference)

    # What reset_parameters() on the shards would have given, for comparison.
    naive = build_sharded(args, offload)
    torch.manual_seed(args.seed)
    for module in naive.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
    naive_diff = max_diff(naive, reference)
    del naive

    x, y = make_data(args.batch * args.steps)
    per_rank = args.batch // ctx.world_size
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=args.lr)
    for step in range(args.steps):
        lo = step * args.batch
        mine = slice(lo + ctx.rank * per_rank, lo + (ctx.rank + 1) * per_rank)
        F.cross_entropy(model(x[mine].to(ctx.device)), y[mine].to(ctx.device)).backward()
        opt.step()  # on the offloaded shards: on CPU
        opt.zero_grad()
        F.cross_entropy(reference(x[lo:lo + args.batch]), y[lo:lo + args.batch]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    param = model.blocks[0].fc.weight
    devices = {param.device.type, next(iter(opt.state.values()))["exp_avg"].device.type}
    print_in_order(f"allocated {held:,} B of parameters ({held / full_bytes:.3f} of the full {full_bytes:,} B); "
                   f"shards and Adam state on {', '.join(sorted(devices))}")
    train_diff = max_diff(model, reference)
    print0(f"init one parameter at a time: max |param - normal build| = {init_diff:.1e}; "
           f"reset_parameters() on the {ctx.device.type} shards instead: {naive_diff:.1e}")
    print0(f"after {args.steps} Adam steps: max |param - single process| = {train_diff:.2e} (tolerance {args.tol:g})")
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
    parser.add_argument("--tol", type=float, default=1e-5)
    run(main, parser.parse_args())
