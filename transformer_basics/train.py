"""Train the GPT of model.py on one process, with DDP, or with FSDP2 (--parallel none|ddp|fsdp).

    torchrun --nproc_per_node=2 transformer_basics/train.py                  # DDP, 2 ranks
    torchrun --nproc_per_node=2 transformer_basics/train.py --parallel fsdp
    torchrun --nproc_per_node=2 transformer_basics/train.py --resume --steps 300  # from --out
    torchrun --nproc_per_node=2 transformer_basics/train.py --async-save --save-every 2
    torchrun --nproc_per_node=8 transformer_basics/train.py --gpt2-small --data input.txt
    python transformer_basics/train.py --nproc 1 --parallel none

main() reads as a training script, top to bottom: the data each rank reads, the model, the
parallelism (the lines train_2d.py changes), the optimizer, resume, then the loop (micro-batches,
gradient sync, clipping, step, evaluation, checkpoints) inline, as in nanoGPT's train.py.
training.py: optimizer, evaluation, progress bar, flags; checkpointing.py: torch.save (none,
ddp), torch.distributed.checkpoint (fsdp, --async-save: in the background), atomic, with RNG.

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/notes/ddp.html, .../distributed.fsdp.fully_shard.html
"""

import os
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import data
import training
from checkpointing import Checkpointer, export_full_model, load_checkpoint
from launch.dist_setup import lesson_parser, print0, run
from model import GPT, config_from_args
from train_checks import CheckedSaves, check_replicas_agree, check_resumed, print_stalls


def main(args, ctx):
    ctx.require(
        args.parallel != "none" or ctx.world_size == 1,
        f"--parallel none trains one process, not {ctx.world_size}: use --nproc 1 or another one",
    )
    training.check_args(args, ctx)
    out = Path(args.out)
    ckpt = out / ("checkpoint" if args.parallel == "fsdp" or args.async_save else "checkpoint.pt")
    ctx.require(not args.resume or ckpt.exists(), f"--resume: no checkpoint at {ckpt}")
    ctx.require(args.save_every or not args.async_save, "--async-save needs --save-every N > 0")
    train_tokens, val_tokens = data.load_tokens(args.data, args.block_size, ctx)
    # made here, after the refusals: a refused run writes nothing
    ctx.require(can_write_in(out), f"cannot write to {out}: pass another --out")
    # Rank r reads the r-th disjoint share of every step's windows (like DistributedSampler).
    shard = dict(rank=ctx.rank, world_size=ctx.world_size, seed=args.seed)
    train_data = data.ShardedWindows(train_tokens, args.block_size, **shard)
    val_data = data.ShardedWindows(val_tokens, args.block_size, **shard)

    torch.manual_seed(args.seed)  # the same initial model on every rank (DDP broadcasts rank 0's)
    cfg = config_from_args(args)
    model = GPT(cfg, activation_checkpointing=args.activation_checkpointing).to(ctx.device)
    n_params, flops_per_token = model.num_params(), model.flops_per_token()
    if args.compile:
        model.compile()  # in place: parameter names (and so checkpoints) stay the same
    # ---- the parallelism: these lines are what train_2d.py changes ----
    if args.parallel == "ddp":
        # .grad as views into the buckets: benchmark.py's ddp+, ddp_basics/ddp_overlap.py
        device_ids = None if ctx.device.type == "cpu" else [ctx.device]
        model = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
    elif args.parallel == "fsdp":
        # a mesh of ctx.device's type: FSDP2 would pick the GPU even on CPU + Gloo
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        blocks = list(model.blocks.values())
        for i, block in enumerate(blocks):
            # one all-gather per block, freed after use; not the last: its backward comes first
            fully_shard(block, mesh=mesh, reshard_after_forward=i < len(blocks) - 1)
        fully_shard(model, mesh=mesh)  # the rest (embeddings, final norm, head): the root's group
        for i, block in enumerate(blocks):  # gather the next block early: fsdp_overlap.py
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
            block.set_modules_to_backward_prefetch(blocks[i - 1 : i] if i else [])
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
    print0(
        f"model: {n_params / 1e6:.2f}M parameters, {cfg}; {args.parallel} on {ctx.world_size} "
        f"rank(s){resumed}"
    )
    # --async-save: a save returns once the state is copied to CPU, written behind the training
    save = Checkpointer(ckpt, stateful, ctx, asynchronous=args.async_save)
    if args.async_save:  # the check: the first asynchronous checkpoint, read back once written
        save = CheckedSaves(save)
    bf16 = training.use_bf16(args, ctx)  # weights, gradients and AdamW stay float32
    autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=bf16)

    def evaluate():  # a collective: every rank evaluates its share of the held-out windows
        return training.evaluate(model, val_data, args=args, ctx=ctx)

    val_first = evaluate()
    tokens = args.batch_size * args.accum * args.block_size * ctx.world_size  # per step
    progress = training.Progress(range(start, stop), tokens_per_step=tokens, args=args, ctx=ctx)
    for step in progress:  # rank 0 shows a bar
        loss_sum = torch.zeros((), device=ctx.device)
        for micro in range(args.accum):
            x, y = train_data.batch(step, micro, batch_size=args.batch_size, accum=args.accum)
            x, y = data.to_device(x, ctx.device), data.to_device(y, ctx.device)
            # Backward syncs the gradients on the last micro-batch only; before, each rank adds
            # them up locally: DDP skips its all_reduce, FSDP its reduce-scatter.
            last = micro == args.accum - 1
            if args.parallel == "fsdp":
                model.set_requires_gradient_sync(last)
            with model.no_sync() if args.parallel == "ddp" and not last else nullcontext():
                with autocast:
                    logits = model(x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / args.accum
                loss.backward()
            loss_sum += loss.detach()  # stays on the device: no host sync per step
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
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
    save(stop, last=True)  # waits for the write in flight; this one is synchronous
    export_full_model(model, cfg, out / "model.pt")  # a collective: every rank

    if args.parallel == "ddp":
        check_replicas_agree(model)
    label = f"{args.parallel} x{ctx.world_size}"
    progress.print_summary(label, (val_first, val_last), flops_per_token)
    print_stalls(save.stalls)
    training.print_sample(out / "model.pt", args, ctx)
    training.check_loss_fell(val_first, val_last)
    print0(
        f"OK: {args.parallel} on {ctx.world_size} rank(s) trained steps {start}..{stop - 1}, "
        f"val loss {val_first:.3f} -> {val_last:.3f}; checkpoint {ckpt}, model {out / 'model.pt'}"
    )


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
    parser.add_argument("--parallel", choices=["none", "ddp", "fsdp"], default="ddp")
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each block's activations in backward: less memory, one more forward",
    )
    parser.add_argument(
        "--async-save",
        action="store_true",
        help="write checkpoints (DCP) in a background thread, training goes on (the last: not)",
    )
    return training.parse_args(parser, argv, out="runs/gpt")


if __name__ == "__main__":
    run(main, parse_args())
