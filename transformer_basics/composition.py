"""Activation checkpointing, torch.compile and DDP / FSDP2 on the same GPT, in the order that works.

FSDP2 (torchtitan's order): per block, 1. checkpoint, 2. compile, 3. fully_shard; then the root. The
all-gathers and reduce-scatters stay in FSDP2's eager hooks, between the blocks' graphs. One compile of
the whole sharded model instead (--other-order) leaves GPT.forward to eager: FSDP2's hooks are
dynamo-disabled (torch/distributed/fsdp/_fully_shard/_fsdp_common.py), and a graph break in a loop skips
the frame. DDP: checkpoint each block, wrap in DDP, compile. DDPOptimizer (torch/_dynamo/backends/
distributed.py; torch._dynamo.config.optimize_ddp, on by default) splits the graph at DDP's bucket
boundaries, so a bucket's all_reduce can start while backward goes on; it asserts that DDP's first bucket
(1 MiB) is not larger than the others, so --bucket-cap-mb below 1 fails to compile. Measured per rank:
bytes saved for backward, graphs compiled; the losses must equal one process's plain eager model.
Backend: "aot_eager" on CPU by default (the graphs and AC's recomputation, no code generation; with
inductor the default run took 57 s against 22 s on a shared 2-core CPU), "inductor" on GPUs.

    torchrun --nproc_per_node=2 transformer_basics/composition.py          # fsdp, AC, compile
    python transformer_basics/composition.py --nproc 2 --parallel ddp --no-ac
    python transformer_basics/composition.py --nproc 2 --other-order

Docs: https://pytorch.org/docs/stable/checkpoint.html, https://pytorch.org/docs/stable/torch.compiler.html,
      https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
"""

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from composition_tools import batch, counting, saved_tensors, train_reference
from launch.dist_setup import lesson_parser, print0, print_in_order, run, test_flags
from model import GPT, add_model_args, config_from_args


class Checkpointed(nn.Module):
    """One block under torch.utils.checkpoint: only its input is kept; backward runs it again.
    (torch.distributed.algorithms._checkpoint.checkpoint_wrapper does the same; private module.)"""

    def __init__(self, block, preserve_rng_state=True):
        super().__init__()
        self.block, self.preserve_rng_state = block, preserve_rng_state

    def forward(self, x):  # use_reentrant=False: the form the docs recommend
        return checkpoint(
            self.block, x, use_reentrant=False, preserve_rng_state=self.preserve_rng_state
        )


def main(args, ctx):
    check_args(args, ctx)
    torch.backends.cuda.matmul.fp32_precision = (
        "ieee"  # float32 matmuls, never TF32: the bound below assumes it
    )
    torch.manual_seed(args.seed)
    cfg = config_from_args(args)
    model = GPT(cfg).to(ctx.device)
    reference = copy.deepcopy(model)  # the plain model, for the check: before anything wraps it
    graphs = []  # the graphs dynamo compiled (measured; `counting` wraps the backend)
    backend = counting(args.compile_backend, graphs)
    # ---- the composition, in the order that works ----
    if args.other_order:
        model = compose_in_another_order(model, args, ctx, backend)
    elif args.parallel == "fsdp":
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for (
            name,
            block,
        ) in model.blocks.items():  # 1. checkpoint: inside the graph, so compile sees the recompute
            block = (
                Checkpointed(block, not args.no_preserve_rng_state) if args.ac else block
            )  # device: block's
            block = (
                torch.compile(block, backend=backend) if args.compile else block
            )  # 2. no collective in it
            fully_shard(
                block, mesh=mesh
            )  # 3. all-gather before, reduce-scatter after, in eager hooks
            model.blocks[name] = block
        fully_shard(model, mesh=mesh)  # the root: embeddings, final norm, head
    else:
        for name, block in model.blocks.items():
            model.blocks[name] = (
                Checkpointed(block, not args.no_preserve_rng_state) if args.ac else block
            )  # device: block's
        model = DDP(
            model,
            device_ids=None if ctx.device.type == "cpu" else [ctx.device],
            bucket_cap_mb=args.bucket_cap_mb,
        )
        model = (
            torch.compile(model, backend=backend) if args.compile else model
        )  # DDPOptimizer: a graph per bucket
    # ------------------------------------------------------
    optimizer, losses = torch.optim.SGD(model.parameters(), lr=args.lr), []
    for step in range(args.steps):
        x, y = batch(args, step, ctx.rank, ctx.device)
        torch.manual_seed(args.seed + 1000 * step + ctx.rank)  # dropout masks the check can replay
        with saved_tensors(model, saved := {}):  # a measurement, not part of the recipe
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    report_memory(reference, saved, args, ctx, graphs)
    check_losses(reference, torch.stack(losses), args, ctx)


def compose_in_another_order(model, args, ctx, backend):
    """--other-order. fsdp: shard, then one compile of the whole model. ddp: compile, then DDP (DDPOptimizer
    applies all the same: convert_frame.py asks DistributedDataParallel._get_active_ddp_module() per frame)."""
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,)) if args.parallel == "fsdp" else None
    for name, block in model.blocks.items():
        model.blocks[name] = (
            Checkpointed(block, not args.no_preserve_rng_state) if args.ac else block
        )  # device: block's
        if mesh is not None:
            fully_shard(model.blocks[name], mesh=mesh)
    if mesh is not None:
        fully_shard(model, mesh=mesh)
    model = torch.compile(model, backend=backend) if args.compile else model
    return (
        model
        if args.parallel == "fsdp"
        else DDP(
            model,
            device_ids=None if ctx.device.type == "cpu" else [ctx.device],
            bucket_cap_mb=args.bucket_cap_mb,
        )
    )


def report_memory(reference, saved, args, ctx, graphs):
    """Saved for backward by the composed model vs the plain eager model on this rank's step-0 batch."""
    x, y = batch(args, 0, ctx.rank, ctx.device)
    with saved_tensors(reference, plain := {}):
        F.cross_entropy(reference(x).flatten(0, 1), y.flatten())
    counts = (
        torch._dynamo.utils.counters
    )  # private, torch/_dynamo/utils.py: what dynamo did in this process
    breaks, eager = (
        sum(counts["graph_break"].values()),
        counts["frames"]["total"] - counts["frames"]["ok"],
    )
    saved, plain = sum(saved.values()), sum(plain.values())
    print_in_order(
        f"saved for backward: {saved:,} bytes, plain eager model {plain:,} "
        f"({saved / plain:.0%}); {len(graphs)} graph(s) compiled, {breaks} graph break(s), "
        f"{eager} frame(s) left to eager"
        + (
            f", peak CUDA memory {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB"
            if ctx.device.type == "cuda"
            else ""
        )
    )
    if args.ac and not saved < plain:
        raise RuntimeError(
            f"[rank {ctx.rank}] checkpointed, yet {saved} bytes saved for backward, "
            f"not fewer than the plain model's {plain}"
        )


def check_losses(reference, losses, args, ctx):
    dist.all_reduce(
        losses, op=dist.ReduceOp.AVG
    )  # equal batches on every rank: the global mean loss
    ref32 = train_reference(reference, args, ctx, torch.float32)
    # The composed run does the same float32 arithmetic in other orders (gradients summed across ranks, fused
    # or reordered by the compiler); each order is off the exact result by about float32's own rounding, which
    # we measure: float32 against float64, the same model without dropout (float64 draws other masks). 16x that.
    rounding = (
        (
            train_reference(reference, args, ctx, torch.float32, False)
            - train_reference(reference, args, ctx, torch.float64, False)
        )
        .abs()
        .max()
        .item()
    )
    bound = 16 * max(rounding, torch.finfo(torch.float32).eps * ref32.abs().max().item())
    diff = (losses.double().cpu() - ref32).abs().max().item()
    what = (
        f"{args.parallel}, {'checkpointed' if args.ac else 'no AC'}, "
        f"{'compiled (' + args.compile_backend + ')' if args.compile else 'eager'}"
    )
    print0(
        f"losses {', '.join(f'{v:.6f}' for v in losses.tolist())}; "
        f"one process {', '.join(f'{v:.6f}' for v in ref32.tolist())}\n"
        f"max difference {diff:.1e}, bound {bound:.1e} (16 x measured float32 rounding {rounding:.1e})"
    )
    if not diff <= bound:
        raise RuntimeError(
            f"[rank {ctx.rank}] {what}: losses differ from one process's plain model by {diff:.1e} "
            f"(bound {bound:.1e})"
        )
    print0(
        f"OK: {what}{' in another order' if args.other_order else ''} on {ctx.world_size} rank(s): "
        f"{args.steps} steps' losses equal the plain model on one process"
    )


def check_args(args, ctx):
    ctx.require(
        min(args.steps, args.batch_size, args.n_layer, args.n_head, args.n_embd, args.block_size)
        >= 1,
        "--steps, --batch-size, --n-layer, --n-head, --n-embd and --block-size must be at least 1",
    )
    ctx.require(
        args.n_embd % args.n_head == 0,
        f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}",
    )
    ctx.require(0 <= args.dropout < 1, f"--dropout must be in [0, 1), got {args.dropout}")
    ctx.require(
        args.bucket_cap_mb >= 1
        or not (args.compile and args.parallel == "ddp"),  # DDPOptimizer.__init__
        f"--bucket-cap-mb {args.bucket_cap_mb} with --compile: DDPOptimizer asserts that DDP's first bucket "
        "(1 MiB) is not larger than the others; use --bucket-cap-mb 1 or more, or --no-compile",
    )
    args.compile_backend = args.compile_backend or (
        "inductor" if ctx.device.type == "cuda" else "aot_eager"
    )
    ctx.require(
        args.compile_backend in torch._dynamo.list_backends(None),
        f"--compile-backend {args.compile_backend} is not a torch.compile backend: use aot_eager or inductor",
    )
    # torch/_inductor/config.py, fallback_random = False: inductor draws its own random numbers, not eager's
    ctx.require(
        not (args.compile and args.dropout and args.compile_backend == "inductor"),
        "--dropout with inductor: its masks differ from eager's, which the check replays; "
        "use --dropout 0, --no-compile or --compile-backend aot_eager",
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--parallel", choices=["ddp", "fsdp"], default="fsdp")
    parser.add_argument(
        "--ac", action=argparse.BooleanOptionalAction, default=True, help="checkpoint each block"
    )
    parser.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=True, help="torch.compile"
    )
    parser.add_argument(
        "--compile-backend", default=None, help="default: inductor on CUDA, aot_eager on CPU"
    )
    parser.add_argument(
        "--other-order",
        action="store_true",
        help="fsdp: shard, then compile all; ddp: compile, then DDP",
    )
    for flag, default, what in (
        ("--steps", 3, "SGD steps"),
        ("--batch-size", 4, "sequences per rank"),
        ("--lr", 0.5, "SGD learning rate"),
        ("--seed", 0, "model, data and dropout"),
    ):
        parser.add_argument(flag, type=type(default), default=default, help=what)
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=1.0, help="DDP's buckets (1: this model fills two)"
    )
    add_model_args(parser, n_layer=2, n_embd=128, block_size=32)
    test_flags(parser).add_argument(
        "--no-preserve-rng-state",
        action="store_true",
        help="checkpoint without restoring the RNG: with --dropout, the check fails",
    )
    run(main, parser.parse_args())
