"""Train the GPT with FSDP and tensor parallelism together, on a 2-D device mesh (dp x tp).

    torchrun --nproc_per_node=4 transformer_basics/train_2d.py      # 2 x 2 on CPU
    python transformer_basics/train_2d.py --nproc 4 --tp 2 --sequence-parallel
    torchrun --nnodes=2 --nproc_per_node=8 ... transformer_basics/train_2d.py --tp 4 --gpt2-small
                                                 # TP inside a node, FSDP across the nodes

The ranks form a dp x tp grid. Along tp (ranks of one row, best within one node: TP talks
in every layer) each block's matrices are split as in tensor_parallel.py; along dp (the
columns) FSDP shards what each rank holds and every row reads different data. This file is
train.py with these changes (`diff train.py train_2d.py`): the mesh, the two parallelize
calls, data sharded by dp rank, gradient clipping over two meshes, and a check that the first
step's gradients equal those of the unsharded model on the whole global batch.

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/tutorials/intermediate/TP_tutorial.html
      https://pytorch.org/docs/stable/distributed.tensor.parallel.html
"""

import argparse
import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import data
import training
from checkpointing import export_full_model, load_checkpoint, save_checkpoint
from launch.dist_setup import float_in, int_in, lesson_parser, print0, run
from model import GPT, config_from_args
from tensor_parallel import apply_tensor_parallel


def main(args, ctx):
    args.tp = args.tp or (2 if ctx.world_size % 2 == 0 else 1)  # 1 x 1, 2 x 1, 2 x 2, 4 x 2 ...
    ctx.require(
        ctx.world_size % args.tp == 0,
        f"{ctx.world_size} ranks do not form a grid with --tp {args.tp}: "
        f"the world size must be a multiple of --tp",
    )
    ctx.require(
        args.n_head % args.tp == 0, f"--n-head {args.n_head} must be a multiple of --tp {args.tp}"
    )
    ctx.require(
        not args.sequence_parallel or args.block_size % args.tp == 0,
        f"--sequence-parallel: --block-size {args.block_size} must be a multiple of --tp {args.tp}",
    )
    training.check_args(args, ctx)
    out = Path(args.out)
    ckpt = out / "checkpoint"
    ctx.require(not args.resume or ckpt.exists(), f"--resume: no checkpoint at {ckpt}")
    ctx.require_writable_dir(out)  # makes it, and checks that this rank can write there
    train_tokens, val_tokens = data.load_tokens(args.data, args.block_size, ctx)
    dp = ctx.world_size // args.tp
    mesh = init_device_mesh(ctx.device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    # The ranks of one tp row read the same windows: the data is sharded by dp rank.
    dp_rank = mesh["dp"].get_local_rank()
    train_data = data.ShardedWindows(train_tokens, args.block_size, dp_rank, dp, args.seed)
    val_data = data.ShardedWindows(val_tokens, args.block_size, dp_rank, dp, args.seed)

    torch.manual_seed(args.seed)  # the same initial model on every rank: each keeps its part
    cfg = config_from_args(args)
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
    optimizer, scheduler = training.make_optimizer(model, args)
    start = load_checkpoint(ckpt, model, optimizer, scheduler, ctx) if args.resume else 0
    resumed = f", resumed at step {start}" if args.resume else ""
    print0(
        f"model: {n_params / 1e6:.2f}M parameters, {cfg}; fsdp+tp on a {dp}x{args.tp} mesh{resumed}"
    )
    if reference is not None:
        check_first_step(model, reference, train_data, args, ctx)
        del reference

    def save(step):  # a collective: every rank calls it
        save_checkpoint(ckpt, model, optimizer, scheduler, step, ctx)

    result = training.fit(
        model, optimizer, scheduler, train_data, val_data, start, args, ctx, save, clip_grad_norm_2d
    )
    save(result.stop)
    export_full_model(model, cfg, out / "model.pt", ctx.rank)  # a collective: every rank

    training.print_summary(result, f"fsdp+tp {dp}x{args.tp}", flops_per_token, ctx)
    training.print_sample(out / "model.pt", args, ctx)
    training.check_loss_fell(result)
    print0(
        f"OK: fsdp+tp on a {dp}x{args.tp} mesh trained steps {start}..{result.stop - 1}, "
        f"val loss {result.val_first:.3f} -> {result.val_last:.3f}; checkpoint {ckpt}, model "
        f"{out / 'model.pt'}"
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


def check_first_step(model, reference, train_data, args, ctx):
    """Before training, on every rank and device: the 2-D model on this rank's windows and the
    unsharded model on the whole global batch (every dp row's) must produce the same gradients.
    In float32 without dropout (eval mode), whatever --dtype and --dropout train with: both models
    are then the same function, so only the order of sums differs (reduce-scatter over dp, TP's
    all_reduce, matmul splits), a few float32 ulps of each gradient, far below --tol 2e-5."""

    def batches(windows):
        return [
            tuple(t.to(ctx.device) for t in windows.batch(0, micro, args.batch_size, args.accum))
            for micro in range(args.accum)
        ]

    local = batches(train_data)
    every_row = [
        data.ShardedWindows(train_data.tokens, args.block_size, d, train_data.world_size, args.seed)
        for d in range(train_data.world_size)
    ]
    whole = [batch for windows in every_row for batch in batches(windows)]
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


def parse_args(argv=None):
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
    # 12 heads, 48 tokens: tp = 1, 2, 3, 4, 6
    return training.parse_args(parser, argv, out="runs/gpt_2d", n_head=12, n_embd=96, block_size=48)


if __name__ == "__main__":
    run(main, parse_args())
