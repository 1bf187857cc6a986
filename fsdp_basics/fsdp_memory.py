"""What one rank holds under DDP and under FSDP: parameters, gradients, Adam state, measured.

The bytes are read from the tensors' own storages after one training step (a storage that
several tensors share counts once, a DTensor counts its local shard), so the measure works
on any device. DDP keeps everything on every rank: with Adam 4 + 4 + 8 = 16 bytes per
parameter (fp32). FSDP keeps 1/N of each, plus, for a moment, the full parameters of the
block that computes (all_gathered, freed after). MixedPrecisionPolicy(param_dtype=bf16)
halves that transient block and the all_gather traffic; the sharded state stays fp32. The
lesson checks that FSDP's per-rank state is within 10% of 1/N of DDP's. (On a GPU
torch.cuda.max_memory_allocated() adds activations and buffers; storages work on CPU too.)

    torchrun --nproc_per_node=4 fsdp_basics/fsdp_memory.py
    python fsdp_basics/fsdp_memory.py --nproc 2 --width 1024 --depth 8

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
      https://arxiv.org/abs/1910.02054 (ZeRO: the memory formulas)
"""

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run
from toy import BlockMLP, make_data, step_bytes, storage_bytes


def measure(model, x, y, lr):
    """One Adam step; the bytes held: [params, grads, Adam state, their total, the largest
    gathered block]."""
    gathered = [0]

    def in_forward(block, inputs):  # after FSDP's own pre-forward hook: the block is unsharded
        gathered[0] = max(gathered[0], storage_bytes(block.parameters()))

    hooks = (
        []
        if isinstance(model, DDP)
        else [b.register_forward_pre_hook(in_forward) for b in model.blocks]
    )
    held = step_bytes(model, torch.optim.Adam(model.parameters(), lr=lr), x, y)
    for hook in hooks:
        hook.remove()
    return held + [sum(held), gathered[0]]


def main(args, ctx):
    x, y = (t.to(ctx.device) for t in make_data(args.batch * ctx.world_size))
    mine = slice(ctx.rank * args.batch, (ctx.rank + 1) * args.batch)
    torch.manual_seed(0)
    reference = BlockMLP(args.width, args.depth).to(ctx.device)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))  # FSDP's mesh: this run's device
    # gradient_as_bucket_view: the grads are views into DDP's all_reduce buckets, not a second copy.
    ddp = DDP(copy.deepcopy(reference), gradient_as_bucket_view=True)
    held = {"DDP": measure(ddp, x[mine], y[mine], args.lr)}
    for name, policy in (
        ("fp32", MixedPrecisionPolicy()),
        ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    ):
        model = copy.deepcopy(reference)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        held[name] = measure(model, x[mine], y[mine], args.lr)

    most = print_table(held, reference, args, ctx)
    excess = check_shares(most, ctx)
    print0(
        f"OK: on {ctx.world_size} ranks FSDP holds {most['fp32'][3] / most['DDP'][3]:.3f} of DDP's "
        f"per-rank state ({excess:+.1%} off the ideal 1/{ctx.world_size}); a bf16 gathered block "
        f"is {most['bf16'][4] / most['fp32'][4]:.2f} of the fp32 one"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def print_table(held, reference, args, ctx):
    """Each rank's FSDP line, then rank 0's table of the most any rank holds (padding lands
    unevenly); returns that {name: [params, grads, Adam, total, gathered block]}."""
    ddp, fsdp = held["DDP"], held["fp32"]
    print_in_order(
        f"FSDP: params {fsdp[0]:,} B, grads {fsdp[1]:,} B, Adam state {fsdp[2]:,} B "
        f"= {fsdp[3] / ddp[3]:.3f} of DDP's {ddp[3]:,} B"
    )
    most = {}
    for name, row in held.items():
        row = torch.tensor(row, device=ctx.device)
        dist.all_reduce(row, op=dist.ReduceOp.MAX)
        most[name] = row.tolist()
    ddp, fsdp, bf16 = most["DDP"], most["fp32"], most["bf16"]
    n_params, ideal = sum(p.numel() for p in reference.parameters()), 1 / ctx.world_size
    print0(
        f"\n{n_params:,} parameters ({args.depth} blocks of width {args.width}) on "
        f"{ctx.world_size} ranks: bytes per rank (FSDP: the most any rank holds)"
    )
    print0(f"{'':<15}{'DDP':>11}{'FSDP':>11}{'FSDP/DDP':>10}{'ideal':>7}{'FSDP bf16':>11}")
    for i, row in enumerate(["params", "grads", "Adam state", "total state"]):
        print0(
            f"{row:<15}{ddp[i]:>11,}{fsdp[i]:>11,}{fsdp[i] / ddp[i]:>10.3f}{ideal:>7.3f}"
            f"{bf16[i]:>11,}"
        )
    # DDP never gathers: it holds every block in full all the time
    print0(f"{'gathered block':<15}{'-':>11}{fsdp[4]:>11,}{'':>17}{bf16[4]:>11,}")
    print0(
        f"per parameter: DDP {ddp[3] / n_params:.1f} B, FSDP {fsdp[3] / n_params:.2f} B "
        f"(16/N = {16 / ctx.world_size:.2f}), in the largest block bf16/fp32 = "
        f"{bf16[4] / fsdp[4]:.2f}\n"
    )
    return most


def check_shares(most, ctx):
    """FSDP's total within 10% of 1/N of DDP's; bf16 params: the same fp32 state, a smaller
    gathered block."""
    excess = most["fp32"][3] / most["DDP"][3] * ctx.world_size - 1
    if abs(excess) > 0.10:
        raise RuntimeError(
            f"FSDP's state is {excess:+.1%} off 1/N of DDP's (padding? try a width divisible by N)"
        )
    if most["bf16"][:4] != most["fp32"][:4] or not most["bf16"][4] < most["fp32"][4]:
        raise RuntimeError(
            "bf16 params should keep the fp32 sharded state and gather a smaller block"
        )
    return excess


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--width",
        type=int_in(1, 4096),
        default=240,
        help="block width (240: N = 2, 3, 4 divide it)",
    )
    parser.add_argument("--depth", type=int_in(1, 64), default=4)
    parser.add_argument("--batch", type=int_in(1, 65536), default=16, help="examples per rank")
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=1e-3)
    run(main, parser.parse_args())
