"""Pipeline parallelism: the GPT's blocks split into stages, one stage per rank.

Rank 0 holds the embeddings and the first blocks, the last rank the last blocks, the final
norm and the head; activations flow forward with send/recv, gradients flow back. A batch is
cut into micro-batches so that stages work at the same time; the schedule says in which
order each stage runs forward (F) and backward (B) of each micro-batch:
  GPipe   all F, then all B: simple, holds the activations of every micro-batch;
  1F1B    after a warm-up, one F then one B: the same bubble, at most p micro-batches held.
Either way a stage idles (p-1) of (m+p-1) time slots (p stages, m micro-batches): the
bubble, printed below. The check: each step's loss and the updated parameters equal
single-process training of the whole model on the whole batch. One rank is a pipeline of one
stage (no bubble); the 8 blocks split over up to 8 ranks. The schedules post their own
sends and receives, mixed ones grouped in dist.batch_isend_irecv so that NCCL cannot
deadlock (torch 2.13, torch/distributed/pipelining/schedules.py, _batch_p2p); Gloo sends
CPU tensors only, so Gloo with CUDA tensors is refused up front.

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

    torchrun --nproc_per_node=2 transformer_basics/pipeline_parallel.py
    python transformer_basics/pipeline_parallel.py --nproc 4 --schedule 1f1b --microbatches 8

Docs: https://pytorch.org/docs/stable/distributed.pipelining.html
"""

import copy
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.profiler import ProfilerActivity, profile

import data
from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run
from model import GPT, config_from_args


def cut_stage(model, stage, stages):
    """Keep stage number `stage` (of `stages`) of the model: the layers are shared out as evenly as
    possible. Deleting (not re-wrapping) keeps parameter names, so they match the whole model's.
    (One stage a rank here, so stage is the rank; pipeline_schedules.py gives a rank two.)"""
    n = model.cfg.n_layer
    mine = range(stage * n // stages, (stage + 1) * n // stages)
    for name in list(model.blocks.keys()):
        if int(name) not in mine:
            del model.blocks[name]
    if stage != 0:
        model.wte = model.wpe = None  # forward() then takes hidden states
    if stage != stages - 1:
        model.ln_f = model.lm_head = None  # forward() then returns hidden states
    return model


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main(args, ctx):
    p, m, rank = ctx.world_size, args.microbatches, ctx.rank
    # stages exchange activations and gradients with send/recv, which Gloo does on CPU tensors
    # only (docs: distributed.html#backends)
    ctx.require(
        ctx.backend != "gloo" or ctx.device.type == "cpu",
        "point-to-point on gloo needs CPU tensors: use --backend nccl or --device cpu",
    )
    ctx.require(
        args.n_layer >= p,
        f"--n-layer {args.n_layer} is fewer than the {p} stages: each stage needs a block",
    )
    ctx.require(
        args.batch_size % m == 0,
        f"--batch-size {args.batch_size} must be a multiple of --microbatches {m}",
    )
    ctx.require(
        args.schedule != "1f1b" or m >= p,
        f"1F1B needs at least as many micro-batches as stages: --microbatches {m} < {p}",
    )
    ctx.require(args.n_embd % args.n_head == 0, "--n-embd must be a multiple of --n-head")
    tokens = data.encode(data.generate_corpus(2000))
    ctx.require(not (problem := data.check_tokens(tokens, args.block_size, None)), str(problem))
    torch.manual_seed(args.seed)
    reference = GPT(config_from_args(args)).to(ctx.device)  # the whole model, for the check
    stage_model = cut_stage(copy.deepcopy(reference), rank, p)
    held = [name for name, module in stage_model.named_children() if module is not None]
    print_in_order(f"stage {rank}: {', '.join(held)} (blocks {', '.join(stage_model.blocks)})")

    stage = PipelineStage(stage_model, rank, p, ctx.device)
    schedule_class = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    # The schedule splits the batch into m micro-batches and scales each loss by 1/m, so the
    # gradients are those of the mean loss over the whole batch.
    schedule = schedule_class(stage, n_microbatches=m, loss_fn=loss_fn)
    # Weight tying across stages: the embedding (first stage) and the head (last stage) are one
    # matrix in the whole model; here they are two copies, kept equal by summing their gradients.
    # (One stage holds both ends: the tie is real there, nothing to sum.)
    tie_group = dist.new_group(sorted({0, p - 1}))  # every rank calls new_group, members or not
    tied = {0: stage_model.wte, p - 1: stage_model.lm_head}.get(rank) if p > 1 else None

    opt = torch.optim.SGD(stage_model.parameters(), lr=args.lr)  # SGD: see tensor_parallel.py
    ref_opt = torch.optim.SGD(reference.parameters(), lr=args.lr)
    windows = data.ShardedWindows(tokens, args.block_size, 0, 1, args.seed)
    worst = []
    for step in range(args.steps):
        # the last step runs under torch.profiler, to count its sends (printed below)
        last = step == args.steps - 1
        with profile(activities=[ProfilerActivity.CPU]) if last else nullcontext() as prof:
            x, y = (t.to(ctx.device) for t in windows.batch(step, 0, args.batch_size))
            losses = []  # filled on the last stage, one per micro-batch
            if p == 1:
                schedule.step(x, target=y, losses=losses)  # one stage: both ends of the pipeline
            elif rank == 0:
                schedule.step(x)  # the first stage feeds the inputs...
            elif rank == p - 1:
                schedule.step(target=y, losses=losses)  # ...the last one the targets
            else:
                schedule.step()
            if tied is not None:
                dist.all_reduce(tied.weight.grad, group=tie_group)
            opt.step()
            opt.zero_grad()
            worst.append(check_step(step, x, y, losses, stage_model, reference, ref_opt, args, ctx))
    print_traffic_and_memory(prof, stage_model, args)
    print_bubble_and_ok(worst, args, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


def print_bubble_and_ok(worst, args, ctx):
    p, m = ctx.world_size, args.microbatches
    worst_loss, worst_param = map(max, zip(*worst))
    worst_param = torch.tensor(worst_param, device=ctx.device)
    dist.all_reduce(worst_param, op=dist.ReduceOp.MAX)
    bubble = (p - 1) / (m + p - 1)
    print0(
        f"bubble: (p-1)/(m+p-1) = {p - 1}/{m + p - 1} = {bubble:.0%} of each stage's time idle "
        f"({p} stages, {m} micro-batches)"
    )
    print0(
        f"OK: {args.schedule} pipeline of {p} stages x {m} micro-batches: losses and parameters "
        f"of {args.steps} steps equal single-process training (max diff {worst_loss:.1e} loss, "
        f"{worst_param.item():.1e} parameters)"
    )


def print_traffic_and_memory(prof, stage_model, args):
    """What each stage holds and sends: its parameters' bytes, and the c10d ops of the last step
    (the first step also sends the shapes of the activations: 3 more sends and receives at 2
    stages, measured)."""
    names = [event.name for event in prof.events()]
    per_step = {op: names.count(f"c10d::{op}") for op in ("send", "recv_", "allreduce_")}
    held = sum(t.numel() * t.element_size() for t in stage_model.parameters())
    print_in_order(
        f"parameters {held:,} B; last step {per_step['send']} send, {per_step['recv_']} recv "
        f"(activations and their gradients, {args.microbatches} micro-batches), "
        f"{per_step['allreduce_']} all_reduce (the tied embedding)"
    )


def check_step(step, x, y, losses, stage_model, reference, ref_opt, args, ctx):
    """The same step of the whole model in this process: its loss must equal the pipeline's, and
    this stage's parameters the whole model's. Returns (loss difference, largest parameter
    difference)."""
    ref_loss = loss_fn(reference(x), y)
    ref_loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    last = ctx.world_size - 1
    loss = torch.stack(losses).mean() if ctx.rank == last else torch.zeros((), device=ctx.device)
    dist.broadcast(loss, src=last)  # the loss is known on the last stage only
    loss_diff = abs(loss.item() - ref_loss.item())
    if loss_diff > args.tol:
        raise RuntimeError(
            f"step {step}: the pipeline's loss differs from single-process training by "
            f"{loss_diff:.2e}"
        )
    ref_params = dict(reference.named_parameters(remove_duplicate=False))  # lm_head.weight too
    worst = 0.0
    for name, param in stage_model.named_parameters():
        worst = max(worst, (param - ref_params[name]).abs().max().item())
        if worst > args.tol:
            raise RuntimeError(
                f"step {step}: stage {ctx.rank}'s {name} differs from single-process training by "
                f"{worst:.2e}"
            )
    print0(f"step {step}: loss {loss.item():.4f} (single process {ref_loss.item():.4f})")
    return loss_diff, worst


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    parser.add_argument("--microbatches", type=int_in(1, 1024), default=4)
    parser.add_argument("--steps", type=int_in(1, 10_000), default=3)
    parser.add_argument("--batch-size", type=int_in(1, 4096), default=8)
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.2)
    parser.add_argument(
        "--tol", type=float_in(0, 1), default=2e-5, help="largest difference accepted (float32)"
    )
    parser.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0)
    # the GPT of model.py (8 blocks: up to 8 stages)
    parser.add_argument("--n-layer", type=int_in(1, 256), default=8)
    parser.add_argument("--n-head", type=int_in(1, 1024), default=4)
    parser.add_argument("--n-embd", type=int_in(1, 65_536), default=64)
    parser.add_argument(
        "--block-size", type=int_in(1, 1_048_576), default=32, help="context length"
    )
    parser.add_argument("--dropout", type=float_in(0, 0.9), default=0.0)
    run(main, parser.parse_args())
