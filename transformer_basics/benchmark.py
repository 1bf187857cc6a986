"""A measuring tool (not a lesson): tokens/s, step time and memory per rank of one GPT trained
four ways on the same ranks; the ways themselves are taught in train.py and tensor_parallel.py.

  none  every rank trains its own copy, no communication: the ceiling for data parallel
  ddp   DistributedDataParallel: replicas, gradients all_reduced during backward
  fsdp  fully_shard per block: parameters, gradients and AdamW state sharded 1/N
  tp    tensor parallel over all ranks (tensor_parallel.py): each rank holds 1/N of every
        block's matrices and processes the whole global batch
Every mode takes the same global batch per step (batch-size windows per rank), so tokens/s
compare directly. The modes are timed in turns, one step each, so that other work on the
machine slows them alike; a step time is the median over steps of the slowest rank. "state" is what each rank holds of parameters + gradients + AdamW moments
(counted from the local tensors); on a GPU the peak allocated memory is measured too.
The check: ddp, fsdp and tp train one model on one global batch, so their losses must agree.

    torchrun --nproc_per_node=2 transformer_basics/benchmark.py
    torchrun --nproc_per_node=8 transformer_basics/benchmark.py --n-layer 12 --n-head 16 --n-embd 768 --block-size 1024

Timings on a CPU shared with other work are noisy; compare modes within one run.
Docs: https://pytorch.org/docs/stable/distributed.html
"""
import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import data
from launch.dist_setup import lesson_parser, print0, run
from model import GPT, add_model_args, config_from_args
from tensor_parallel import apply_tensor_parallel

MODES = ["none", "ddp", "fsdp", "tp"]


def build(mode, base, ctx):
    model = copy.deepcopy(base)
    if mode == "ddp":
        model = DDP(model, device_ids=None if ctx.device.type == "cpu" else [ctx.device])
    elif mode == "fsdp":  # an explicit mesh: without one FSDP2 picks the accelerator even on CPU + Gloo
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif mode == "tp":
        apply_tensor_parallel(model, init_device_mesh(ctx.device.type, (ctx.world_size,)), False)
    # fused AdamW cannot mix DTensors and plain tensors in one kernel (tp shards only the blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=mode != "tp", foreach=False if mode == "tp" else None)
    return model, opt


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
    ctx.require(args.n_head % n == 0, f"tp needs --n-head {args.n_head} to be a multiple of the {n} ranks")
    ctx.require(args.steps > args.warmup, "--steps must be larger than --warmup")
    cfg = config_from_args(args)
    torch.manual_seed(0)
    base = GPT(cfg).to(ctx.device)
    tokens = data.encode(data.generate_corpus())
    mine = data.ShardedWindows(tokens, cfg.block_size, ctx.rank, n)  # this rank's share of each step
    whole = data.ShardedWindows(tokens, cfg.block_size, 0, 1)          # tp: every rank, the global batch
    per_rank = [tuple(t.to(ctx.device) for t in mine.batch(s, 0, args.batch_size)) for s in range(args.steps)]
    global_ = [tuple(t.to(ctx.device) for t in whole.batch(s, 0, args.batch_size * n)) for s in range(args.steps)]
    tokens_per_step = args.batch_size * cfg.block_size * n
    print0(f"model: {base.num_params() / 1e6:.2f}M parameters, {cfg}; {n} rank(s), {ctx.device.type}, "
           f"{tokens_per_step} tokens/step, median of {args.steps - args.warmup} timed steps after {args.warmup} warm-up")

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
        model, opt = build(mode, base, ctx)
        for x, y in batches[:args.warmup]:
            train_step(model, opt, x, y)
        sync()
        peak = (torch.cuda.max_memory_allocated(ctx.device) - before) / 2**20 if ctx.device.type == "cuda" else None
        runs[mode] = dict(model=model, opt=opt, batches=batches, peak=peak, times=[], loss=None)
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
        rows.append((mode, tokens_per_step / step_time, step_time * 1e3, state_bytes(r["model"]) / 2**20, r["peak"]))
    base_tps = dict((r[0], r[1]) for r in rows).get("none")
    print0(f"\n| mode | ranks | tokens/s | ms/step | state MB/rank | peak GPU MB/rank | vs none |")
    print0("|---|---|---|---|---|---|---|")
    for mode, tps, ms, state, peak in rows:
        rel = f"{tps / base_tps:.2f}" if base_tps else "-"
        print0(f"| {mode} | {n} | {tps:,.0f} | {ms:.1f} | {state:.2f} | "
               f"{f'{peak:.0f}' if peak is not None else 'n/a'} | {rel} |")
    trained = {m: losses[m] for m in ("ddp", "fsdp", "tp") if m in losses}
    spread = max(trained.values()) - min(trained.values()) if trained else 0.0
    if spread > args.tol:
        raise RuntimeError(f"ddp, fsdp and tp should train the same model, but their losses differ: {trained}")
    print0("")
    print0(f"OK: measured {', '.join(args.modes)} on {n} rank(s); "
           f"{', '.join(trained)} ended at the same loss (spread {spread:.1e})")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--steps", type=int, default=20, help="steps per mode, warm-up included")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8, help="windows per rank per step")
    parser.add_argument("--tol", type=float, default=1e-3, help="largest loss spread accepted between modes")
    add_model_args(parser, n_layer=4, n_head=24, n_embd=192, block_size=128)  # tp: 24 heads split 1, 2, 3, 4, 6, 8 ways
    run(main, parser.parse_args())
