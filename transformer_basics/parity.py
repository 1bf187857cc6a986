"""One GPT, every parallelism, the same loss: a parity table, and the mistakes that break it.

A seed checkpoint of the GPT (and of its mixture-of-experts twin) is written once and loaded by one
process and by each layout of layouts.py: DDP, FSDP2, HSDP, tensor, pipeline (1F1B), context (ring
attention), expert (the MoE GPT) and FSDP x TP parallelism. Each trains the same SGD steps on the
same global batches, its gradient clipped to one global norm. The table: each row's loss, its
largest difference from one process of its model and its tolerance, derived from float64's
rounding (below the divider; float64, so that a bug stands out of the rounding). Dropout in the tp
row only: TP ranks can draw one process's masks, the other layouts draw theirs for other shapes.
--mistake NAME: one of mistakes.py's mistakes, in the parallel layouts; the check names its rows.

    torchrun --nproc_per_node=4 transformer_basics/parity.py
    python transformer_basics/parity.py --nproc 4 --mistake no-data-sharding --chart runs/parity.md

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html, torchtitan's docs/converging.md
"""

import os
from pathlib import Path

import torch
import torch.distributed as dist

import data
import layouts
import mistakes
from checkpointing import make_out_dir
from launch import charts
from launch.dist_setup import float_in, int_in, lesson_parser, print0, run
from model import GPT, GPTConfig
from train_moe import OneProcessMoE, init_moe


def main(args, ctx):
    args.n_layer = args.n_layer or max(4, ctx.world_size)  # the pipeline: a block a stage at least
    require_every_layout_fits(args, ctx)  # the sizes each layout needs, refused up front (below)
    tokens = data.encode(data.generate_corpus(2000))
    make_out_dir(args.out, ctx)
    path = Path(args.out) / "seed.pt"
    if ctx.rank == 0:  # written once: every run below starts from it
        seed = {}
        for kind in ("gpt", "moe"):
            torch.manual_seed(args.seed)  # the twins share the embeddings, attention, norms
            seed[kind] = model_of(kind, args).double().state_dict()
        torch.save(seed, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)  # atomic: never half a checkpoint
    dist.barrier()
    seed = torch.load(path, map_location=ctx.device, weights_only=True)
    losses, alone = {}, dist.new_group([0])  # every rank calls new_group, members or not
    for kind in ("gpt", "gpt+dropout", "moe"):  # the program before it was parallelized
        if ctx.rank == 0:
            one_process = layouts.one_process(load(kind, seed, args, ctx), alone)
            losses[f"one process, {kind}"] = one_process.what, train(one_process, tokens, args, ctx)
    if args.mistake:  # one bug a reader plausibly makes, in the parallel layouts only
        mistakes.make(args.mistake)
    for name, (lay_out, kind) in layouts.LAYOUTS.items():
        layout = lay_out(load(kind, seed, args, ctx), args, ctx)
        losses[name] = layout.what, train(layout, tokens, args, ctx)  # the table says its shape
    check_against_one_process(losses, seed, alone, tokens, args, ctx)


def model_of(kind, args):
    """The GPT ("gpt+dropout": with --dropout), or its MoE twin ("moe"): every MLP --experts
    experts, computed all in this process (train_moe.py's check does the same)."""
    dropout = args.dropout if kind == "gpt+dropout" else 0.0
    sizes = dict(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head)
    model = GPT(GPTConfig(n_embd=args.n_embd, dropout=dropout, **sizes))  # device: load() moves it
    for layer, block in model.blocks.items():
        # Attention's dropout draws a mask per head, and a TP rank holds only its heads: off.
        block.attn.dropout = 0.0
        if kind == "moe":
            experts = init_moe(args, layer)  # router, W1, W2 of every expert
            block.mlp = OneProcessMoE(*experts, 0, args.experts, args.top_k, None)  # device: GPT's
    return model


def load(kind, seed, args, ctx):
    model = model_of(kind, args).to(ctx.device, torch.float64)
    model.load_state_dict(seed["moe" if kind == "moe" else "gpt"])
    return model


def train(layout, tokens, args, ctx):
    """--steps SGD steps on the same global batches; the loss of each (the global batch's mean)."""
    layouts.seed_dropout(args, ctx)
    # foreach=False: tensor parallelism mixes DTensors and plain tensors
    optimizer = torch.optim.SGD(layout.model.parameters(), lr=args.lr, foreach=False)
    windows = layouts.my_windows(tokens, *layout.share, args)
    losses = []
    for step in range(args.steps):
        loss = layouts.forward_backward(layout, windows, step, args, ctx.device)
        layouts.clip_grad_norm(layout, args.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
    return torch.stack(losses)


# ---- The lesson ends here. What follows is how it checks itself. ----


def require_every_layout_fits(args, ctx):
    """The world sizes and flags every layout can take, refused in one line before any work."""
    n, m, T = ctx.world_size, args.microbatches, args.block_size
    ctx.require(args.n_embd % args.n_head == 0, "--n-embd must be a multiple of --n-head")
    ctx.require(
        args.batch % (n * m) == 0,
        f"--batch {args.batch} must divide into {n} ranks x --microbatches {m}: use a multiple "
        f"of {n * m}",
    )
    ctx.require(args.n_head % n == 0, f"tp: --n-head {args.n_head} must be a multiple of {n} ranks")
    ctx.require(args.n_layer >= n, f"pp: --n-layer {args.n_layer} is fewer than the {n} stages")
    ctx.require(T % (2 * n) == 0, f"cp: --block-size {T} must be a multiple of 2 x {n} ranks")
    ctx.require(
        args.experts % (2 if n % 2 == 0 else 1) == 0, f"ep: --experts {args.experts} must be even"
    )
    ctx.require(args.top_k <= args.experts, f"--top-k {args.top_k} is more than --experts")
    # pipeline and ring send to neighbours: Gloo does CPU tensors only (docs: #backends)
    ctx.require(
        ctx.backend != "gloo" or ctx.device.type == "cpu",
        "point-to-point on gloo needs CPU tensors: use --backend nccl or --device cpu",
    )
    problem = data.check_tokens(data.encode(data.generate_corpus(2000)), T, None)
    ctx.require(problem is None, str(problem))


def tolerance(ranks, reference, args):
    """How far a row may differ from one process: 8 x steps x (B*T + 4*C + ranks) x eps x the
    loss. A sum of n terms taken in another order differs by at most about n x eps of the sum of
    their sizes (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., 4.2). The longest
    sums here: the loss and every weight's gradient, over the global batch's B*T tokens, each rank
    adding its share; the MLP's matmuls, over 4*C; the ranks' partial sums, one per rank. A few
    of them chained (8x, as train_cp.py), each step's error carried into the next (x steps)."""
    n = args.batch * args.block_size + 4 * args.n_embd + ranks
    return 8 * args.steps * n * torch.finfo(torch.float64).eps * max(reference)


CONTROL = "control, f32 grads"  # one process, its gradients rounded to float32 at every step


def check_against_one_process(losses, seed, alone, tokens, args, ctx):
    """Each row against one process of its model: its largest difference over the steps must be
    within its tolerance. The control must not be: else this comparison could not see a real
    difference (a check that compares a row with itself, or a table that repeats one row)."""
    verdict, norms = [None], []
    if ctx.rank == 0:
        model = load("gpt", seed, args, ctx)

        def round_to_float32():  # and the norm of each step's gradient, before the clip
            for p in model.parameters():
                p.grad.copy_(p.grad.float())
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            norms.append(torch.linalg.vector_norm(grads).item())

        control = layouts.Layout("1 process", model, alone, sync=round_to_float32)
        losses[CONTROL] = control.what, train(control, tokens, args, ctx)
        verdict = [print_table(losses, args, ctx)]
        clipped = sum(norm > args.grad_clip for norm in norms) if args.grad_clip else 0
        print0(
            f"clip: the gradient's global norm at steps 0..{args.steps - 1} "
            f"{' '.join(f'{norm:.2f}' for norm in norms)}; --grad-clip {args.grad_clip:g} acted "
            f"at {clipped} of {args.steps} steps"
        )
    dist.broadcast_object_list(verdict, src=0)  # the same verdict on every rank
    if verdict[0]:
        print0(verdict[0])
        raise SystemExit(1)
    print0(
        f"OK: {len(layouts.LAYOUTS)} layouts on {ctx.world_size} rank(s) trained {args.steps} "
        "steps as one process does: every loss within its tolerance, the control beyond its own"
    )


def print_table(losses, args, ctx):
    """The table (rank 0); returns the failure line, or None."""
    kinds = {name: kind for name, (_, kind) in layouts.LAYOUTS.items()} | {CONTROL: "gpt"}
    kinds |= {f"one process, {kind}": kind for kind in ("gpt", "gpt+dropout", "moe")}
    shown = sorted({0, args.steps // 2, args.steps - 1})
    print0(
        f"{'row':<26}{'layout':<24}{'model':<13}" + "".join(f"{f'step {s}':<16}" for s in shown)
        + f"{'max |diff|':<12}tolerance"
    )  # fmt: skip
    diverged, within = [], []
    for name, (what, got) in losses.items():
        row = f"{name:<26}{what:<24}{kinds[name]:<13}"
        row += "".join(f"{got[s].item():<16.12f}" for s in shown)
        if not name.startswith("one process"):
            ref = losses[f"one process, {kinds[name]}"][1]
            diff = (got - ref).abs().max().item()
            tol = tolerance(1 if name == CONTROL else ctx.world_size, ref.tolist(), args)
            (within if diff <= tol else diverged).append(name)
            verdict = "ok" if diff <= tol else "DIVERGED"
            if name == CONTROL:  # it must diverge
                verdict = "diverged, as it must" if diff > tol else "WITHIN (must not be)"
            row += f"{diff:<12.1e}{tol:<11.1e}{verdict}"
        print0(row.rstrip())  # the one-process rows end at their losses
    ref = losses["one process, gpt"][1].tolist()
    print0(
        f"tolerance: 8 x {args.steps} steps x ({args.batch} x {args.block_size} tokens + 4 x "
        f"{args.n_embd} + ranks) x eps {torch.finfo(torch.float64).eps:.1e} (float64) x loss "
        f"{max(ref):.2f} = {tolerance(ctx.world_size, ref, args):.1e} at {ctx.world_size} rank(s)"
    )
    if args.chart:
        steps = [str(s) for s in range(args.steps)]
        lines = {name: got.tolist() for name, (_, got) in losses.items()}
        title = f"parity.py, {ctx.world_size} rank(s), " + (args.mistake or "no mistake")
        charts.write(args.chart, charts.xychart(title, "step", steps, "loss", lines, 4))
        print0(f"chart: {args.chart}")
    if CONTROL in within:
        return f"FAILED: the control ({CONTROL}) is within its tolerance: nothing is compared"
    diverged.remove(CONTROL)
    if diverged:
        names = ", ".join(diverged)
        return f"FAILED: {len(diverged)} row(s) beyond their tolerance of one process: {names}"
    return None


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    add = parser.add_argument
    add("--mistake", choices=list(mistakes.MISTAKES), help="one mistake (mistakes.py says each)")
    add("--chart", type=charts.path, help="write the loss per step of every row there (Mermaid)")
    add("--out", default="runs/parity", help="the seed checkpoint, seed.pt, goes here")
    for flag, kind, default, what in [
        ("--steps", int_in(2, 1000), 4, "SGD steps of every row (step 0's loss: before any)"),
        ("--batch", int_in(1, 65_536), 16, "windows per step, the global batch of every row"),
        ("--microbatches", int_in(1, 1024), 2, "per step and rank (the pipeline: >= its stages)"),
        ("--lr", float_in(0, 10, low_open=True), 0.5, "SGD's learning rate"),
        ("--grad-clip", float_in(0, 1e6), 0.5, "the global norm's limit (0: no clipping)"),
        ("--dropout", float_in(0, 0.9), 0.1, "of the tp row and its one process"),
        ("--seed", int_in(0, 2**31 - 1), 0, "the seed checkpoint, the data order, dropout"),
        ("--n-layer", int_in(1, 256), None, "blocks (default: 4, or one a pipeline stage)"),
        ("--n-head", int_in(1, 1024), 8, "heads (tp: a multiple of the ranks)"),
        ("--n-embd", int_in(1, 65_536), 32, "width, a multiple of --n-head"),
        ("--block-size", int_in(1, 1_048_576), 16, "context (cp: a multiple of 2 x ranks)"),
        ("--experts", int_in(1, 4096), 8, "per MoE layer (ep: even on an even world size)"),
        ("--top-k", int_in(1, 64), 2, "experts per token"),
        ("--hidden", int_in(1, 65_536), 64, "an expert's width"),
    ]:
        add(flag, type=kind, default=default, help=what)
    args = parser.parse_args()
    if args.mistake:  # its settings become the defaults: a flag given still wins
        parser.set_defaults(**mistakes.MISTAKES[args.mistake].settings)
        args = parser.parse_args()
    run(main, args)
