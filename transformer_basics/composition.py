"""Activation checkpointing, torch.compile and DDP / FSDP2 on the same GPT, in the order that works.

FSDP2 (torchtitan's order): per block, 1. checkpoint, 2. compile, 3. fully_shard; then the root.
The all-gathers and reduce-scatters stay in FSDP2's eager hooks, between the blocks' graphs. One
compile of the whole sharded model instead (--other-order) leaves GPT.forward to eager: FSDP2's
hooks are dynamo-disabled (torch/distributed/fsdp/_fully_shard/_fsdp_common.py), and a graph
break in a loop skips the frame. DDP: checkpoint each block, wrap in DDP, compile. DDPOptimizer
(torch/_dynamo/backends/distributed.py; torch._dynamo.config.optimize_ddp, on by default) splits
the graph at DDP's bucket boundaries, so a bucket's all_reduce can start while backward goes on;
it asserts that DDP's first bucket (1 MiB) is not larger than the others, so --bucket-cap-mb
below 1 fails to compile. Measured per rank: bytes saved for backward, graphs compiled; the
losses must equal one process's plain eager model. Backend: "aot_eager" on CPU by default (the
graphs and AC's recomputation, no code generation: inductor's C++ build is slower there, see
the README), "inductor" on GPUs. The first step compiles: the collective timeout is 600 s here
(see the parser below).

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

    torchrun --nproc_per_node=2 transformer_basics/composition.py          # fsdp, AC, compile
    python transformer_basics/composition.py --nproc 2 --parallel ddp --no-ac
    python transformer_basics/composition.py --nproc 2 --other-order

Docs: https://pytorch.org/docs/stable/checkpoint.html
      https://pytorch.org/docs/stable/torch.compiler.html
      https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
"""

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run
from model import GPT, config_from_args


class Checkpointed(nn.Module):
    """One block under torch.utils.checkpoint: only its input is kept; backward runs it again.
    (torch.distributed.algorithms._checkpoint.checkpoint_wrapper does the same; private module.)"""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):  # use_reentrant=False: the form the docs recommend
        return checkpoint(self.block, x, use_reentrant=False)


def main(args, ctx):
    args.compile_backend = args.compile_backend or (
        "inductor" if ctx.device.type == "cuda" else "aot_eager"
    )
    check_args(args, ctx)
    # float32 matmuls, never TF32: the bound of check_losses assumes it
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.manual_seed(args.seed)
    model = GPT(config_from_args(args)).to(ctx.device)
    reference = copy.deepcopy(model)  # the plain model, for the check: before anything wraps it
    graphs = []  # the graphs dynamo compiled (measured; `counting` wraps the backend)
    backend = counting(args.compile_backend, graphs)
    device_ids = None if ctx.device.type == "cpu" else [ctx.device]
    # ---- the composition, in the order that works ----
    if args.other_order:
        model = compose_in_another_order(model, args, ctx, backend)
    elif args.parallel == "fsdp":
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for name, block in model.blocks.items():
            # 1. checkpoint: inside the graph, so that compile sees the recomputation
            block = Checkpointed(block) if args.ac else block  # device: block's
            # 2. compile: no collective in the graph
            block = torch.compile(block, backend=backend) if args.compile else block
            # 3. shard: all-gather before, reduce-scatter after, in FSDP2's eager hooks
            fully_shard(block, mesh=mesh)
            model.blocks[name] = block
        fully_shard(model, mesh=mesh)  # the root: embeddings, final norm, head
    else:
        for name, block in model.blocks.items():
            model.blocks[name] = Checkpointed(block) if args.ac else block  # device: block's
        model = DDP(model, device_ids=device_ids, bucket_cap_mb=args.bucket_cap_mb)
        if args.compile:  # DDPOptimizer: a graph per bucket
            model = torch.compile(model, backend=backend)
    # ------------------------------------------------------
    optimizer, losses = torch.optim.SGD(model.parameters(), lr=args.lr), []
    for step in range(args.steps):
        x, y = batch(args, step, ctx.rank, ctx.device)
        torch.manual_seed(args.seed + 1000 * step + ctx.rank)  # dropout masks the check replays
        with saved_tensors(model, saved := {}):  # a measurement, not part of the recipe
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    report_memory(reference, saved, args, ctx, graphs)
    what = check_losses(reference, torch.stack(losses), args, ctx)  # raises if they differ
    print0(f"OK: {what}: {args.steps} steps' losses equal the plain model on one process")


def compose_in_another_order(model, args, ctx, backend):
    """--other-order. fsdp: shard, then one compile of the whole model. ddp: compile, then DDP
    (DDPOptimizer applies all the same: convert_frame.py asks
    DistributedDataParallel._get_active_ddp_module() per frame)."""
    fsdp = args.parallel == "fsdp"
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,)) if fsdp else None
    for name, block in model.blocks.items():
        model.blocks[name] = Checkpointed(block) if args.ac else block  # device: block's
        if fsdp:
            fully_shard(model.blocks[name], mesh=mesh)
    if fsdp:
        fully_shard(model, mesh=mesh)
    model = torch.compile(model, backend=backend) if args.compile else model
    if fsdp:
        return model
    device_ids = None if ctx.device.type == "cpu" else [ctx.device]
    return DDP(model, device_ids=device_ids, bucket_cap_mb=args.bucket_cap_mb)


# ---- The lesson ends here. What follows is how it checks itself. ----


def report_memory(reference, saved, args, ctx, graphs):
    """Saved for backward by the composed model vs the plain eager model on this rank's step-0
    batch, and what dynamo did in this process (torch._dynamo.utils.counters: private,
    torch/_dynamo/utils.py)."""
    x, y = batch(args, 0, ctx.rank, ctx.device)
    with saved_tensors(reference, plain := {}):
        F.cross_entropy(reference(x).flatten(0, 1), y.flatten())
    counts = torch._dynamo.utils.counters
    breaks = sum(counts["graph_break"].values())
    eager = counts["frames"]["total"] - counts["frames"]["ok"]
    saved, plain = sum(saved.values()), sum(plain.values())
    cuda = ctx.device.type == "cuda"
    peak = f", peak CUDA memory {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB" if cuda else ""
    print_in_order(
        f"saved for backward: {saved:,} bytes, plain eager model {plain:,} "
        f"({saved / plain:.0%}); {len(graphs)} graph(s) compiled, {breaks} graph break(s), "
        f"{eager} frame(s) left to eager{peak}"
    )
    if args.ac and not saved < plain:
        raise RuntimeError(
            f"[rank {ctx.rank}] checkpointed, yet {saved} bytes saved for backward, "
            f"not fewer than the plain model's {plain}"
        )


def check_args(args, ctx):
    ctx.require(
        args.n_embd % args.n_head == 0,
        f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}",
    )
    # DDPOptimizer.__init__ (torch/_dynamo/backends/distributed.py)
    ctx.require(
        args.bucket_cap_mb >= 1 or not (args.compile and args.parallel == "ddp"),
        f"--bucket-cap-mb {args.bucket_cap_mb:g} with --compile: DDPOptimizer asserts that DDP's "
        "first bucket (1 MiB) is not larger than the others; use --bucket-cap-mb 1 or more, or "
        "--no-compile",
    )
    ctx.require(
        args.compile_backend in torch._dynamo.list_backends(None),
        f"--compile-backend {args.compile_backend} is not a torch.compile backend: use aot_eager "
        "or inductor",
    )
    # torch/_inductor/config.py, fallback_random = False: inductor draws its own random numbers,
    # not eager's
    ctx.require(
        not (args.compile and args.dropout and args.compile_backend == "inductor"),
        "--dropout with inductor: its masks differ from eager's, which the check replays; "
        "use --dropout 0, --no-compile or --compile-backend aot_eager",
    )


# ---- what it measures and checks against: the graphs compiled, the bytes saved for backward,
# each rank's batch, and the plain model trained on one process, with the check of the losses ----


def counting(backend, graphs):
    """A torch.compile backend that notes each graph dynamo hands it, then compiles it with
    `backend` (torch._dynamo.lookup_backend: in torch/_dynamo/__init__.py's __all__, under a
    private package)."""

    def compile_graph(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    return compile_graph


def saved_tensors(model, storages):
    """Context manager: each tensor autograd saves for backward passes through pack
    (https://pytorch.org/docs/stable/autograd.html#hooks-for-saved-tensors);
    storages[data_ptr] = its bytes, so views count once; the weights are left out (they are kept
    anyway), also when saved as a view (linear saves weight.t()), by storage; a DTensor weight
    (FSDP2's sharded form) by its local tensor."""

    # a hook is a frame like any other: a compiled model would try to compile it
    @torch.compiler.disable
    def pack(t):
        # read at each save, not once: inside FSDP2's forward the module's parameters are the
        # all-gathered ones
        weights = {
            getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in model.parameters()
        }
        if t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def batch(args, step, rank, device):
    """Rank `rank`'s tokens at `step` (random bytes): a function of (seed, step, rank), so that
    one process can replay them."""
    generator = torch.Generator().manual_seed(args.seed + 7919 * step + 104729 * rank)
    shape = (args.batch_size, args.block_size + 1)
    tokens = torch.randint(256, shape, device="cpu", generator=generator)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def train_reference(model, args, ctx, dtype, dropout=True):
    """One process, plain eager model, no checkpoint, no compile: every rank's batch in turn (with
    that rank's dropout seed), the mean of their losses, one SGD step. The loss of each step."""
    model = copy.deepcopy(model).to(dtype)
    for m in model.modules() if not dropout else ():
        if isinstance(m, nn.Dropout) or hasattr(m, "dropout"):  # nn.Dropout's p, attention's
            m.p, m.dropout = 0.0, 0.0
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses = torch.zeros(args.steps, dtype=torch.float64, device="cpu")
    for step in range(args.steps):
        for rank in range(ctx.world_size):
            x, y = batch(args, step, rank, ctx.device)
            torch.manual_seed(args.seed + 1000 * step + rank)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / ctx.world_size
            loss.backward()
            losses[step] += loss.item()
        optimizer.step()
        optimizer.zero_grad()
    return losses


def check_losses(reference, losses, args, ctx):
    """The composed run's losses against the plain model trained on one process; raises if they
    differ, else returns what was run (for the OK line)."""
    # equal batches on every rank: the average is the global mean loss
    dist.all_reduce(losses, op=dist.ReduceOp.AVG)
    ref32 = train_reference(reference, args, ctx, torch.float32)
    # The composed run does the same float32 arithmetic in other orders (gradients summed across
    # ranks, fused or reordered by the compiler); each order is off the exact result by about
    # float32's own rounding, which we measure: float32 against float64, the same model without
    # dropout (float64 draws other masks). 16x that.
    no_dropout = [
        train_reference(reference, args, ctx, t, False) for t in (torch.float32, torch.float64)
    ]
    rounding = (no_dropout[0] - no_dropout[1]).abs().max().item()
    bound = 16 * max(rounding, torch.finfo(torch.float32).eps * ref32.abs().max().item())
    diff = (losses.double().cpu() - ref32).abs().max().item()
    compiled = f"compiled ({args.compile_backend})" if args.compile else "eager"
    what = f"{args.parallel}, {'checkpointed' if args.ac else 'no AC'}, {compiled}"
    print0(
        f"losses {', '.join(f'{v:.6f}' for v in losses.tolist())}; "
        f"one process {', '.join(f'{v:.6f}' for v in ref32.tolist())}\n"
        f"max difference {diff:.1e}, bound {bound:.1e} (16 x measured float32 rounding "
        f"{rounding:.1e})"
    )
    if not diff <= bound:
        raise RuntimeError(
            f"[rank {ctx.rank}] {what}: losses differ from one process's plain model by "
            f"{diff:.1e} (bound {bound:.1e})"
        )
    return f"{what}{' in another order' if args.other_order else ''} on {ctx.world_size} rank(s)"


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
    parser.add_argument("--steps", type=int_in(1, 1000), default=3, help="SGD steps")
    parser.add_argument("--batch-size", type=int_in(1, 4096), default=4, help="sequences per rank")
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.5, help="SGD's")
    parser.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0, help="model, data, dropout")
    parser.add_argument(
        "--bucket-cap-mb",
        type=float_in(0, 1024, low_open=True),
        default=1.0,
        help="DDP's buckets (1: this model fills two)",
    )
    # the GPT of model.py
    parser.add_argument("--n-layer", type=int_in(1, 256), default=2)
    parser.add_argument("--n-head", type=int_in(1, 1024), default=4)
    parser.add_argument("--n-embd", type=int_in(1, 65_536), default=128)
    parser.add_argument(
        "--block-size", type=int_in(1, 1_048_576), default=32, help="context length"
    )
    parser.add_argument("--dropout", type=float_in(0, 0.9), default=0.0)
    # The first forward and backward compile, on each rank by itself (inductor on CUDA: minutes
    # with a cold cache and 8 ranks compiling at once), while the ranks that finished first wait
    # in FSDP2's first all-gather or DDP's first all-reduce. A collective that waits longer than
    # the process group's timeout fails (NCCL's watchdog aborts it). So this lesson's default is
    # 600 s, torch's own default for NCCL (distributed_c10d.py, _set_pg_timeout's docstring,
    # torch 2.13), not launch/'s 60 s; torchtitan gives its first step 300 s
    # (comm.init_timeout_seconds). --timeout or DIST_TIMEOUT still set it.
    parser.set_defaults(timeout=os.environ.get("DIST_TIMEOUT", "600"))
    run(main, parser.parse_args())
