"""Pipeline schedules: the GPT of pipeline_parallel.py under six schedules of torch 2.13.

  gpipe        all F, then all B                   bubble (p-1)/(m+p-1); m micro-batches held
  1f1b         one F, one B after a warm-up        (p-1)/(m+p-1); at most p held
  interleaved  2 stages a rank: 0..p-1, p..2p-1    (p-1)/(2m+p-1): each slot half as long
  zb1p, zbv    the backward split in I (input gradient, sent on at once) and W (weight gradient,
               run where the rank would idle); zbv: a rank's 2 stages in a V (rank 0: first, last)
  dualpipev    DeepSeek's DualPipe on the V: F of one micro-batch beside B of another
(p ranks, m micro-batches; torch/distributed/pipelining/schedules.py.) Checked: losses and
parameters equal one process training the whole model on the whole batch. Measured per rank:
the bubble in ticks (F, I, W one tick, a full B two) and in seconds, the micro-batches held and
the sends (which the schedules post, in dist.batch_isend_irecv).

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

    torchrun --nproc_per_node=2 transformer_basics/pipeline_schedules.py
    python transformer_basics/pipeline_schedules.py --nproc 4 --schedule zbv

Docs: https://pytorch.org/docs/stable/distributed.pipelining.html
"""

import copy
import time
from argparse import Namespace
from fractions import Fraction
from itertools import accumulate

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, schedules

import data
from launch.dist_setup import float_in, int_in, lesson_parser, print0, run
from model import GPT, config_from_args
from pipeline_parallel import cut_stage, loss_fn

SCHEDULES = {  # name: (class, stages per rank, layout of the stages over the ranks)
    "gpipe": (schedules.ScheduleGPipe, 1, "loop"),
    "1f1b": (schedules.Schedule1F1B, 1, "loop"),
    "interleaved": (schedules.ScheduleInterleaved1F1B, 2, "loop"),
    "zb1p": (schedules.ScheduleInterleavedZeroBubble, 2, "loop"),
    "zbv": (schedules.ScheduleZBVZeroBubble, 2, "v"),
    "dualpipev": (schedules.ScheduleDualPipeV, 2, "v"),
}


def my_stages(rank, p, per_rank, layout):
    """The global stage numbers this rank holds: every p-th ("loop"), or rank and its mirror "v"."""
    return [rank, 2 * p - 1 - rank] if layout == "v" else [rank + k * p for k in range(per_rank)]


def train(name, tokens, args, ctx):
    cls, per_rank, layout = SCHEDULES[name]
    p, n, m = ctx.world_size, ctx.world_size * per_rank, args.microbatches
    torch.manual_seed(args.seed)
    reference = GPT(config_from_args(args)).to(ctx.device)  # the whole model, for the check
    ids = my_stages(ctx.rank, p, per_rank=per_rank, layout=layout)
    models = [cut_stage(copy.deepcopy(reference), i, n) for i in ids]
    stages = [PipelineStage(mod, i, n, ctx.device) for mod, i in zip(models, ids)]
    # one stage, or a list; scale_grads=True (default): summed gradients / m (stage.py, 2.13)
    schedule = cls(stages[0] if per_rank == 1 else stages, n_microbatches=m, loss_fn=loss_fn)
    # The embedding (stage 0) and the head (stage n-1) are one matrix in the whole model: here
    # two copies, on two ranks or (V layout) both on rank 0; each gets the sum of both gradients.
    tie_group = dist.new_group(sorted({0, 0 if layout == "v" else p - 1}))  # every rank calls it
    ends = [getattr(mod, k) for mod in models for k in ("wte", "lm_head")]
    tied = list({id(e.weight): e.weight for e in ends if e is not None}.values())  # 1 rank: 1
    opt = torch.optim.SGD([q for mod in models for q in mod.parameters()], lr=args.lr)
    windows = data.ShardedWindows(tokens, args.block_size, 0, 1, args.seed)
    for step in range(args.steps):
        x, y = (t.to(ctx.device) for t in windows.batch(step, 0, args.batch_size))
        losses = []  # filled where the last stage is, one per micro-batch
        timeline = record_timeline(stages) if step == args.steps - 1 else None
        inputs = [x] if 0 in ids else []  # the first stage feeds the inputs...
        targets = dict(target=y, losses=losses) if n - 1 in ids else {}  # ...the last the targets
        schedule.step(*inputs, **targets)
        if tied:
            total = torch.stack([w.grad for w in tied]).sum(0)
            dist.all_reduce(total, group=tie_group)
            for w in tied:
                w.grad.copy_(total)
        opt.step()
        opt.zero_grad()
        check_step(step, x, y, losses, models, reference, args, ctx)
    return measure(name, timeline, per_rank=per_rank, args=args, ctx=ctx)


def main(args, ctx):
    # the schedules send activations and gradients to neighbours, which Gloo does on CPU tensors
    # only (docs: distributed.html#backends)
    ctx.require(
        ctx.backend != "gloo" or ctx.device.type == "cpu",
        "point-to-point on gloo needs CPU tensors: use --backend nccl or --device cpu",
    )
    names = list(SCHEDULES) if args.schedule == "all" else [args.schedule]
    tokens = data.encode(data.generate_corpus(2000))
    args = with_sizes(names, tokens, args, ctx)  # a copy: the default sizes filled in, checked
    print_table([train(name, tokens, args, ctx) for name in names], args, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


def measure(name, timeline, per_rank, args, ctx):
    """Every rank's timeline, gathered: per rank the bubble in ticks (replayed from the order it
    ran) and in seconds (wall clock: noisy on shared cores), the micro-batches it held."""
    events = sorted(timeline["events"], key=lambda e: e[4])  # by the time each one ended
    # a micro-batch is held from its F until its B (or W) is done: a stage's is 1/per_rank of the
    # rank's
    peak = max(accumulate({"F": 1, "B": -1, "W": -1}.get(e[0], 0) / per_rank for e in events))
    busy = sum(end - start for *_, start, end in events)
    mine = ([e[:3] for e in events], events[-1][4] - timeline["t0"], busy, peak, timeline["sends"])
    p = ctx.world_size
    gathered = [None] * p
    dist.all_gather_object(gathered, mine)
    orders, spans, busies, peaks, sends = zip(*gathered)
    slots = replay(orders, p * per_rank)
    length = max(start + TICKS[kind] for row in slots for start, kind, *_ in row)
    idle = [length - sum(TICKS[kind] for _, kind, *_ in row) for row in slots]
    ticks = [Fraction(i, length) for i in idle]
    m, formula = args.microbatches, Fraction(p - 1, args.microbatches + p - 1)
    what = f"{p} rank(s) x {per_rank} stage(s), {m} micro-batches"
    print0(f"{name}: {what}; what each rank ran, per tick:")
    for rank, row in enumerate(slots):  # a cell a tick: F3 (f3: the second stage), B3 ==, idle .
        cells = [" ."] * length
        for start, kind, mb, s in row:
            cells[start] = f"{kind.lower() if s >= p else kind}{mb}"
            cells[start + 1 : start + TICKS[kind]] = ["=="] * (TICKS[kind] - 1)
        print0(f"  rank {rank}: {' '.join(f'{c:>3}' for c in cells)}")
    ok = ticks == [formula] * p if per_rank == 1 else p == 1 or max(ticks) < formula  # 1 rank: none
    if not ok:  # gpipe and 1f1b: the formula; the others below it
        raise RuntimeError(f"{name}: bubble of {ticks} ticks; (p-1)/(m+p-1) = {formula}")
    claim = {"gpipe": formula, "1f1b": formula, "interleaved": Fraction(p - 1, 2 * m + p - 1)}
    seconds = [1 - b / max(spans) for b in busies]
    return name, [f"{i}/{length}" for i in idle], claim.get(name), seconds, peaks, sum(sends)


def print_table(rows, args, ctx):
    print0(
        f"{'schedule':12}  {'bubble per rank: idle/all ticks':32}  {'claimed':8}  "
        f"{'seconds (wall clock)':24}  {'held (micro-batches)':24}  sends/step"
    )
    for name, ticks, claim, seconds, peaks, sends in rows:
        cols = [" ".join(ticks), "-" if claim is None else f"{float(claim):.1%}"]
        cols += [" ".join(f"{s:.0%}" for s in seconds), " ".join(f"{h:g}" for h in peaks)]
        print0(f"{name:12}  {cols[0]:32}  {cols[1]:8}  {cols[2]:24}  {cols[3]:24}  {sends}")
    print0(
        f"OK: {', '.join(r[0] for r in rows)} on {ctx.world_size} rank(s) x {args.microbatches} "
        f"micro-batches equal single-process training ({args.steps} steps, losses and parameters);"
        f" bubble in ticks: gpipe and 1f1b (p-1)/(m+p-1), the others below it"
    )


def with_sizes(names, tokens, args, ctx):
    """A copy of args with the default sizes filled in (2 micro-batches a rank, of 2 windows each),
    once every schedule of names can use them; else one line on every rank."""
    p, per_rank = ctx.world_size, max(SCHEDULES[name][1] for name in names)
    m = args.microbatches or 2 * p
    args = Namespace(**{**vars(args), "microbatches": m, "batch_size": args.batch_size or 2 * m})
    stages = p * per_rank
    ctx.require(args.n_layer >= stages, f"--n-layer {args.n_layer}: fewer than {stages} stages")
    ctx.require(args.batch_size % m == 0, f"--batch-size: not a multiple of {m} micro-batches")
    ctx.require(args.n_embd % args.n_head == 0, "--n-embd must be a multiple of --n-head")
    # schedules.py, the __init__ of Schedule1F1B, ScheduleDualPipeV, ScheduleInterleaved1F1B
    fits = {"1f1b": m >= p, "dualpipev": m >= 2 * p, "interleaved": m % max(1, m // p) == 0}
    for name in names:
        fits["zb1p"] = fits["interleaved"]  # ScheduleInterleavedZeroBubble's: the same rounds
        ctx.require(fits.get(name, True), f"--microbatches {m} does not fit {name} on {p} ranks")
    ctx.require(not (problem := data.check_tokens(tokens, args.block_size, None)), str(problem))
    return args


def check_step(step, x, y, losses, models, reference, args, ctx):
    """The same step of the whole model here: loss and this rank's parameters must be equal.
    --tol 2e-5: the micro-batches' gradients are summed in another order than one backward does,
    which float32 rounds differently: at 2 ranks the largest difference was one ulp of a weight
    near 1 (1.2e-7 = 2**-23, ln_f.weight; the losses equal), so --tol 1e-6 passes and 1e-7 fails
    (`--nproc 2 --tol 1e-7`, torch 2.13.0+cpu and 2.14.1, 2-core CPU, 2026-11-27; whether that ulp
    flips depends on the kernels: 1e-7 passed on another machine, issue 45)."""
    ref_loss = loss_fn(reference(x), y)
    ref_loss.backward()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=args.lr)  # no momentum: no state
    ref_opt.step()
    ref_opt.zero_grad()
    # the losses are known where the last stage is, one per micro-batch
    loss = torch.stack(losses).mean() if losses else torch.zeros((), device=ctx.device)
    dist.all_reduce(loss)
    if abs(loss.item() - ref_loss.item()) > args.tol:
        raise RuntimeError(f"step {step}: the loss differs from single-process training's")
    ref_params = dict(reference.named_parameters(remove_duplicate=False))  # lm_head.weight too
    for name, param in [named for model in models for named in model.named_parameters()]:
        if (param - ref_params[name]).abs().max().item() > args.tol:
            raise RuntimeError(f"step {step}: {name} differs from single-process training's")


# ---- what each pipeline stage ran and when (F, B, I, W), and the order each rank ran replayed
# in ticks ----


def record_timeline(stages):
    """Wrap the stage methods the schedule calls (torch 2.13, schedules.py) to note what ran when:
    F, B, I (input gradient), W (weight gradient); and count the sends it hands to the batch."""
    dist.barrier()  # the ranks start the step together: their seconds count from here
    timeline = dict(t0=time.perf_counter(), events=[], sends=0)
    for stage in stages:
        for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            wrap(stage, method, timeline)
        for method in ("get_fwd_send_ops", "get_bwd_send_ops"):
            wrap(stage, method, timeline)
    return timeline


def wrap(stage, method, timeline):
    call = getattr(stage, method)
    kind = {"forward_one_chunk": "F", "backward_weight_one_chunk": "W"}.get(method, "B")

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = call(*args, **kwargs)
        if method.endswith("send_ops"):
            timeline["sends"] += len(out)
        else:  # backward_one_chunk(full_backward=False): the input gradient only
            split = kind == "B" and not kwargs.get("full_backward", True)
            event = ("I" if split else kind, args[0], stage.stage_index, start)
            timeline["events"].append((*event, time.perf_counter()))
        return out

    setattr(stage, method, wrapper)


TICKS = {"F": 1, "I": 1, "W": 1, "B": 2}  # a full backward = input gradient + weight gradient


def replay(orders, n):
    """Run each rank's recorded order again, each action costing TICKS and sends free: an action
    starts when its rank is free and its inputs exist (F of stage s needs F of s-1; I or B of s
    needs F of s and I of s+1; W needs I). Per rank: [(start tick, kind, micro-batch, stage)]."""
    done, free, at, slots = {}, [0] * len(orders), [0] * len(orders), [[] for _ in orders]
    while any(at[r] < len(order) for r, order in enumerate(orders)):
        before = sum(at)
        for r, order in enumerate(orders):
            while at[r] < len(order):
                kind, mb, s = order[at[r]]
                needs = [("F", s - 1, mb)] if kind == "F" and s > 0 else []
                needs += [("F", s, mb)] + [("G", s + 1, mb)] * (s < n - 1) if kind in "BI" else []
                needs += [("G", s, mb)] if kind == "W" else []
                if not all(d in done for d in needs):
                    break
                start = max([free[r]] + [done[d] for d in needs])
                free[r] = start + TICKS[kind]
                for key in {"F": "F", "I": "G", "W": "W", "B": "GW"}[kind]:
                    done[(key, s, mb)] = free[r]
                slots[r].append((start, kind, mb, s))
                at[r] += 1
        if sum(at) == before:
            raise RuntimeError(f"the recorded orders cannot be replayed: {orders}")
    return slots


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--schedule", choices=[*SCHEDULES, "all"], default="all")
    parser.add_argument("--microbatches", type=int_in(1, 1024), help="default: 2 per rank")
    parser.add_argument("--batch-size", type=int_in(1, 4096), help="default: 2 per micro-batch")
    parser.add_argument("--steps", type=int_in(1, 10_000), default=2)
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.2)
    parser.add_argument("--tol", type=float_in(0, 1), default=2e-5, help="see check_step")
    parser.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0)
    # 16 blocks: 2 stages on each of up to 8 ranks; narrow, so that a run takes seconds
    # the GPT of model.py
    parser.add_argument("--n-layer", type=int_in(1, 256), default=16)
    parser.add_argument("--n-head", type=int_in(1, 1024), default=2)
    parser.add_argument("--n-embd", type=int_in(1, 65_536), default=32)
    parser.add_argument(
        "--block-size", type=int_in(1, 1_048_576), default=16, help="context length"
    )
    parser.add_argument("--dropout", type=float_in(0, 0.9), default=0.0)
    run(main, parser.parse_args())
