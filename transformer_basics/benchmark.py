"""A measuring tool (not a lesson): tokens/s, step time, memory and collectives per rank of one
GPT trained six ways on the same ranks; the ways themselves are taught in train.py and
tensor_parallel.py.

  none   every rank trains its own copy, no communication: the ceiling for data parallel
  ddp    DistributedDataParallel: replicas, gradients all_reduced during backward
  ddp+   the same, tuned (ddp_basics/ddp_overlap.py): gradient_as_bucket_view, default buckets
  fsdp   fully_shard per block: parameters, gradients and AdamW state sharded 1/N
  fsdp+  the same, tuned for overlap (fsdp_basics/fsdp_overlap.py): the last block kept unsharded
         after forward, explicit prefetch of the next block in forward and backward
  tp     tensor parallel over all ranks (tensor_parallel.py): each rank holds 1/N of every
         block's matrices and processes the whole global batch
Every mode takes the same global batch per step (batch-size windows per rank), so tokens/s
compare directly. The modes are timed in turns, one step each, so that other work on the
machine slows them alike; a step time is the median over steps of the slowest rank. "state" is
what each rank holds of parameters + gradients + AdamW moments (counted from the local tensors);
on a GPU the peak allocated memory is measured too. "collectives": the c10d ops one rank issued
in its last warm-up step (past DDP's bucket rebuild and its 2 broadcasts in step 2), from
torch.profiler (ProcessGroup.hpp dispatches every collective through them, torch 2.13). Then the
step-time ratios issue 18 set goals for. The check: ddp, ddp+, fsdp, fsdp+ and tp train one model
on one global batch, so their losses must agree.

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

    torchrun --nproc_per_node=2 transformer_basics/benchmark.py
    torchrun --nproc_per_node=8 transformer_basics/benchmark.py --n-layer 12 --n-head 16 \
        --n-embd 768 --block-size 1024

Timings on a CPU shared with other work are noisy; compare modes within one run.
Docs: https://pytorch.org/docs/stable/distributed.html
"""

import collections
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
from tqdm import tqdm

import data
from launch.dist_setup import float_in, int_in, lesson_parser, print0, run
from model import GPT, config_from_args
from tensor_parallel import apply_tensor_parallel

MODES = ["none", "ddp", "ddp+", "fsdp", "fsdp+", "tp"]


def build(mode, base, ctx):
    model = copy.deepcopy(base)
    if mode.startswith("ddp"):
        # ddp+: the .grads are views into the buckets, no copy out of them (DDP's docstring); not
        # static_graph: it breaks no_sync, which train.py's accumulation needs
        # (pytorch/pytorch#143580, still so in torch 2.13)
        tuned = dict(gradient_as_bucket_view=True) if mode == "ddp+" else {}
        model = DDP(model, device_ids=None if ctx.device.type == "cpu" else [ctx.device], **tuned)
    elif mode.startswith("fsdp"):
        # an explicit mesh: without one FSDP2 picks the accelerator even on CPU + Gloo
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        blocks = list(model.blocks.values())
        for i, block in enumerate(blocks):
            # fsdp+: the last block's backward comes first, so keep it gathered
            keep = mode == "fsdp+" and i == len(blocks) - 1
            fully_shard(block, mesh=mesh, reshard_after_forward=not keep)
        fully_shard(model, mesh=mesh)
        if mode == "fsdp+":  # each block all_gathers the next (forward) / previous (backward) early
            for i, block in enumerate(blocks):
                block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
                block.set_modules_to_backward_prefetch(blocks[i - 1 : i] if i else [])
    elif mode == "tp":
        apply_tensor_parallel(model, init_device_mesh(ctx.device.type, (ctx.world_size,)), False)
    # fused AdamW cannot mix DTensors and plain tensors in one kernel (tp shards only the blocks)
    fused = dict(foreach=False) if mode == "tp" else dict(fused=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, **fused)


def train_step(model, opt, x, y):
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def main(args, ctx):
    n = ctx.world_size
    ctx.require(args.n_head % n == 0, f"tp needs --n-head {args.n_head} to be a multiple of {n}")
    ctx.require(args.n_embd % args.n_head == 0, "--n-embd must be a multiple of --n-head")
    ctx.require(args.steps > args.warmup, "--steps must be larger than --warmup")
    torch.manual_seed(0)
    base = GPT(config_from_args(args)).to(ctx.device)
    tokens = data.encode(data.generate_corpus())
    ctx.require(not (problem := data.check_tokens(tokens, args.block_size, None)), str(problem))
    mine = data.ShardedWindows(tokens, args.block_size, ctx.rank, n)  # this rank's share
    whole = data.ShardedWindows(tokens, args.block_size, 0, 1)  # tp: the global batch everywhere
    per_rank = [mine.batch(s, 0, args.batch_size) for s in range(args.steps)]
    global_ = [whole.batch(s, 0, args.batch_size * n) for s in range(args.steps)]
    print_header(base, args, ctx)

    # Build every mode and warm it up, one after the other (peak memory: what this mode added).
    runs = {}
    for mode in args.modes:
        source = global_ if mode == "tp" else per_rank
        batches = [(x.to(ctx.device), y.to(ctx.device)) for x, y in source]
        memory = PeakMemory(ctx.device)
        model, opt = build(mode, base, ctx)
        for x, y in batches[: args.warmup - 1]:
            train_step(model, opt, x, y)
        with profile(activities=[ProfilerActivity.CPU]) as prof:  # the last warm-up step
            train_step(model, opt, *batches[args.warmup - 1])
        runs[mode] = dict(model=model, opt=opt, batches=batches, times=[], loss=None)
        runs[mode].update(peak=memory.peak(), sent=collectives(prof))
    # Then time them in turns, step by step: load from other jobs hits every mode alike.
    for step in tqdm(range(args.warmup, args.steps), "timed steps", disable=ctx.rank != 0 or None):
        for r in runs.values():
            x, y = r["batches"][step]
            synchronize(ctx.device)
            t0 = time.perf_counter()
            r["loss"] = train_step(r["model"], r["opt"], x, y)
            synchronize(ctx.device)
            r["times"].append(time.perf_counter() - t0)
    print_table_and_check(runs, args, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


def print_header(base, args, ctx):
    print0(
        f"model: {base.num_params() / 1e6:.2f}M parameters, {base.cfg}; {ctx.world_size} rank(s), "
        f"{ctx.device.type}, {args.batch_size * args.block_size * ctx.world_size} tokens/step, "
        f"median of {args.steps - args.warmup} timed steps after {args.warmup} warm-up"
    )


def print_table_and_check(runs, args, ctx):
    """The table (a step: the median over steps of the slowest rank), the ratios, and the check:
    every mode but none trains one model on one global batch, so their losses must agree."""
    n, tokens_per_step = ctx.world_size, args.batch_size * args.block_size * ctx.world_size
    rows, losses = [], {}
    for mode, r in runs.items():
        times = torch.tensor(r["times"], device=ctx.device)  # NCCL takes device tensors only
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step is done when the slowest rank is
        step_time = times.median().item()  # the median: robust to a burst of other work
        loss = r["loss"].clone()
        if mode != "tp":
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the mean loss over the global batch
        losses[mode] = loss.item()
        peak = f"{r['peak']:.0f}" if r["peak"] is not None else "n/a"
        state = state_bytes(r["model"]) / 2**20
        rows.append((mode, tokens_per_step / step_time, step_time * 1e3, state, peak, r["sent"]))
    base_tps = {row[0]: row[1] for row in rows}.get("none")
    print0(
        "\n| mode | ranks | tokens/s | ms/step | state MB/rank | peak GPU MB/rank | vs none "
        "| collectives/step/rank |"
    )
    print0("|---|---|---|---|---|---|---|---|")
    for mode, tps, ms, state, peak, sent in rows:
        rel = f"{tps / base_tps:.2f}" if base_tps else "-"
        print0(f"| {mode} | {n} | {tps:,.0f} | {ms:.1f} | {state:.2f} | {peak} | {rel} | {sent} |")
    print_ratios({row[0]: row[2] for row in rows})
    trained = {m: losses[m] for m in ("ddp", "ddp+", "fsdp", "fsdp+", "tp") if m in losses}
    spread = max(trained.values()) - min(trained.values()) if trained else 0.0
    if spread > args.tol:
        raise RuntimeError(
            f"{', '.join(trained)} should train the same model, but their losses differ: {trained}"
        )
    print0()  # a blank line after the tables
    print0(
        f"OK: measured {', '.join(args.modes)} on {n} rank(s); "
        f"{', '.join(trained)} ended at the same loss (spread {spread:.1e})"
    )


def print_ratios(ms):
    """Step time over step time, the ratios issue 18 set goals for: default settings, then tuned."""
    default, tuned = [("ddp", "none"), ("fsdp", "ddp")], [("ddp+", "none"), ("fsdp+", "ddp+")]
    pairs = default + tuned + [("fsdp+", "ddp")]
    found = [f"{a} / {b} {ms[a] / ms[b]:.2f}" for a, b in pairs if a in ms and b in ms]
    if found:
        goals = "goals: ddp <= 1.05 x none, fsdp <= 1.10 x ddp"
        print0(f"\nstep time ratios ({goals}): " + ", ".join(found))


# ---- what it measures with: the peak CUDA memory, the collectives a profiled step ran, the state
# a rank holds ----


def synchronize(device):
    if device.type != "cpu":  # a GPU runs ahead of the host: time only what it has finished
        torch.accelerator.synchronize()


class PeakMemory:
    """On CUDA, the peak allocated memory from now on, above what was allocated now."""

    def __init__(self, device):
        self.device, self.cuda = device, device.type == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
            self.before = torch.cuda.memory_allocated(device)

    def peak(self):
        if not self.cuda:
            return None
        synchronize(self.device)
        return (torch.cuda.max_memory_allocated(self.device) - self.before) / 2**20


# part of a c10d op's name (c10d::allreduce_, c10d::_allgather_base_, ...) -> the collective it is
KINDS = {"allreduce": "all_reduce", "allgather": "all_gather", "alltoall": "all_to_all"}
KINDS |= {"reduce_scatter": "reduce_scatter", "broadcast": "broadcast"}


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


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument(
        "--steps", type=int_in(2, 10_000), default=20, help="steps per mode, warm-up included"
    )
    parser.add_argument(
        "--warmup", type=int_in(1, 10_000), default=3, help="untimed steps; the last is profiled"
    )
    parser.add_argument(
        "--batch-size", type=int_in(1, 4096), default=8, help="windows per rank per step"
    )
    parser.add_argument(
        "--tol", type=float_in(0, 1), default=1e-3, help="largest loss spread between the modes"
    )
    # tp: 24 heads split 1, 2, 3, 4, 6, 8 ways
    # the GPT of model.py
    parser.add_argument("--n-layer", type=int_in(1, 256), default=4)
    parser.add_argument("--n-head", type=int_in(1, 1024), default=24)
    parser.add_argument("--n-embd", type=int_in(1, 65_536), default=192)
    parser.add_argument(
        "--block-size", type=int_in(1, 1_048_576), default=128, help="context length"
    )
    parser.add_argument("--dropout", type=float_in(0, 0.9), default=0.0)
    run(main, parser.parse_args())
