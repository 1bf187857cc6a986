"""What train.py and train_2d.py share around their training loop, whatever the parallelism.

The optimizer (AdamW, weight decay on matrices only, a warm-up + cosine learning rate), the
held-out loss averaged over all ranks, rank 0's tqdm bar with the time per step (on stderr, when it
is a terminal), the summary (tokens/s, MFU), the losses as charts (--chart), the sample, and the
flags. The loop itself is in each training script.

Docs: https://pytorch.org/docs/stable/notes/ddp.html, .../distributed.fsdp.fully_shard.html
"""

import math
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import data
from generate import load_model, sample
from launch import charts
from launch.dist_setup import float_in, int_in, print0
from model import add_model_args

# Dense bf16 peak FLOP/s (NVIDIA's data sheets, without sparsity), for MFU; the first name found in
# the device's name wins, so "H100 PCIe" comes before "H100" and "A100" before "A10".
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "H800": 989e12, "B200": 2250e12}
PEAK_BF16 |= {"A100": 312e12, "A800": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12}


class Progress:
    """Rank 0's tqdm bar over `steps`, the train losses logged, the time per step (from the
    second step on: the first warms up, and compiles). Iterate over it for the steps."""

    def __init__(self, steps, tokens_per_step, args, ctx):
        self.steps, self.tokens_per_step, self.train_losses = steps, tokens_per_step, []
        self.ctx, self.chart, self.val_losses = ctx, args.chart, []
        self.bf16 = use_bf16(args, ctx)
        self.bar = tqdm(
            steps,
            disable=ctx.rank != 0 or (False if args.bar_stdout else None),  # None: on a terminal
            desc="train",
            unit="step",
            dynamic_ncols=True,
            file=sys.stdout if args.bar_stdout else None,
        )
        # A GPU runs ahead of the host: time only what it has finished.
        self.sync = torch.accelerator.synchronize if ctx.device.type != "cpu" else lambda: None

    def __iter__(self):
        self.sync()
        self.t0, t_timed = time.perf_counter(), None
        for step in self.bar:
            if step == self.steps.start + 1:
                self.sync()
                t_timed = time.perf_counter()
            yield step
        self.sync()
        timed = len(self.steps) - 1
        self.step_time = (time.perf_counter() - t_timed) / timed if timed else float("nan")
        self.bar.close()

    def log(self, step, loss, lr):
        self.train_losses.append((step, loss))
        done = (step - self.steps.start + 1) * self.tokens_per_step
        tok_s = f"{done / (time.perf_counter() - self.t0):,.0f}"
        self.bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.1e}", tok_s=tok_s)

    def val(self, step, loss):
        """The held-out loss after `step` steps: printed, and kept for the chart."""
        self.val_losses.append((step, loss))
        self.write(f"step {step}: val loss {loss:.3f}")

    def write(self, line):
        if self.ctx.rank == 0:  # tqdm.write prints on every rank, even with the bar disabled
            self.bar.write(line)

    def print_summary(self, label, val, flops_per_token):
        """Throughput and MFU of the timed steps; the train and val losses, first and last."""
        tok_s = self.tokens_per_step / self.step_time
        device = self.ctx.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        peak = next((f for key, f in PEAK_BF16.items() if key in name), None)
        mfu = (
            f"{flops_per_token * tok_s / self.ctx.world_size / peak:.1%} of {name} bf16 peak"
            if peak
            else f"unknown (no peak FLOP/s known for {name})"
        )
        (_, first), (_, final) = self.train_losses[0], self.train_losses[-1]
        print0(
            f"summary: {label}, {len(self.steps)} steps, {tok_s:,.0f} tokens/s, "
            f"{self.step_time * 1e3:.1f} ms/step, MFU {mfu}, train loss {first:.3f} -> "
            f"{final:.3f}, val loss {val[0]:.3f} -> {val[1]:.3f}, "
            f"bf16 {'on' if self.bf16 else 'off'}"
        )
        if self.ctx.rank == 0 and self.chart:
            self.write_chart(label, val)

    def write_chart(self, label, val):
        """--chart: the train loss logged and the held-out loss, each against the step (after that
        many optimizer steps), as printed (3 decimals)."""
        vals = [(self.steps.start, val[0]), *self.val_losses, (self.steps.stop, val[1])]
        parts = []
        for name, points in (("train loss", self.train_losses), ("val loss", vals)):
            steps, losses = [str(step) for step, _ in points], [loss for _, loss in points]
            lines = {f"{name}, {label}": losses}
            parts.append(charts.xychart(f"{name}, {label}", "step", steps, "loss (nats)", lines))
        charts.write(self.chart, *parts)


def use_bf16(args, ctx):
    """--dtype: bf16 autocast, or float32; auto: bf16 on a GPU that has it."""
    return args.dtype == "bfloat16" or (
        args.dtype == "auto" and ctx.device.type == "cuda" and torch.cuda.is_bf16_supported()
    )


@torch.no_grad()
def evaluate(model, windows, args, ctx):
    """The held-out loss over --eval-batches batches, averaged over the ranks (a collective: each
    rank saw different windows)."""
    model.eval()
    autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=use_bf16(args, ctx))
    total = torch.zeros((), device=ctx.device)
    for i in range(args.eval_batches):
        x, y = windows.batch(i, 0, batch_size=args.batch_size, accum=args.accum)
        with autocast:
            logits = model(data.to_device(x, ctx.device))
        total += F.cross_entropy(
            logits.float().flatten(0, 1), data.to_device(y, ctx.device).flatten()
        )
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    model.train()
    return total.item() / args.eval_batches


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


def check_loss_fell(val_first, val_last):
    if val_last >= val_first:
        raise RuntimeError(f"the validation loss did not fall: {val_first:.3f} -> {val_last:.3f}")


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
    parser.add_argument("--chart", type=charts.path, help="the losses as Mermaid charts (.md)")
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
