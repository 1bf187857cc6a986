"""A measuring tool (not a lesson): tokens/s, step time, memory and collectives per rank of one GPT
trained six ways on the same ranks; the ways themselves are taught in train.py and tensor_parallel.py.

  none   every rank trains its own copy, no communication: the ceiling for data parallel
  ddp    DistributedDataParallel: replicas, gradients all_reduced during backward
  ddp+   the same, tuned (ddp_basics/ddp_overlap.py): gradient_as_bucket_view, buckets as by default
  fsdp   fully_shard per block: parameters, gradients and AdamW state sharded 1/N
  fsdp+  the same, tuned for overlap (fsdp_basics/fsdp_overlap.py): the last block kept unsharded
         after forward, explicit prefetch of the next block in forward and backward
  tp     tensor parallel over all ranks (tensor_parallel.py): each rank holds 1/N of every
         block's matrices and processes the whole global batch
Every mode takes the same global batch per step (batch-size windows per rank), so tokens/s
compare directly. The modes are timed in turns, one step each, so that other work on the
machine slows them alike; a step time is the median over steps of the slowest rank. "state" is what each rank holds of parameters + gradients + AdamW moments
(counted from the local tensors); on a GPU the peak allocated memory is measured too.
"collectives": what one rank issued in its last warm-up step (past DDP's bucket rebuild and its 2
broadcasts in step 2), counted from torch.profiler's record of the c10d ops (c10d::allreduce_, ...:
ProcessGroup.hpp dispatches every collective through them, torch 2.13). Then the step-time ratios
issue 18 set goals for: ddp <= 1.05x none, fsdp <= 1.10x ddp.
The check: ddp, ddp+, fsdp, fsdp+ and tp train one model on one global batch, so their losses must agree.

    torchrun --nproc_per_node=2 transformer_basics/benchmark.py
    torchrun --nproc_per_node=8 transformer_basics/benchmark.py --n-layer 12 --n-head 16 --n-embd 768 --block-size 1024

Timings on a CPU shared with other work are noisy; compare modes within one run.
Docs: https://pytorch.org/docs/stable/distributed.html
"""

import collections
import contextlib
import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

import data
from launch.dist_setup import lesson_parser, print0, run, test_flags
from model import GPT, add_model_args, config_from_args
from tensor_parallel import apply_tensor_parallel

MODES = ["none", "ddp", "ddp+", "fsdp", "fsdp+", "tp"]
# part of a c10d op's name (c10d::allreduce_, c10d::_allgather_base_, ...) -> the collective it is
KINDS = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "broadcast": "broadcast",
    "alltoall": "all_to_all",
}


def build(mode, base, ctx, args):
    model = copy.deepcopy(base)
    if mode.startswith("ddp"):
        # ddp+: the .grads are views into the buckets, no copy out of them (DDP's docstring); not static_graph:
        # it breaks no_sync, which train.py's accumulation needs (pytorch/pytorch#143580, still in torch 2.13)
        tuned = dict(gradient_as_bucket_view=True) if mode == "ddp+" else {}
        model = DDP(model, device_ids=None if ctx.device.type == "cpu" else [ctx.device], **tuned)
        if mode == "ddp+" and args.no_grad_sync:
            model.register_comm_hook(None, keep_local)
    elif mode.startswith(
        "fsdp"
    ):  # an explicit mesh: without one FSDP2 picks the accelerator even on CPU + Gloo
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        blocks = list(model.blocks.values())
        for i, block in enumerate(
            blocks
        ):  # fsdp+: the last block's backward comes first, so keep it gathered
            fully_shard(
                block, mesh=mesh, reshard_after_forward=mode == "fsdp" or i < len(blocks) - 1
            )
        fully_shard(model, mesh=mesh)
        if (
            mode == "fsdp+"
        ):  # each block all_gathers the next one (forward) / the previous one (backward) early
            for i, block in enumerate(blocks):
                block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
                block.set_modules_to_backward_prefetch(blocks[i - 1 : i] if i else [])
            model.set_requires_gradient_sync(not args.no_grad_sync)
    elif mode == "tp":
        apply_tensor_parallel(model, init_device_mesh(ctx.device.type, (ctx.world_size,)), False)
    # fused AdamW cannot mix DTensors and plain tensors in one kernel (tp shards only the blocks)
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-3, fused=mode != "tp", foreach=False if mode == "tp" else None
    )
    return model, opt


def keep_local(_, bucket):
    """A DDP comm hook that sends nothing (for --no-grad-sync): each rank keeps its own gradient."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def collectives(prof):
    """'2 all_reduce', '9 all_gather, 5 reduce_scatter', ...: the c10d ops of one profiled step."""
    counts = collections.Counter(
        what
        for e in prof.events()
        if e.name.startswith("c10d::")
        for part, what in KINDS.items()
        if part in e.name
    )
    return ", ".join(f"{n} {what}" for what, n in sorted(counts.items())) or "-"


def state_bytes(model):
    """Parameters + gradients + two AdamW moments held by this rank, in bytes."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return 4 * sum(t.numel() * t.element_size() for t in local)


def train_step(model, opt, x, y):
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def main(args, ctx):
    n = ctx.world_size
    ctx.require(
        args.n_head % n == 0, f"tp needs --n-head {args.n_head} to be a multiple of the {n} ranks"
    )
    ctx.require(
        args.steps > args.warmup >= 1,
        "--warmup must be at least 1 and --steps larger than --warmup",
    )
    cfg = config_from_args(args)
    torch.manual_seed(0)
    base = GPT(cfg).to(ctx.device)
    tokens = data.encode(data.generate_corpus())
    mine = data.ShardedWindows(
        tokens, cfg.block_size, ctx.rank, n
    )  # this rank's share of each step
    whole = data.ShardedWindows(tokens, cfg.block_size, 0, 1)  # tp: every rank, the global batch
    per_rank = [
        tuple(t.to(ctx.device) for t in mine.batch(s, 0, args.batch_size))
        for s in range(args.steps)
    ]
    global_ = [
        tuple(t.to(ctx.device) for t in whole.batch(s, 0, args.batch_size * n))
        for s in range(args.steps)
    ]
    tokens_per_step = args.batch_size * cfg.block_size * n
    print0(
        f"model: {base.num_params() / 1e6:.2f}M parameters, {cfg}; {n} rank(s), {ctx.device.type}, "
        f"{tokens_per_step} tokens/step, median of {args.steps - args.warmup} timed steps after {args.warmup} warm-up"
    )

    def sync():
        if ctx.device.type != "cpu":
            torch.accelerator.synchronize()

    # Build every mode and warm it up, one after the other (peak memory: what this mode added).
    runs = {}
    for mode in args.modes:
        batches = global_ if mode == "tp" else per_rank
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        before = torch.cuda.memory_allocated(ctx.device) if ctx.device.type == "cuda" else 0
        model, opt = build(mode, base, ctx, args)
        for i, (x, y) in enumerate(
            batches[: args.warmup]
        ):  # the last warm-up step is profiled: its collectives
            with (
                profile(activities=[ProfilerActivity.CPU])
                if i == args.warmup - 1
                else contextlib.nullcontext() as prof
            ):
                train_step(model, opt, x, y)
        sync()
        peak = (
            (torch.cuda.max_memory_allocated(ctx.device) - before) / 2**20
            if ctx.device.type == "cuda"
            else None
        )
        runs[mode] = dict(
            model=model,
            opt=opt,
            batches=batches,
            peak=peak,
            times=[],
            loss=None,
            sent=collectives(prof),
        )
    # Then time them in turns, step by step: load from other jobs hits every mode alike.
    for step in range(args.warmup, args.steps):
        for mode, r in runs.items():
            x, y = r["batches"][step]
            sync()
            t0 = time.perf_counter()
            r["loss"] = train_step(r["model"], r["opt"], x, y)
            sync()
            r["times"].append(time.perf_counter() - t0)

    rows, losses = [], {}
    for mode, r in runs.items():
        times = torch.tensor(r["times"], device=ctx.device)  # NCCL takes device tensors only
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step is done when the slowest rank is done
        step_time = times.median().item()  # the median: robust to a burst of other work
        loss = r["loss"].clone()
        if mode != "tp":
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the mean loss over the global batch
        losses[mode] = loss.item()
        rows.append(
            (
                mode,
                tokens_per_step / step_time,
                step_time * 1e3,
                state_bytes(r["model"]) / 2**20,
                r["peak"],
                r["sent"],
            )
        )
    base_tps = dict((r[0], r[1]) for r in rows).get("none")
    print0(
        "\n| mode | ranks | tokens/s | ms/step | state MB/rank | peak GPU MB/rank | vs none | collectives/step/rank |"
    )
    print0("|---|---|---|---|---|---|---|---|")
    for mode, tps, ms, state, peak, sent in rows:
        rel = f"{tps / base_tps:.2f}" if base_tps else "-"
        print0(
            f"| {mode} | {n} | {tps:,.0f} | {ms:.1f} | {state:.2f} | "
            f"{f'{peak:.0f}' if peak is not None else 'n/a'} | {rel} | {sent} |"
        )
    print_ratios({mode: ms for mode, _, ms, *_ in rows})
    trained = {m: losses[m] for m in ("ddp", "ddp+", "fsdp", "fsdp+", "tp") if m in losses}
    spread = max(trained.values()) - min(trained.values()) if trained else 0.0
    if spread > args.tol:
        raise RuntimeError(
            f"{', '.join(trained)} should train the same model, but their losses differ: {trained}"
        )
    print0("")
    print0(
        f"OK: measured {', '.join(args.modes)} on {n} rank(s); "
        f"{', '.join(trained)} ended at the same loss (spread {spread:.1e})"
    )


def print_ratios(ms):
    """Step time over step time, the ratios issue 18 set goals for: default settings, then tuned."""
    pairs = [
        ("ddp", "none"),
        ("fsdp", "ddp"),
        ("ddp+", "none"),
        ("fsdp+", "ddp+"),
        ("fsdp+", "ddp"),
    ]
    found = [f"{a} / {b} {ms[a] / ms[b]:.2f}" for a, b in pairs if a in ms and b in ms]
    if found:
        print0(
            "\nstep time ratios (goals: ddp <= 1.05 x none, fsdp <= 1.10 x ddp): "
            + ", ".join(found)
        )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--steps", type=int, default=20, help="steps per mode, warm-up included")
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed steps; the last one is profiled"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="windows per rank per step")
    parser.add_argument(
        "--tol", type=float, default=1e-3, help="largest loss spread accepted between modes"
    )
    test_flags(parser).add_argument(
        "--no-grad-sync",
        action="store_true",
        help="ddp+ sends no gradients, fsdp+ does no reduce_scatter: the losses differ",
    )
    add_model_args(
        parser, n_layer=4, n_head=24, n_embd=192, block_size=128
    )  # tp: 24 heads split 1, 2, 3, 4, 6, 8 ways
    run(main, parser.parse_args())
