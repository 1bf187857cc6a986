"""Train the GPT with FSDP and tensor parallelism together, on a 2-D device mesh (dp x tp).

    torchrun --nproc_per_node=4 transformer_basics/train_2d.py      # 2 x 2 on CPU
    torchrun --nnodes=2 --nproc_per_node=8 ... transformer_basics/train_2d.py --tp 4 --gpt2-small
                                                 # TP inside a node, FSDP across the nodes
    python transformer_basics/train_2d.py --nproc 4 --tp 2 --sequence-parallel

The ranks form a dp x tp grid. Along tp (ranks of one row, best within one node: TP talks
in every layer) each block's matrices are split as in tensor_parallel.py; along dp (the
columns) FSDP shards what each rank holds and every row reads different data. This file is
train.py with these changes (`diff train.py train_2d.py`): the mesh, the two parallelize
calls, data sharded by dp rank, gradient clipping over two meshes, and a check that the first
step's gradients equal those of the unsharded model on the whole global batch. Its flags, its
timing and its checks of a resume are train.py's (imported from there).

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/tutorials/intermediate/TP_tutorial.html
      https://pytorch.org/docs/stable/distributed.tensor.parallel.html
"""

import argparse
import copy
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import data
from checkpointing import (
    Checkpointer,
    export_full_model,
    find_checkpoint,
    load_checkpoint,
    make_out_dir,
)
from launch.dist_setup import float_in, int_in, lesson_parser, print0, run
from model import GPT, GPTConfig
from tensor_parallel import apply_tensor_parallel
from train import Progress, add_flags, check_loss_fell, check_resumed, parse, print_sample


def main(args, ctx):
    tp = args.tp or (2 if ctx.world_size % 2 == 0 else 1)  # 1 x 1, 2 x 1, 2 x 2, 4 x 2 ...
    ctx.require(
        ctx.world_size % tp == 0,
        f"{ctx.world_size} ranks do not form a grid with --tp {tp}: "
        f"the world size must be a multiple of --tp",
    )
    ctx.require(args.n_head % tp == 0, f"--n-head {args.n_head} must be a multiple of --tp {tp}")
    ctx.require(
        not args.sequence_parallel or args.block_size % tp == 0,
        f"--sequence-parallel: --block-size {args.block_size} must be a multiple of --tp {tp}",
    )
    out = Path(args.out)
    ckpt = out / "checkpoint"
    if args.resume:  # whichever checkpoint --out holds: a DCP one (its shards fit any mesh)
        ckpt = find_checkpoint(out, True, ctx)
    train_tokens, val_tokens = data.load_tokens(args.data, args.block_size, ctx)
    make_out_dir(out, ctx)  # after the refusals: a refused run writes nothing
    dp = ctx.world_size // tp
    mesh = init_device_mesh(ctx.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    # The ranks of one tp row read the same windows: the data is sharded by dp rank.
    dp_rank = mesh["dp"].get_local_rank()
    shard = dict(rank=dp_rank, world_size=dp, seed=args.seed)
    train_data = data.ShardedWindows(train_tokens, args.block_size, **shard)
    val_data = data.ShardedWindows(val_tokens, args.block_size, **shard)

    torch.manual_seed(args.seed)  # the same initial model on every rank: each keeps its part
    sizes = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout")
    cfg = GPTConfig(**{name: getattr(args, name) for name in sizes})
    model = GPT(cfg).to(ctx.device)
    n_params, flops_per_token = model.num_params(), model.flops_per_token()
    if args.compile:
        model.compile()  # in place: parameter names (and so checkpoints) stay the same
    reference = copy.deepcopy(model) if not args.resume and args.check else None
    # ---- the parallelism: where train.py has DDP or FSDP, a 2-D plan ----
    apply_tensor_parallel(model, mesh["tp"], args.sequence_parallel)  # first TP within each row...
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh["dp"])  # ...then FSDP shards each rank's slices along dp
    fully_shard(model, mesh=mesh["dp"])
    # --------------------------------------------------------------------
    # AdamW, weight decay on matrices (Linear weights, embeddings) only, never on biases and norms;
    # fused: one kernel updates every parameter (CUDA, and CPU since torch 2.4), no Python loop
    params = [p for p in model.parameters() if p.requires_grad]  # a tied weight comes once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=True)

    def lr_factor(step):  # a linear warm-up to --lr, then a cosine down to --min-lr at --steps
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        floor = args.min_lr / args.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    stateful = (model, optimizer, scheduler)  # what a checkpoint holds, with the step and the RNG
    start = load_checkpoint(ckpt, stateful, ctx) if args.resume else 0
    if args.resume:  # the check: what was restored, against the checkpoint read back
        check_resumed(ckpt, stateful, start=start, ctx=ctx)
    ctx.require(
        start < args.steps,
        f"--resume: the checkpoint is at step {start}, nothing left of --steps {args.steps}",
    )
    stop = min(args.steps, start + args.stop_after) if args.stop_after else args.steps
    resumed = f", resumed at step {start}" if args.resume else ""
    print0(f"model: {n_params / 1e6:.2f}M parameters, {cfg}; fsdp+tp on a {dp}x{tp} mesh{resumed}")
    if reference is not None:
        check_first_step(model, reference, windows=train_data, args=args, ctx=ctx)
        del reference
    save = Checkpointer(ckpt, stateful, ctx)
    # bf16 autocast on a GPU that has it (--dtype auto); weights, gradients and AdamW stay float32
    gpu_bf16 = ctx.device.type == "cuda" and torch.cuda.is_bf16_supported()
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and gpu_bf16)
    autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=bf16)

    @torch.no_grad()
    def evaluate():  # the held-out loss: every rank its share of the windows, then the mean
        model.eval()
        total = torch.zeros((), device=ctx.device)
        for i in range(args.eval_batches):
            x, y = val_data.batch(i, 0, args.batch_size, args.accum, device=ctx.device)
            with autocast:
                total += model(x, y)
        dist.all_reduce(total, op=dist.ReduceOp.AVG)  # a collective: every rank evaluates
        model.train()
        return total.item() / args.eval_batches

    val_first = evaluate()
    tokens = args.batch_size * args.accum * args.block_size * dp  # per step: a row reads alike
    progress = Progress(range(start, stop), tokens_per_step=tokens, args=args, ctx=ctx)
    for step in progress:  # times the steps (and --profile)
        loss_sum = torch.zeros((), device=ctx.device)
        for micro in range(args.accum):
            x, y = train_data.batch(step, micro, args.batch_size, args.accum, device=ctx.device)
            # FSDP reduce-scatters the gradients over dp on the last micro-batch only; TP's
            # all-reduces (inside the forward and backward of every block) run every time.
            model.set_requires_gradient_sync(micro == args.accum - 1)
            with autocast:
                loss = model(x, y) / args.accum  # the loss inside: compiled with the head
            loss.backward()
            loss_sum += loss.detach()  # stays on the device: no host sync per step
        clip_grad_norm_2d(model, args.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == stop - 1:  # the only host syncs: when logging
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)  # the mean over the ranks' batches
            progress.log(step, loss_sum.item(), scheduler.get_last_lr()[0])
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < stop:
            save(step + 1)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < stop:
            print0(f"step {step + 1}: val loss {evaluate():.3f}")
    val_last = evaluate()
    save(stop, last=True)
    export_full_model(model, cfg, out / "model.pt")  # a collective: every rank

    label = f"fsdp+tp {dp}x{tp}"
    progress.summary(label, (val_first, val_last), flops_per_token, bf16)
    print_sample(out / "model.pt", args.sample_tokens, ctx)
    check_loss_fell(val_first, val_last)
    print0(
        f"OK: fsdp+tp on a {dp}x{tp} mesh trained steps {start}..{stop - 1}, "
        f"val loss {val_first:.3f} -> {val_last:.3f}; checkpoint {ckpt}, model {out / 'model.pt'}"
    )


def clip_grad_norm_2d(model, max_norm):
    """clip_grad_norm_ across two meshes: TP'd parameters live on dp x tp, the rest on dp alone,
    and DTensor ops cannot mix meshes. So: one norm per mesh, combined, then one scale."""
    by_mesh = {}
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p)
    norms = [
        torch.nn.utils.get_total_norm([p.grad for p in ps]).full_tensor() for ps in by_mesh.values()
    ]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for ps in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_first_step(model, reference, windows, args, ctx):
    """Before training, on every rank and device: the 2-D model on this rank's windows and the
    unsharded model on the whole global batch (every dp row's) must produce the same gradients.
    In float32 without dropout (eval mode), whatever --dtype and --dropout train with: both models
    are then the same function, so only the order of sums differs (reduce-scatter over dp, TP's
    all_reduce, matmul splits), a few float32 ulps of each gradient, far below --tol 2e-5."""

    def batches(shard):
        return [
            tuple(t.to(ctx.device) for t in shard.batch(0, micro, args.batch_size, args.accum))
            for micro in range(args.accum)
        ]

    rows = windows.world_size  # dp
    every_row = [
        data.ShardedWindows(
            windows.tokens, args.block_size, rank=d, world_size=rows, seed=args.seed
        )
        for d in range(rows)
    ]
    local, whole = batches(windows), [batch for row in every_row for batch in batches(row)]
    model.eval(), reference.eval()
    for x, y in local:
        (F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / len(local)).backward()
    for x, y in whole:
        (F.cross_entropy(reference(x).flatten(0, 1), y.flatten()) / len(whole)).backward()
    worst = 0.0
    for (name, p), ref_p in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, (grad - ref_p.grad).abs().max().item())
        if worst > args.tol:
            raise RuntimeError(
                f"first step: gradient of {name} differs from the unsharded model's by {worst:.2e}"
            )
    model.zero_grad(set_to_none=True)
    model.train()
    print0(
        "check: step 0's gradients (float32) equal the unsharded model's on the global batch "
        f"(max diff {worst:.1e})"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--tp",
        type=int_in(1, 4096),
        help="tensor-parallel size (a row of the mesh); dp = ranks / tp "
        "(default: 2 on an even world size, else 1)",
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="also split norms and activations by sequence",
    )
    parser.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check step 0 against the unsharded model (a whole copy on every rank)",
    )
    parser.add_argument(
        "--tol",
        type=float_in(0, 1),
        default=2e-5,
        help="largest gradient difference the check accepts (float32, see check_first_step)",
    )
    add_flags(parser)
    # 12 heads, 48 tokens: tp = 1, 2, 3, 4, 6
    parser.set_defaults(out="runs/gpt_2d", n_head=12, n_embd=96, block_size=48)
    run(main, parse(parser, None))
