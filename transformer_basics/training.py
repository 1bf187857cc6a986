"""The training loop that train.py and train_2d.py share, whatever the parallelism.

A step: `accum` micro-batches per rank, gradients synchronised on the last one only
(`gradient_sync`), then gradient clipping, AdamW (weight decay on matrices only) and a warm-up
+ cosine learning rate; bf16 autocast on a GPU that has it. Rank 0 shows a tqdm bar; every
--eval-every steps the held-out loss is averaged over all ranks.

Docs: https://pytorch.org/docs/stable/notes/ddp.html, .../distributed.fsdp.fully_shard.html
"""

import contextlib
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import data
from generate import load_model, sample
from launch.dist_setup import float_in, int_in, print0
from model import add_model_args

# Dense bf16 peak FLOP/s (NVIDIA's data sheets, without sparsity), for MFU; the first name found in
# the device's name wins, so "H100 PCIe" comes before "H100" and "A100" before "A10".
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "H800": 989e12, "B200": 2250e12}
PEAK_BF16 |= {"A100": 312e12, "A800": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12}


@dataclass
class Result:
    start: int
    stop: int  # the first step not trained
    tokens_per_step: int
    train_losses: list  # (step, loss averaged over ranks), every --log-every steps
    val_first: float
    val_last: float
    step_time: float  # seconds, from the second step on
    bf16: bool


def fit(model, optimizer, scheduler, train_data, val_data, start, args, ctx, save, clip=None):
    """Train steps start..stop-1 (stop: --steps, or sooner with --stop-after); save(step) every
    --save-every steps. clip(model, max_norm) clips the gradients (default: clip_grad_norm_)."""
    ctx.require(
        start < args.steps,
        f"--resume: the checkpoint is at step {start}, nothing left of --steps {args.steps}",
    )
    clip = clip or (lambda m, max_norm: torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm))
    stop = min(args.steps, start + args.stop_after) if args.stop_after else args.steps
    bf16 = args.dtype == "bfloat16" or (
        args.dtype == "auto" and ctx.device.type == "cuda" and torch.cuda.is_bf16_supported()
    )
    autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=bf16)
    tokens_per_step = args.batch_size * args.accum * args.block_size * train_data.world_size
    # A GPU runs ahead of the host: time only what it has finished.
    synchronize = torch.accelerator.synchronize if ctx.device.type != "cpu" else lambda: None

    def loss_of(windows, step, micro):
        batch = windows.batch(step, micro, args.batch_size, args.accum)
        x, y = (data.to_device(t, ctx.device) for t in batch)
        with autocast:
            logits = model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    @torch.no_grad()
    def evaluate():
        model.eval()
        total = torch.zeros((), device=ctx.device)
        for i in range(args.eval_batches):
            total += loss_of(val_data, i, 0)
        if dist.is_initialized():
            dist.all_reduce(total, op=dist.ReduceOp.AVG)  # each rank saw different windows
        model.train()
        return total.item() / args.eval_batches

    val_first, train_losses = evaluate(), []
    bar = tqdm(
        range(start, stop),
        disable=ctx.rank != 0,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        file=sys.stdout if args.bar_stdout else None,
    )
    synchronize()
    t0, t_timed = time.perf_counter(), None
    for step in bar:
        if step == start + 1:  # time from the second step on: the first one warms up (and compiles)
            synchronize()
            t_timed = time.perf_counter()
        loss_sum = torch.zeros((), device=ctx.device)
        for micro in range(args.accum):
            # ranks average their gradients on the last micro-batch only
            with gradient_sync(model, micro == args.accum - 1):
                loss = loss_of(train_data, step, micro) / args.accum
                loss.backward()
            loss_sum += loss.detach()  # stays on the device: no host sync per step
        clip(model, args.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == stop - 1:  # the only host syncs: when logging
            if dist.is_initialized():
                dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
            train_losses.append((step, loss_sum.item()))
            bar.set_postfix(
                loss=f"{train_losses[-1][1]:.3f}",
                lr=f"{scheduler.get_last_lr()[0]:.1e}",
                tok_s=f"{(step - start + 1) * tokens_per_step / (time.perf_counter() - t0):,.0f}",
            )
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < stop:
            save(step + 1)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < stop:
            val = evaluate()  # a collective: every rank evaluates, rank 0 writes
            if ctx.rank == 0:
                bar.write(f"step {step + 1}: val loss {val:.3f}")
    synchronize()
    timed = stop - start - 1
    step_time = (time.perf_counter() - t_timed) / timed if timed else float("nan")
    bar.close()
    return Result(
        start, stop, tokens_per_step, train_losses, val_first, evaluate(), step_time, bf16
    )


@contextlib.contextmanager
def gradient_sync(model, sync):
    """With sync False, backward accumulates gradients locally: DDP skips its all_reduce
    (no_sync), FSDP2 its reduce-scatter (set_requires_gradient_sync)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
    with model.no_sync() if isinstance(model, DDP) and not sync else contextlib.nullcontext():
        yield


def make_optimizer(model, args):
    """AdamW with weight decay on matrices (Linear weights, embeddings) only, never on biases and
    norms; a linear warm-up to --lr, then a cosine down to --min-lr at the last step."""
    params = [p for p in model.parameters() if p.requires_grad]  # a tied weight comes once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # fused: one kernel updates every parameter (CUDA, and CPU since torch 2.4), no Python loop
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=True)

    def lr_factor(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        floor = args.min_lr / args.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def print_summary(result, label, flops_per_token, ctx):
    tok_s = result.tokens_per_step / result.step_time
    name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    peak = next((f for key, f in PEAK_BF16.items() if key in name), None)
    mfu = (
        f"{flops_per_token * tok_s / ctx.world_size / peak:.1%} of {name} bf16 peak"
        if peak
        else f"unknown (no peak FLOP/s known for {name})"
    )
    (_, first), (_, final) = result.train_losses[0], result.train_losses[-1]
    print0(
        f"summary: {label}, {result.stop - result.start} steps, {tok_s:,.0f} tokens/s, "
        f"{result.step_time * 1e3:.1f} ms/step, MFU {mfu}, train loss {first:.3f} -> {final:.3f}, "
        f"val loss {result.val_first:.3f} -> {result.val_last:.3f}, "
        f"bf16 {'on' if result.bf16 else 'off'}"
    )


def check_loss_fell(result):
    if result.val_last >= result.val_first:
        raise RuntimeError(
            f"the validation loss did not fall: {result.val_first:.3f} -> {result.val_last:.3f}"
        )


def print_sample(path, args, ctx):
    """The exported model, in this process alone (as generate.py does)."""
    if ctx.rank == 0 and args.sample_tokens:
        text = sample(load_model(path, ctx.device), "the ", args.sample_tokens)
        print("sample:\n  " + text.replace("\n", "\n  "))


def parse_args(parser, argv, out, **model_defaults):
    """The flags train.py and train_2d.py share, added to parser; then parse argv. Each number has
    its range (launch/argtypes.py); --data is checked by data.load_tokens (one line per rank)."""
    parser.add_argument("--data", help="a UTF-8 text file (default: the corpus data.py makes)")
    parser.add_argument("--out", default=out, help="checkpoints and model.pt go here")
    parser.add_argument("--resume", action="store_true", help="go on from the checkpoint in --out")
    count, every = int_in(1, 1_000_000), int_in(0, 1_000_000)
    for flag, kind, default, what in [
        ("--steps", count, 250, "optimizer steps in all (sets the LR schedule)"),
        ("--stop-after", every, 0, "stop after N steps, as if interrupted (0: at --steps)"),
        ("--batch-size", int_in(1, 4096), 16, "windows per micro-batch per rank"),
        ("--accum", int_in(1, 1024), 1, "micro-batches per step (gradient accumulation)"),
        ("--lr", float_in(0, 10, low_open=True), 3e-3, "peak learning rate"),
        ("--min-lr", float_in(0, 10), 3e-4, "learning rate at the last step (at most --lr)"),
        ("--weight-decay", float_in(0, 10), 0.1, "AdamW's, on matrices only"),
        ("--grad-clip", float_in(0, 1e6, low_open=True), 1.0, "largest gradient norm"),
        ("--warmup", every, 10, "steps of linear warm-up (0: none)"),
        ("--eval-every", every, 50, "held-out loss every N steps (0: at the end only)"),
        ("--eval-batches", int_in(1, 10_000), 4, "batches per held-out loss"),
        ("--log-every", count, 10, "train loss every N steps (a host sync)"),
        ("--save-every", every, 0, "also checkpoint every N steps (0: at the end only)"),
        ("--sample-tokens", int_in(0, 100_000), 200, "tokens to sample at the end (0: none)"),
        ("--seed", int_in(0, 2**32 - 1), 0, "data order and initial model"),
    ]:
        parser.add_argument(flag, type=kind, default=default, help=what)
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="autocast dtype; auto: bf16 on a GPU that has it, else float32",
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--bar-stdout", action="store_true", help="tqdm bar on stdout, not stderr")
    parser.add_argument(
        "--gpt2-small",
        action="store_true",
        help="GPT-2 small: 12 layers, 12 heads, 768 wide, 1024 context, batch 8 x accum 8, lr 6e-4",
    )
    add_model_args(parser, **model_defaults)
    args = parser.parse_args(argv)
    if args.gpt2_small:
        args.n_layer, args.n_head, args.n_embd, args.block_size = 12, 12, 768, 1024
        args.batch_size, args.accum, args.lr, args.min_lr, args.warmup = 8, 8, 6e-4, 6e-5, 100
    return args


def check_args(args, ctx):
    """What the flags' ranges cannot say alone: the constraints between flags."""
    ctx.require(
        args.steps > args.warmup, f"--steps {args.steps} must be larger than --warmup {args.warmup}"
    )
    ctx.require(args.min_lr <= args.lr, f"--min-lr {args.min_lr:g} is above --lr {args.lr:g}")
    ctx.require(
        args.n_embd % args.n_head == 0,
        f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}",
    )
