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
step's gradients equal those of the unsharded model on the whole global batch.

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/tutorials/intermediate/TP_tutorial.html
      https://pytorch.org/docs/stable/distributed.tensor.parallel.html
"""

import argparse
import copy
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import data
import training
from checkpointing import Checkpointer, export_full_model, load_checkpoint
from launch.dist_setup import float_in, int_in, lesson_parser, print0, run
from model import GPT, config_from_args
from tensor_parallel import apply_tensor_parallel
from train_checks import check_first_step, check_resumed


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
    training.check_args(args, ctx)
    out = Path(args.out)
    ckpt = out / "checkpoint"
    ctx.require(not args.resume or ckpt.exists(), f"--resume: no checkpoint at {ckpt}")
    train_tokens, val_tokens = data.load_tokens(args.data, args.block_size, ctx)
    # made here, after the refusals: a refused run writes nothing
    ctx.require(can_write_in(out), f"cannot write to {out}: pass another --out")
    dp = ctx.world_size // tp
    mesh = init_device_mesh(ctx.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    # The ranks of one tp row read the same windows: the data is sharded by dp rank.
    dp_rank = mesh["dp"].get_local_rank()
    shard = dict(rank=dp_rank, world_size=dp, seed=args.seed)
    train_data = data.ShardedWindows(train_tokens, args.block_size, **shard)
    val_data = data.ShardedWindows(val_tokens, args.block_size, **shard)

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
    bf16 = training.use_bf16(args, ctx)  # weights, gradients and AdamW stay float32
    autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=bf16)

    def evaluate():  # a collective: every rank evaluates its share of the held-out windows
        return training.evaluate(model, val_data, args=args, ctx=ctx)

    val_first = evaluate()
    tokens = args.batch_size * args.accum * args.block_size * dp  # per step: a row reads alike
    progress = training.Progress(range(start, stop), tokens_per_step=tokens, args=args, ctx=ctx)
    for step in progress:  # rank 0 shows a bar
        loss_sum = torch.zeros((), device=ctx.device)
        for micro in range(args.accum):
            x, y = train_data.batch(step, micro, batch_size=args.batch_size, accum=args.accum)
            x, y = data.to_device(x, ctx.device), data.to_device(y, ctx.device)
            # FSDP reduce-scatters the gradients over dp on the last micro-batch only; TP's
            # all-reduces (inside the forward and backward of every block) run every time.
            model.set_requires_gradient_sync(micro == args.accum - 1)
            with autocast:
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / args.accum
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
            progress.val(step + 1, evaluate())  # printed, kept for --chart
    val_last = evaluate()
    save(stop, last=True)
    export_full_model(model, cfg, out / "model.pt")  # a collective: every rank

    label = f"fsdp+tp {dp}x{tp}"
    progress.print_summary(label, (val_first, val_last), flops_per_token)
    training.print_sample(out / "model.pt", args, ctx)
    training.check_loss_fell(val_first, val_last)
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


def can_write_in(folder):
    """Make folder if it is missing; True if this rank can create a file in it. Every rank
    asks: each machine may have a disk of its own."""
    probe = os.path.join(folder, f".write_test_{os.getpid()}")
    try:  # a file made and removed: os.access is no test, it allows everything to root
        os.makedirs(folder, exist_ok=True)
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY))
        os.remove(probe)
        return True
    except OSError:
        return False


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
