"""A model no rank could hold whole: meta device, fully_shard, to_empty, init; CPUOffloadPolicy.

Under torch.device("meta") modules get parameters with shapes and no storage: nothing allocated
or drawn. fully_shard shards them; to_empty() allocates this rank's shards only (uninitialised);
init_shards_ draws each full parameter in turn, as a normal build does, and keeps its shard
(reset_parameters() on the shards would not match: measured). CPUOffloadPolicy keeps shards,
gradients and Adam state in CPU memory and steps there; FSDP copies a block's shards to the GPU
for its all_gather. On CPU it changes nothing.

    torchrun --nproc_per_node=4 fsdp_basics/fsdp_offload.py
    python fsdp_basics/fsdp_offload.py --nproc 2 --width 1024 --depth 8

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html (CPUOffloadPolicy)
      https://pytorch.org/docs/stable/meta.html
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor

from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run
from toy import BlockMLP, make_data, rank_batch, train_one_process


@torch.no_grad()
def init_shards_(model):
    """Draw each full parameter in turn, as a normal build does, and keep my shard of it."""
    for module in model.modules():
        if isinstance(module, nn.Linear):  # modules() runs in the order the constructor drew
            # A plain Linear on the CPU draws as the normal build: the same numbers on any machine
            full = nn.Linear(module.in_features, module.out_features, device="cpu")
            for sharded, whole in ((module.weight, full.weight), (module.bias, full.bias)):
                # src_data_rank=None: each rank drew the same full tensor: keep my slice, no traffic
                mine = distribute_tensor(
                    whole, sharded.device_mesh, sharded.placements, src_data_rank=None
                )
                sharded.to_local().copy_(mine.to_local())  # my shard, wherever it lives (CPU here)


def main(args, ctx):
    ctx.require(
        args.batch % ctx.world_size == 0,
        f"--batch {args.batch} must divide by {ctx.world_size} ranks",
    )
    x, y = (t.to(ctx.device) for t in make_data(args.batch * args.steps))
    torch.manual_seed(0)  # the same draws on every rank (on the CPU), in a normal build's order
    with torch.device("meta"):
        model = BlockMLP(args.width, args.depth)  # shapes only
    # Without a mesh FSDP builds one for the accelerator, even when this run is on the CPU.
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    offload = CPUOffloadPolicy(pin_memory=ctx.device.type != "cpu")  # pinning: accelerators only
    for block in model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=offload)
    fully_shard(model, mesh=mesh, offload_policy=offload)
    model.to_empty(device="cpu")  # this rank's shards only, uninitialised; offloaded: on the CPU
    init_shards_(model)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)  # steps on the CPU, where the shards are
    losses = []
    for step in range(args.steps):
        xb, yb = rank_batch(x, y, step, args.batch, ctx)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()  # FSDP copies each block's shards to ctx.device for its all_gather
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    check_init_like_a_normal_build(args, mesh, offload, ctx)
    train_diff = check_trained_like_one_process(model, losses, x, y, args, ctx)
    check_state_on_cpu(model, opt, ctx)
    print0(
        f"OK: built sharded from the meta device on {ctx.world_size} ranks, equal to the normal "
        f"build; trained offloaded like one process ({train_diff:.1e} of the distance trained)"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


@torch.no_grad()
def compare(sharded, plain, device):
    """(largest |sharded - plain|, L2 norm of sharded - plain) over all ranks, shard by shard on
    `device`: full_tensor() would all_gather the offloaded CPU shards, which NCCL refuses (and
    build them in full)."""
    diffs = [torch.zeros(1, device=device)]  # a shard may be empty (more ranks than rows)
    for p, q in zip(sharded.parameters(), plain.parameters()):
        mine = distribute_tensor(
            q.detach(), p.device_mesh, p.placements, src_data_rank=None
        ).to_local()
        diffs.append((p.to_local().to(device) - mine).abs().flatten())
    diff = torch.cat(diffs)
    worst, square = diff.max(), diff.square().sum()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    dist.all_reduce(square, op=dist.ReduceOp.SUM)
    return worst.item(), square.sqrt().item()


def normal_build(args, ctx):
    torch.manual_seed(0)
    return BlockMLP(args.width, args.depth).to(ctx.device)


def check_init_like_a_normal_build(args, mesh, offload, ctx):
    """main's build again, initialised two ways: init_shards_ must equal the normal build exactly;
    reset_parameters() on the shards is measured for comparison. On a CPU mesh every rank draws the
    same numbers into its own shard (the op runs on each rank's local piece with that rank's
    generator: torch/distributed/tensor/_dispatch.py, torch 2.13; checked at 2 ranks), so only
    rank 0's shard matches the normal build."""
    diffs = {}
    for how in ("init_shards_", "reset_parameters"):
        with torch.device("meta"):
            model = BlockMLP(args.width, args.depth)
        for module in [*model.blocks, model]:
            fully_shard(module, mesh=mesh, offload_policy=offload)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        if how == "init_shards_":
            init_shards_(model)
        else:
            for linear in (m for m in model.modules() if isinstance(m, nn.Linear)):
                linear.reset_parameters()
        diffs[how] = compare(model, normal_build(args, ctx), ctx.device)[0]
    print0(
        f"init one parameter at a time: max |param - normal build| = {diffs['init_shards_']:.1e}; "
        f"reset_parameters() on the cpu shards instead: {diffs['reset_parameters']:.1e}"
    )
    if diffs["init_shards_"] != 0:
        raise RuntimeError(
            f"the sharded init differs from the normal build by {diffs['init_shards_']:.1e}"
        )


def check_trained_like_one_process(model, losses, x, y, args, ctx):
    """Relative L2, not the largest element: Adam's step lr * m / sqrt(v) is about lr whatever the
    size of the gradient, so where a gradient is nearly 0 its rounding (N shards reduced on
    ctx.device, Adam on the CPU shards; the reference: one batch, Adam on ctx.device) can turn that
    element's step around. Measured on CPU: at --width 1024 --depth 8 the largest element is 3.3e-4
    off, yet |diff| is 3.4e-5 of the distance trained; at the defaults ~1e-6. A rank that does not
    average is ~1 off. Hence 1e-3."""
    reference = normal_build(args, ctx)
    start = [p.detach().clone() for p in reference.parameters()]
    ref_losses = train_one_process(reference, x, y, args.batch, args.steps, args.lr)
    losses = torch.stack(losses)
    dist.all_reduce(losses, op=dist.ReduceOp.AVG)  # equal shares: the loss of the global batch
    worst, l2 = compare(model, reference, ctx.device)
    moved = (
        torch.cat([(p.detach() - p0).flatten() for p, p0 in zip(reference.parameters(), start)])
        .norm()
        .item()
    )
    print0(
        f"after {args.steps} Adam steps: max |loss - single process| = "
        f"{(losses - ref_losses).abs().max():.1e}, max |param - single process| = {worst:.2e}; "
        f"|param - single process| / |param moved| = {l2 / moved:.1e} (tolerance {args.tol:g})"
    )
    if l2 / moved > args.tol:
        raise RuntimeError(f"offloaded training is {l2 / moved:.1e} (relative) off one process")
    return l2 / moved


def check_state_on_cpu(model, opt, ctx):
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # global shapes
    held = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
    devices = {
        model.blocks[0].fc.weight.device.type,
        next(iter(opt.state.values()))["exp_avg"].device.type,
    }
    print_in_order(
        f"allocated {held:,} B of parameters ({held / full_bytes:.3f} of the full "
        f"{full_bytes:,} B); shards and Adam state on {', '.join(sorted(devices))}"
    )
    if ctx.device.type == "cpu":
        print0(
            "CPUOffloadPolicy: meaningful on GPU (it keeps shards and the optimizer step off the "
            "GPU); on CPU it is accepted, with pin_memory=False, and changes nothing"
        )
    if devices != {"cpu"}:
        raise RuntimeError(f"offloaded shards and Adam state should be on the CPU, found {devices}")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--width", type=int_in(1, 4096), default=64)
    parser.add_argument("--depth", type=int_in(1, 64), default=2)
    parser.add_argument(
        "--batch", type=int_in(1, 65536), default=48, help="global batch, divisible by N"
    )
    parser.add_argument("--steps", type=int_in(1, 10_000), default=5)
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=1e-2)
    parser.add_argument(
        "--tol",
        type=float_in(0, 1, low_open=True),
        default=1e-3,
        help="largest |param - single process| / |param moved by training| allowed",
    )
    run(main, parser.parse_args())
