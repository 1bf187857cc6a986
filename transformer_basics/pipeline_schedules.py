"""Pipeline schedules: one GPT, one batch, five orders of forward and backward work.

pipeline_parallel.py cuts the GPT into one stage per rank and runs GPipe or 1F1B. Here the same
model runs under the schedules of torch.distributed.pipelining (torch 2.13, schedules.py):
  gpipe        all F, then all B                          bubble (p-1)/(m+p-1)
  1f1b         one F, one B after a warm-up                (p-1)/(m+p-1), fewer held
  interleaved  2 stages per rank (0..p-1, then p..2p-1)    (p-1)/(2m+p-1): smaller slots
  zbv          2 stages per rank in a V (rank 0: first and last), backward split into I (input
               gradient, sent on at once) and W (weight gradient, fills the idle slots)
  dualpipev    DeepSeek's DualPipe on the V layout, F of one micro-batch beside B of another
(p ranks, m micro-batches.) Each schedule's loss and updated parameters must equal one process
training the whole model on the whole batch; the bubble of each rank is measured from what it
ran, in ticks (F, I, W one tick each, a full B two) and in seconds; `--schedule all` prints one
table. The schedules post their own sends, grouped in dist.batch_isend_irecv.

run() and ctx: init_process_group on ctx.device, main(args, ctx), destroy_process_group.

    torchrun --nproc_per_node=2 transformer_basics/pipeline_schedules.py
    python transformer_basics/pipeline_schedules.py --nproc 4 --schedule zbv --timeline

Docs: https://pytorch.org/docs/stable/distributed.pipelining.html
"""

import copy
import time
from fractions import Fraction

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, schedules

import data
from launch.dist_setup import float_in, int_in, lesson_parser, print0, run
from model import GPT, add_model_args, config_from_args
from pipeline_parallel import cut_stage, loss_fn

SCHEDULES = {  # name: (class, stages per rank, layout of the stages over the ranks)
    "gpipe": (schedules.ScheduleGPipe, 1, "loop"),
    "1f1b": (schedules.Schedule1F1B, 1, "loop"),
    "interleaved": (schedules.ScheduleInterleaved1F1B, 2, "loop"),
    "zb1p": (schedules.ScheduleInterleavedZeroBubble, 2, "loop"),
    "zbv": (schedules.ScheduleZBVZeroBubble, 2, "v"),
    "dualpipev": (schedules.ScheduleDualPipeV, 2, "v"),
}


def my_stages(rank, p, v, layout):
    """The global stage numbers this rank holds: every p-th ("loop"), or rank and its mirror "v"."""
    return [rank, 2 * p - 1 - rank] if layout == "v" else [rank + k * p for k in range(v)]


def train(name, tokens, args, ctx):
    cls, v, layout = SCHEDULES[name]
    p, n, m = ctx.world_size, ctx.world_size * v, args.microbatches
    torch.manual_seed(args.seed)
    reference = GPT(config_from_args(args)).to(ctx.device)  # the whole model, for the check
    ids = my_stages(ctx.rank, p, v, layout)
    models = [cut_stage(copy.deepcopy(reference), i, n) for i in ids]
    stages = [PipelineStage(mod, i, n, ctx.device) for mod, i in zip(models, ids)]
    # single-stage schedules take one stage, the multi-stage ones a list
    schedule = cls(stages[0] if v == 1 else stages, n_microbatches=m, loss_fn=loss_fn)
    # The embedding (stage 0) and the head (stage n-1) are one matrix in the whole model: here
    # two copies, on two ranks or (V layout) both on rank 0; each gets the sum of both gradients.
    tie_group = dist.new_group(sorted({0, 0 if layout == "v" else p - 1}))  # every rank calls it
    ends = [getattr(mod, k) for mod in models for k in ("wte", "lm_head")]
    tied = list({id(e.weight): e.weight for e in ends if e is not None}.values())  # 1 rank: 1
    opt = torch.optim.SGD([q for mod in models for q in mod.parameters()], lr=args.lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=args.lr)
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
        check_step(step, x, y, losses, models, reference, ref_opt, ids, args, ctx)
    return measure(name, timeline, p, v, args, ctx)


def main(args, ctx):
    ctx.require_point_to_point()  # the schedules send activations and gradients to neighbours
    names = list(SCHEDULES) if args.schedule == "all" else [args.schedule]
    args.microbatches = args.microbatches or 2 * ctx.world_size
    args.batch_size = args.batch_size or 2 * args.microbatches
    check_sizes(names, args, ctx)
    tokens = data.encode(data.generate_corpus(2000))
    ctx.require(not (problem := data.check_tokens(tokens, args.block_size, None)), str(problem))
    rows = [train(name, tokens, args, ctx) for name in names]
    print_table(rows, args, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


def record_timeline(stages):
    """Wrap each stage's compute calls (the schedule calls them by name) to note what ran when:
    F forward, B full backward, I input-gradient backward, W weight-gradient backward; and count
    the sends the stage hands to batch_isend_irecv."""
    dist.barrier()  # every rank starts the step together: its seconds start here
    timeline = dict(t0=time.perf_counter(), events=[], sends=0)
    for stage in stages:
        for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, method, timed(getattr(stage, method), stage.stage_index, timeline))
        for method in ("get_fwd_send_ops", "get_bwd_send_ops"):
            setattr(stage, method, counted(getattr(stage, method), timeline))
    return timeline


def timed(call, stage_index, timeline):
    kind = {"forward_one_chunk": "F", "backward_weight_one_chunk": "W"}.get(call.__name__, "B")

    def wrapper(mb, *args, **kwargs):
        start = time.perf_counter()
        out = call(mb, *args, **kwargs)
        split = kind == "B" and not kwargs.get("full_backward", True)
        timeline["events"].append(
            ("I" if split else kind, mb, stage_index, start, time.perf_counter())
        )
        return out

    return wrapper


def counted(call, timeline):
    def wrapper(*args, **kwargs):
        ops = call(*args, **kwargs)
        timeline["sends"] += sum(op.op is dist.isend for op in ops)
        return ops

    return wrapper


TICKS = {"F": 1, "I": 1, "W": 1, "B": 2}  # a full backward = input + weight gradient


def replay(orders, n):
    """Replay each rank's recorded order of actions with every action costing TICKS and sends
    free: an action starts when its rank is free and its inputs exist (F of stage s needs F of
    s-1; the input gradient of s needs F of s and the input gradient of s+1; W needs I).
    Returns, per rank, [(start tick, kind, micro-batch, stage)]."""
    done, free, at = {}, [0] * len(orders), [0] * len(orders)
    slots = [[] for _ in orders]
    while any(at[r] < len(o) for r, o in enumerate(orders)):
        moved = False
        for r, order in enumerate(orders):
            while at[r] < len(order):
                kind, mb, s = order[at[r]]
                needs = {"F": [("F", s - 1, mb)] if s > 0 else [], "W": [("G", s, mb)]}.get(
                    kind, [("F", s, mb)] + ([("G", s + 1, mb)] if s < n - 1 else [])
                )
                if not all(d in done for d in needs):
                    break
                start = max([free[r]] + [done[d] for d in needs])
                free[r] = start + TICKS[kind]
                for key in {"F": "F", "I": "G", "W": "W", "B": "GW"}[kind]:
                    done[(key, s, mb)] = free[r]
                slots[r].append((start, kind, mb, s))
                at[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"the recorded orders cannot be replayed: {orders}")
    return slots


def measure(name, timeline, p, v, args, ctx):
    """Gather every rank's timeline; the bubble of each rank in ticks (replayed from the recorded
    order) and in seconds (wall clock, noisy: shared CPU cores, Gloo), the activations it held."""
    events = sorted(timeline["events"], key=lambda e: e[4])
    busy = sum(end - start for *_, start, end in events)
    held = peak = 0.0
    for kind, *_ in events:  # a micro-batch is held from its F until its B (or W) is done
        held += {"F": 1, "B": -1, "W": -1}.get(kind, 0) / v  # one chunk: 1/v of a rank's layers
        peak = max(peak, held)
    mine = ([e[:3] for e in events], events[-1][4] - timeline["t0"], busy, peak, timeline["sends"])
    gathered = [None] * p
    dist.all_gather_object(gathered, mine)
    orders, spans, busies, peaks, sends = zip(*gathered)
    slots = replay(orders, p * v)
    length = max(start + TICKS[kind] for rank in slots for start, kind, *_ in rank)
    ticks = [Fraction(length - sum(TICKS[k] for _, k, *_ in rank), length) for rank in slots]
    seconds = [1 - b / max(spans) for b in busies]
    m = args.microbatches
    one_f_one_b = Fraction(p - 1, m + p - 1)
    print0(f"{name}: {p} ranks x {v} stage(s), {m} micro-batches; what each rank ran, per tick:")
    for rank, row in enumerate(slots):
        print0(f"  rank {rank}: {draw(row, length, v, p)}")
    if name in ("gpipe", "1f1b"):
        claim = one_f_one_b
        if ticks != [claim] * p:
            raise RuntimeError(f"{name}: measured bubble {ticks} ticks, not {claim} on every rank")
    else:
        claim = Fraction(p - 1, 2 * m + p - 1) if name == "interleaved" else None
        if p > 1 and not max(ticks) < one_f_one_b:
            raise RuntimeError(f"{name}: bubble {max(ticks)} is not below 1F1B's {one_f_one_b}")
    return name, ticks, claim, seconds, peaks, sum(sends), slots, length


def draw(row, length, v, p):
    """One cell per tick: F3 = forward of micro-batch 3; lower case: the rank's second stage;
    a full backward B takes two ticks (B3 ==); . idle."""
    cells = [" ."] * length
    for start, kind, mb, s in row:
        label = f"{kind if s < p else kind.lower()}{mb}"
        cells[start : start + TICKS[kind]] = [label] + ["=="] * (TICKS[kind] - 1)
    return " ".join(f"{c:>3}" for c in cells)


def print_table(rows, args, ctx):
    print0(
        f"{'schedule':12} {'bubble per rank, ticks (measured)':36} {'claimed':>8} "
        f"{'seconds (wall)':24} {'held (micro-batches)':24} sends/step"
    )
    for name, ticks, claim, seconds, peaks, sends, *_ in rows:
        print0(
            f"{name:12} {' '.join(f'{float(t):4.0%}' for t in ticks):36} "
            f"{f'{float(claim):.0%}' if claim is not None else '-':>8} "
            f"{' '.join(f'{s:4.0%}' for s in seconds):24} "
            f"{' '.join(f'{h:g}' for h in peaks):24} {sends}"
        )
    if args.gantt:
        for name, *_, slots, length in rows:
            print0(gantt(name, slots))
    print0(
        f"OK: {', '.join(r[0] for r in rows)} on {ctx.world_size} rank(s) x "
        f"{args.microbatches} micro-batches: losses and parameters of {args.steps} steps equal "
        f"single-process training; 1F1B's bubble is (p-1)/(m+p-1) as measured, the others' below"
    )


def gantt(name, slots):
    lines = [
        "```mermaid",
        "gantt",
        f"    title {name}, in ticks",
        "    dateFormat X",
        "    axisFormat %S",
    ]
    for rank, row in enumerate(slots):
        lines.append(f"    section rank {rank}")
        for start, kind, mb, s in row:
            lines.append(f"    {kind}{mb} stage {s} :{start}, {start + TICKS[kind]}")
    return "\n".join(lines + ["```"])


def check_sizes(names, args, ctx):
    p, m = ctx.world_size, args.microbatches
    v = max(SCHEDULES[name][1] for name in names)
    ctx.require(args.n_layer >= p * v, f"--n-layer {args.n_layer}: fewer than {p * v} stages")
    ctx.require(args.batch_size % m == 0, f"--batch-size must be a multiple of {m} micro-batches")
    ctx.require(args.n_embd % args.n_head == 0, "--n-embd must be a multiple of --n-head")
    ctx.require(
        m >= 2 * p
        or not {"1f1b", "dualpipev"} & set(names)
        or ("dualpipev" not in names and m >= p),
        f"--microbatches {m}: 1F1B needs at least {p} (the stages), DualPipeV {2 * p}",
    )


def check_step(step, x, y, losses, models, reference, ref_opt, ids, args, ctx):
    """The same step of the whole model in this process: its loss must equal the pipeline's,
    and this rank's parameters the whole model's."""
    ref_loss = loss_fn(reference(x), y)
    ref_loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    n = len(ids) * ctx.world_size
    mine = torch.stack(losses).mean() if n - 1 in ids else torch.zeros((), device=ctx.device)
    loss = mine.clone()
    dist.all_reduce(loss)  # the loss is known where the last stage is, zeros elsewhere
    if abs(loss.item() - ref_loss.item()) > args.tol:
        raise RuntimeError(
            f"step {step}: the pipeline's loss {loss.item():.6f} differs from single-process "
            f"training's {ref_loss.item():.6f}"
        )
    ref_params = dict(reference.named_parameters(remove_duplicate=False))  # lm_head.weight too
    for model in models:
        for name, param in model.named_parameters():
            diff = (param - ref_params[name]).abs().max().item()
            if diff > args.tol:
                raise RuntimeError(
                    f"step {step}: rank {ctx.rank}'s {name} differs from single-process training "
                    f"by {diff:.2e}"
                )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--schedule", choices=[*SCHEDULES, "all"], default="all")
    parser.add_argument(
        "--microbatches", type=int_in(1, 1024), default=None, help="default: 2 per rank"
    )
    parser.add_argument(
        "--batch-size", type=int_in(1, 4096), default=None, help="default: 2 per micro-batch"
    )
    parser.add_argument("--steps", type=int_in(1, 10_000), default=2)
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.2)
    parser.add_argument(
        "--tol", type=float_in(0, 1), default=2e-5, help="largest difference accepted (float32)"
    )
    parser.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0)
    parser.add_argument("--gantt", action="store_true", help="print each timeline as Mermaid")
    # 16 blocks: 2 stages on each of up to 8 ranks; tiny, so that a run takes seconds on one core
    add_model_args(parser, n_layer=16, n_embd=32, n_head=2, block_size=16)
    run(main, parser.parse_args())
