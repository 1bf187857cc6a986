"""What FSDP2 sends, and when: the all_gathers and reduce_scatters of one step per rank, as text.

reshard_after_forward=True frees a block's full parameters after its forward and all_gathers them
again in backward; False keeps them (the root's default, None, means False for the root, True for
the others: fully_shard's docstring). set_modules_to_forward_prefetch / _backward_prefetch ask a
block to issue the all_gathers of the next blocks itself, earlier; without them FSDP prefetches in
backward only, one block ahead (docstrings in torch/distributed/fsdp/_fully_shard/, torch 2.13).
torch.profiler records FSDP's labelled regions ("FSDP::all_gather (blocks.0)", ...): the lesson
profiles the last step of three settings, prints its collectives on a time line (--chart: a Mermaid
gantt), checks their counts, which hook prefetched which, and that all three train to one process's
parameters. The regions are when the CPU issues the work; a GPU runs the kernels later, on their own
streams (prof.export_chrome_trace shows both: profiler docs).

    torchrun --nproc_per_node=2 fsdp_basics/fsdp_overlap.py
    python fsdp_basics/fsdp_overlap.py --nproc 3 --width 512 --depth 6

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html, .../profiler.html
"""

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.profiler import ProfilerActivity, profile

from launch import charts
from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run
from toy import BlockMLP, make_data, rank_batch, train_one_process


def main(args, ctx):
    ctx.require(
        args.batch % ctx.world_size == 0,
        f"--batch {args.batch} must divide by {ctx.world_size} ranks",
    )
    x, y = (t.to(ctx.device) for t in make_data(args.batch * args.steps))
    torch.manual_seed(0)
    start = BlockMLP(args.width, args.depth).to(ctx.device)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    variants = {"reshard_after_forward=True": (True, 0), "reshard_after_forward=False": (False, 0)}
    variants[f"True, explicit prefetch of {args.prefetch}"] = (True, args.prefetch)
    results = {name: train(args, ctx, start, mesh, x, y, *v) for name, v in variants.items()}
    print_timelines(results, args, ctx)
    worst = check_same_parameters(results, start, x, y, args, ctx)
    check_counts(results, variants, args, ctx)
    print0(
        f"OK: FSDP2 with reshard_after_forward True, False and explicit prefetching on "
        f"{ctx.world_size} rank(s): all_gathers, reduce_scatters and prefetches as expected, all "
        f"train to one process's parameters (max diff {worst:.1e})"
    )


def train(args, ctx, start, mesh, x, y, reshard, prefetch):
    """Train an FSDP2 copy of start; return it and the FSDP regions of its last step's profile."""
    model = copy.deepcopy(start)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh)  # the root (inp, head): reshard_after_forward None, i.e. False
    if prefetch:
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):  # forward: the next ones; backward: the previous ones
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + prefetch])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch) : i][::-1])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    profiler = profile(activities=[ProfilerActivity.CPU])  # the last step only
    for step in range(args.steps):
        xb, yb = rank_batch(x, y, step, args.batch, ctx)
        with profiler if step == args.steps - 1 else contextlib.nullcontext() as prof:
            F.cross_entropy(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    return model, regions(prof)


# ---- The lesson ends here. What follows is how it checks itself. ----

# FSDP's regions that the checks read; pre_forward / pre_backward: the hook that issued a prefetch
KINDS = ("FSDP::all_gather", "FSDP::post_backward_reduce", "FSDP::forward_prefetch")
KINDS += ("FSDP::backward_prefetch", "FSDP::pre_forward", "FSDP::pre_backward", "FSDP::post_")
HOOKS = ("FSDP::pre_forward", "FSDP::pre_backward")


def regions(prof):
    """[(name, start ms, end ms)] of FSDP's regions, in ms from the step's first event, by start."""
    events = [e for e in prof.events() if e.name.startswith(KINDS)]
    t0 = min((e.time_range.start for e in prof.events()), default=0)
    return sorted(
        ((e.name, (e.time_range.start - t0) / 1e3, (e.time_range.end - t0) / 1e3) for e in events),
        key=lambda row: row[1:],
    )


def collectives(rows):
    """The all_gathers and reduce_scatters (one region each, named after their module; the root's
    has no name) as (what, start, end, by): by, for an all_gather inside a prefetch region,
    ("forward" or "backward", the module whose pre_forward / pre_backward hook issued it), else
    None. The hooks issue a prefetch inside their region (FSDP's own, one block ahead:
    _fsdp_param_group.py) or just after it (the explicit lists: _fsdp_state.py, torch 2.13); the
    hooks run one after the other on this thread: the issuer is the last hook begun before."""
    out = []
    for name, a, b in rows:
        for label, what in (
            ("FSDP::all_gather", "all_gather"),
            ("FSDP::post_backward_reduce", "reduce_scatter"),
        ):
            if name == label or name.startswith(label + " ("):
                prefetch = [n for n, pa, pb in rows if "_prefetch for" in n and pa <= a <= b <= pb]
                hooks = [(pa, n) for n, pa, _ in rows if n.split(" (")[0] in HOOKS and pa <= a]
                by = None
                if prefetch and hooks:  # the hook that began last before it issued it
                    hook = max(hooks)[1]
                    by = (prefetch[0][6:].split("_")[0], module(hook, hook.split(" (")[0]))
                out.append((f"{what} {module(name, label)}", a, b, by))
    return out


def module(name, label):
    """The module a region is named after: "FSDP::all_gather (blocks.0)" -> blocks.0; none: root."""
    return name[len(label) :].strip(" ()") or "root"


def print_timelines(results, args, ctx, width=40):
    for name, (_, rows) in results.items():
        found = collectives(rows)
        gathers = sum(w.startswith("all_gather") for w, *_ in found)
        counts = f"{gathers} all_gathers, {len(found) - gathers} reduce_scatters"
        print0(f"\n{name}: {counts}; ms from the step's start")
        end = max((b for _, _, b, _ in found), default=0) or 1.0
        lines = []
        for what, a, b, by in found:
            lo, hi = round(a / end * width), round(b / end * width)
            bar = " " * lo + ("=" if what.startswith("all") else "~") * max(1, hi - lo)
            by = f"prefetched by {by[1]} ({by[0]})" if by else ""
            lines.append(f"  {what:26s} {a:7.2f} .. {b:7.2f} |{bar:{width}s}| {by}")
        print_in_order("\n".join(lines))
    print0(
        "(= all_gather, ~ reduce_scatter: when the CPU issues them, inside FSDP's profiler regions)"
    )
    if ctx.rank == 0 and args.chart:
        write_chart(results, args.chart)


def write_chart(results, path):
    """Rank 0's last step per variant as a gantt (us): each block's compute, FSDP's collectives."""
    gantts = []
    for name, (_, rows) in results.items():
        computed = []
        for n, _, b in rows:  # a block computes from the end of its pre-hook to its first post-hook
            what, _, block = n.removeprefix("FSDP::pre_").partition(" ")  # block: "(blocks.1)"
            if n.startswith("FSDP::pre_") and block:
                post = f"FSDP::post_{what}"
                ends = [a for m, a, _ in rows if m.startswith(post) and m.endswith(block)]
                computed.append((f"{what} {block[1:-1]}", b * 1e3, min(ends, default=b) * 1e3))
        issued = [(what, a * 1e3, b * 1e3) for what, a, b, _ in collectives(rows)]
        sections = {"compute": computed, "collectives": issued}
        gantts.append(charts.gantt(f"rank 0, last step, {name}", sections))
    charts.write(path, *gantts)


def expected_prefetches(depth, reshard, prefetch, one):
    """[(block, "forward" or "backward", the block whose hook issues its all_gather)], in the order
    issued. With explicit prefetching of p, block i's forward issues blocks i+1..i+p and its
    backward blocks i-1..i-p, nearest first, each gathered by the first hook that lists it;
    without, FSDP prefetches in backward only, one block ahead; the root's pre-backward issues the
    last block (when it was resharded). At 1 rank nothing is gathered (_fsdp_param_group.py)."""
    if one:
        return []
    ahead = [(f"blocks.{j}", "forward", f"blocks.{max(0, j - prefetch)}") for j in range(1, depth)]
    p = prefetch or 1
    behind = [(f"blocks.{j}", "backward", f"blocks.{min(depth - 1, j + p)}") for j in range(depth)]
    behind[-1] = (f"blocks.{depth - 1}", "backward", "root")
    return ahead * bool(prefetch) + behind[::-1] * reshard  # forward up the blocks, backward down


def directions(prefetches):
    """(forward-prefetched, backward-prefetched) all_gathers in a list of expected_prefetches'."""
    return [sum(p[1] == d for p in prefetches) for d in ("forward", "backward")]


def check_counts(results, variants, args, ctx):
    """Per rank and variant: one all_gather per block and root in forward, one more per block in
    backward when it was resharded; one reduce_scatter per block and root; and the prefetches:
    which hook issued which block's all_gather, forward and backward, in which order
    (expected_prefetches)."""
    failures, one = [], ctx.world_size == 1  # at 1 rank FSDP has nothing to gather
    for name, (_, rows) in results.items():
        reshard, prefetch = variants[name]
        found = collectives(rows)
        issued = [(w.split()[1], *by) for w, _, _, by in found if by]  # in the order issued
        expected = expected_prefetches(args.depth, reshard, prefetch, one)
        gathers = sum(w.startswith("all_gather") for w, *_ in found)
        got = (gathers, len(found) - gathers, *directions(issued))
        gathers = 0 if one else args.depth + 1 + args.depth * reshard
        want = (gathers, args.depth + 1, *directions(expected))
        if got != want:
            failures.append(
                f"{name}: {got[0]} all_gathers, {got[1]} reduce_scatters, {got[2]} forward-"
                f"prefetched, {got[3]} backward-prefetched; expected {', '.join(map(str, want))}"
            )
        elif issued != expected:
            show = [", ".join(f"{b} by {h} ({d})" for b, d, h in g) for g in (issued, expected)]
            failures.append(f"{name}: prefetched {show[0]}; expected {show[1]}")
    print_in_order(f"counts as expected: {'no: ' + '; '.join(failures) if failures else 'yes'}")
    dist.barrier()
    if failures:
        raise RuntimeError(f"[rank {ctx.rank}] " + "; ".join(failures))


def check_same_parameters(results, start, x, y, args, ctx):
    """One process, plain torch, the whole global batch each step (toy.train_one_process, Adam).
    float32 on one device: only the summation order differs; fsdp_minimal.py measured 1e-7 after
    10 steps, 8e-6 after 50: bound 1e-4 (TF32 is off by default on GPUs, docs notes/cuda.html;
    with it on, this may not hold)."""
    single = copy.deepcopy(start)
    train_one_process(single, x, y, args.batch, args.steps, args.lr)
    # full_tensor() all_gathers a DTensor's shards into the whole tensor: every rank calls it
    diffs = {}
    for name, (model, _) in results.items():
        pairs = zip(model.parameters(), single.parameters())
        diffs[name] = max((p.full_tensor() - q).abs().max().item() for p, q in pairs)
    for name, d in diffs.items():
        print0(f"{name}: max |parameter - one process| {d:.1e} (bound 1e-4)")
    bad = [name for name, d in diffs.items() if not d <= 1e-4]
    if bad:
        raise RuntimeError(
            f"[rank {ctx.rank}] parameters differ from one process's beyond 1e-4: {bad}"
        )
    return max(diffs.values())


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--width", type=int_in(1, 4096), default=128)
    parser.add_argument("--depth", type=int_in(1, 64), default=3)
    parser.add_argument("--batch", type=int_in(1, 65536), default=48, help="global, divisible by N")
    parser.add_argument("--steps", type=int_in(1, 1000), default=3)
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=1e-2)
    parser.add_argument("--prefetch", type=int_in(1, 64), default=2, help="blocks prefetched ahead")
    parser.add_argument("--chart", type=charts.path, help="rank 0's timelines as gantts (.md)")
    run(main, parser.parse_args())
