"""Train the GPT of model.py on one process, with DDP, or with FSDP2 (--parallel none|ddp|fsdp).

    python transformer_basics/train.py                        # DDP, 2 CPU ranks (or every GPU)
    torchrun --nproc_per_node=2 transformer_basics/train.py --parallel fsdp
    python transformer_basics/train.py --nproc 1 --parallel none
    python transformer_basics/train.py --resume --steps 300   # go on from the checkpoint in --out
    python transformer_basics/train.py --async-save --save-every 2  # checkpoints in the background
    torchrun --nproc_per_node=8 transformer_basics/train.py --gpt2-small --data input.txt

main() reads top to bottom as a training script: the data each rank reads, the model, the
parallelism (the only lines train_2d.py changes), the optimizer, resume, the loop, the
checkpoint. The loop (training.py: accumulation, clipping, bf16 autocast, eval) and the
checkpoints (checkpointing.py: torch.save for none/ddp, torch.distributed.checkpoint for fsdp
and --async-save, atomic, with the RNG state) are shared with train_2d.py.

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/notes/ddp.html, .../distributed.fsdp.fully_shard.html
"""

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import data
import training
from checkpointing import Checkpointer, export_full_model, load_checkpoint
from launch.dist_setup import lesson_parser, print0, run
from model import GPT, config_from_args


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
    ctx.require_writable_dir(out)  # makes it, and checks that this rank can write there
    train_tokens, val_tokens = data.load_tokens(args.data, args.block_size, ctx)
    # Rank r reads the r-th disjoint share of every step's windows (like DistributedSampler).
    train_data = data.ShardedWindows(
        train_tokens, args.block_size, ctx.rank, ctx.world_size, args.seed
    )
    val_data = data.ShardedWindows(val_tokens, args.block_size, ctx.rank, ctx.world_size, args.seed)

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
            # one all-gather per block, freed after use; the last block's backward comes first:
            # it stays gathered
            fully_shard(block, mesh=mesh, reshard_after_forward=i < len(blocks) - 1)
        fully_shard(model, mesh=mesh)  # the rest (embeddings, final norm, head): the root's group
        for i, block in enumerate(blocks):  # gather the next block early: fsdp_overlap.py
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
            block.set_modules_to_backward_prefetch(blocks[i - 1 : i] if i else [])
    # --------------------------------------------------------------------
    optimizer, scheduler = training.make_optimizer(model, args)
    start = load_checkpoint(ckpt, model, optimizer, scheduler, ctx) if args.resume else 0
    resumed = f", resumed at step {start}" if args.resume else ""
    print0(
        f"model: {n_params / 1e6:.2f}M parameters, {cfg}; {args.parallel} on {ctx.world_size} "
        f"rank(s){resumed}"
    )

    # --async-save: a save returns once the state is copied to CPU, written behind the training
    save = Checkpointer(ckpt, model, optimizer, scheduler, ctx, asynchronous=args.async_save)
    result = training.fit(model, optimizer, scheduler, train_data, val_data, start, args, ctx, save)
    save(result.stop, last=True)  # waits for the write in flight; this one is synchronous
    export_full_model(model, cfg, out / "model.pt", ctx.rank)  # a collective: every rank

    if args.parallel == "ddp":
        check_replicas_agree(model)
    training.print_summary(result, f"{args.parallel} x{ctx.world_size}", flops_per_token, ctx)
    print_stalls(save.stalls)
    training.print_sample(out / "model.pt", args, ctx)
    training.check_loss_fell(result)
    print0(
        f"OK: {args.parallel} on {ctx.world_size} rank(s) trained steps {start}..{result.stop - 1},"
        f" val loss {result.val_first:.3f} -> {result.val_last:.3f}; checkpoint {ckpt}, model "
        f"{out / 'model.pt'}"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_replicas_agree(model):
    """DDP's promise: every replica holds the same parameters, to the bit."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if not torch.equal(low, high):
        raise RuntimeError("DDP replicas diverged: parameters differ between ranks")


def print_stalls(stalls):
    """What the saves cost the loop: the time each stopped it, and the CPU copy each staged."""
    ms = {k: [s * 1e3 for _, kind, s, _ in stalls if kind == k] for k in ("sync", "async", "wait")}
    if ms["async"]:
        steps = ", ".join(str(step) for step, kind, _, _ in stalls if kind == "async")
        print0(
            f"checkpoint stall: synchronous save {max(ms['sync']):.1f} ms, asynchronous "
            f"{sum(ms['async']) / len(ms['async']):.1f} ms (mean of steps {steps}) + "
            f"{sum(ms['wait']):.1f} ms in all waiting for a write in flight; staged copy "
            f"{max(n for *_, n in stalls) / 2**20:.2f} MiB of CPU memory per rank until written"
        )


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
