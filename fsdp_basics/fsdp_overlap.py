"""What FSDP2 sends, and when: the all_gathers and reduce_scatters of one step per rank, as text.

fully_shard per block, then the root. reshard_after_forward=True frees a block's full parameters
after its forward and all_gathers them again in backward; False keeps them, no second all_gather
(the root's default, None, means False for the root, True for the others: fully_shard's docstring).
set_modules_to_forward_prefetch / set_modules_to_backward_prefetch ask a block to issue the
all_gathers of the next blocks itself, earlier from the CPU; a list of two or more overlaps more and
takes more memory (their docstrings, torch/distributed/fsdp/_fully_shard/_fully_shard.py, torch 2.13).
torch.profiler records FSDP's own labelled regions ("FSDP::all_gather (blocks.0)", ...: record_function
in torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py), so the lesson profiles the last step,
counts the all_gathers and reduce_scatters and prints them on a time line, for three settings; all
three must train to one process's parameters. The regions are when the CPU issues the work; on a GPU
the kernels run later on their own streams: prof.export_chrome_trace(path) shows both (profiler docs).
At 1 rank FSDP skips the all_gather (unshard in _fsdp_param_group.py: `if world_size == 1`).

    torchrun --nproc_per_node=2 fsdp_basics/fsdp_overlap.py
    python fsdp_basics/fsdp_overlap.py --nproc 3 --width 512 --depth 6

Docs: https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
      https://pytorch.org/docs/stable/profiler.html
"""

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.profiler import ProfilerActivity, profile

from launch.dist_setup import lesson_parser, print0, print_in_order, run, test_flags
from toy import BlockMLP, make_data, rank_batch, train_one_process

KINDS = (
    "FSDP::all_gather",
    "FSDP::post_backward_reduce",
    "FSDP::forward_prefetch",
    "FSDP::backward_prefetch",
)


def main(args, ctx):
    ctx.require(
        min(args.width, args.depth, args.steps) >= 1 and args.prefetch >= 1,
        "--width, --depth, --steps and --prefetch must be at least 1",
    )
    ctx.require(
        args.batch % ctx.world_size == 0,
        f"--batch {args.batch} must divide by {ctx.world_size} ranks",
    )
    x, y = (t.to(ctx.device) for t in make_data(args.batch * args.steps))
    torch.manual_seed(0)
    start = BlockMLP(args.width, args.depth).to(ctx.device)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    variants = {
        "reshard_after_forward=True": (True, 0),
        "reshard_after_forward=False": (False, 0),
        f"True, explicit prefetch of {args.prefetch}": (True, args.prefetch),
    }
    results = {name: train(args, ctx, start, mesh, x, y, *v) for name, v in variants.items()}
    print_timelines(results)
    worst = check_same_parameters(results, start, x, y, args, ctx)
    check_counts(results, args, ctx)
    print0(
        f"OK: FSDP2 with reshard_after_forward True, False and explicit prefetching on {ctx.world_size} rank(s):"
        f" all_gathers and reduce_scatters as expected, all train to one process's parameters "
        f"(max diff {worst:.1e})"
    )


def train(args, ctx, start, mesh, x, y, reshard, prefetch):
    """Train an FSDP2 copy of start; return it and the FSDP regions of its last step's profile."""
    model = copy.deepcopy(start)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard and not args.ignore_reshard)
    fully_shard(model, mesh=mesh)  # the root (inp, head): reshard_after_forward None, i.e. False
    if prefetch:
        blocks = list(model.blocks)
        for i, block in enumerate(
            blocks
        ):  # forward: the next blocks; backward: the previous ones, nearest first
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + prefetch])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch) : i][::-1])
    if (
        args.no_grad_sync
    ):  # for the tests: no reduce_scatter (FSDP2's no_sync: gradient accumulation)
        model.set_requires_gradient_sync(False)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        xb, yb = rank_batch(x, y, step, args.batch, ctx)
        with (
            profile(activities=[ProfilerActivity.CPU])
            if step == args.steps - 1
            else contextlib.nullcontext() as prof
        ):
            F.cross_entropy(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    return model, regions(prof)


def regions(prof):
    """[(name, start ms, end ms)] of FSDP's regions, in ms from the first event of the step, by start."""
    events = [e for e in prof.events() if e.name.startswith(KINDS)]
    t0 = min((e.time_range.start for e in prof.events()), default=0)
    return sorted(
        ((e.name, (e.time_range.start - t0) / 1e3, (e.time_range.end - t0) / 1e3) for e in events),
        key=lambda row: row[1:],
    )


def collectives(rows):
    """The all_gathers and reduce_scatters (one region each, named after their module; the root's has no
    name) as (what, start, end, prefetch), prefetch: the prefetch region that issued it, if any."""
    out = []
    for name, a, b in rows:
        for label, what in (
            ("FSDP::all_gather", "all_gather"),
            ("FSDP::post_backward_reduce", "reduce_scatter"),
        ):
            if name == label or name.startswith(label + " ("):
                module = name[len(label) :].strip(" ()") or "root"
                by = [
                    n.split(" for ")[0][6:]
                    for n, pa, pb in rows
                    if "prefetch for" in n and pa <= a and b <= pb
                ]
                out.append((f"{what} {module}", a, b, by[0] if by else ""))
    return out


def print_timelines(results, width=40):
    for name, (_, rows) in results.items():
        found = collectives(rows)
        print0(
            f"\n{name}: {sum(w.startswith('all_gather') for w, *_ in found)} all_gathers, "
            f"{sum(w.startswith('reduce') for w, *_ in found)} reduce_scatters; ms from the step's start"
        )
        end = max((b for _, _, b, _ in found), default=0) or 1.0
        lines = []
        for what, a, b, by in found:
            lo = round(a / end * width)
            bar = " " * lo + ("=" if what.startswith("all") else "~") * max(
                1, round(b / end * width) - lo
            )
            lines.append(
                f"  {what:26s} {a:7.2f} .. {b:7.2f} |{bar:{width}s}| {by and 'issued by ' + by}"
            )
        print_in_order("\n".join(lines))
    print0(
        "(= all_gather, ~ reduce_scatter: when the CPU issues them, inside FSDP's profiler regions)"
    )


def check_counts(results, args, ctx):
    """Per rank and variant: one all_gather per block and root in forward, one more per block in backward
    when it was resharded; one reduce_scatter per block and root; with explicit forward prefetching, every
    block after the first all_gathered from a prefetch, without it none. At 1 rank no all_gather."""
    depth, failures = args.depth, []
    for name, (_, rows) in results.items():
        found = collectives(rows)
        reshard = "True" in name  # the variant asked for it
        gathers = sum(w.startswith("all_gather") for w, *_ in found)
        reduces = sum(w.startswith("reduce") for w, *_ in found)
        ahead = sum(by == "forward_prefetch" for w, _, _, by in found)
        one = ctx.world_size == 1  # nothing to gather: one rank holds every shard
        want = (
            0 if one else depth + 1 + depth * reshard,
            depth + 1,
            0 if one else (depth - 1) * ("prefetch" in name),
        )
        if (gathers, reduces, ahead) != want:
            failures.append(
                f"{name}: {gathers} all_gathers, {reduces} reduce_scatters, {ahead} forward-"
                f"prefetched; expected {want[0]}, {want[1]}, {want[2]}"
            )
    print_in_order(f"counts as expected: {'no: ' + '; '.join(failures) if failures else 'yes'}")
    dist.barrier()
    if failures:
        raise RuntimeError(f"[rank {ctx.rank}] " + "; ".join(failures))


def check_same_parameters(results, start, x, y, args, ctx):
    """One process, plain torch, the whole global batch each step (toy.train_one_process, Adam). float32 on
    one device: only the summation order differs; fsdp_minimal.py measured 1e-7 after 10 steps, 8e-6 after
    50: bound 1e-4 (TF32 is off by default on GPUs, docs notes/cuda.html; with it on, this may not hold)."""
    single = copy.deepcopy(start)
    train_one_process(single, x, y, args.batch, args.steps, args.lr)
    # full_tensor() all_gathers a DTensor's shards into the whole tensor: every rank calls it
    diffs = {
        name: max(
            (p.full_tensor() - q).abs().max().item()
            for p, q in zip(model.parameters(), single.parameters())
        )
        for name, (model, _) in results.items()
    }
    print0(
        "\n".join(
            f"{name}: max |parameter - one process| {d:.1e} (bound 1e-4)"
            for name, d in diffs.items()
        )
    )
    bad = [name for name, d in diffs.items() if not d <= 1e-4]
    if bad:
        raise RuntimeError(
            f"[rank {ctx.rank}] parameters differ from one process's beyond 1e-4: {bad}"
        )
    return max(diffs.values())


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument(
        "--batch", type=int, default=48, help="global batch, divisible by the world size"
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument(
        "--prefetch", type=int, default=2, help="blocks each block prefetches (explicit variant)"
    )
    broken = test_flags(parser)
    broken.add_argument(
        "--ignore-reshard",
        action="store_true",
        help="reshard_after_forward=False everywhere: the all_gather count check fails",
    )
    broken.add_argument(
        "--no-grad-sync",
        action="store_true",
        help="set_requires_gradient_sync(False): no reduce_scatter, the parameters differ",
    )
    run(main, parser.parse_args())
