"""Planning FSDP memory for 8..1024 ranks you do not have: a fake process group in one process.

torch's tests ship a fake backend (torch/testing/_internal/distributed/fake_pg.py: a testing API,
no stability promise): `init_process_group("fake", store=FakeStore(), rank=r, world_size=N)` gives
one process the view of rank r of N. Nothing is sent: every collective returns at once (all_gather
copies the local input into every slot, reduce_scatter keeps its own chunk: FakeProcessGroup.hpp).
`fully_shard` only needs the mesh's size and rank to cut its shards, so a model built on the meta
device (shapes, no memory) can be sharded N ways for any N, and each rank's shards read. That runs
in a fresh child process: a process holds one default group, and this one holds the real one. The
real ranks shard a small model for real and check that each holds, after a step, exactly the
bytes the plan predicted. Then what FSDP does not shard: activations, per token.

    torchrun --nproc_per_node=4 fsdp_basics/fsdp_memory_plan.py
    python fsdp_basics/fsdp_memory_plan.py --nproc 3 --width 8192 --depth 48 --tokens 8192

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
      https://pytorch.org/docs/stable/meta.html
      https://pytorch.org/docs/stable/autograd.html#saved-tensors-hooks
"""

import math
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore  # testing API (see above)
from tqdm import tqdm

from launch import charts
from launch.dist_setup import int_in, lesson_parser, print0, run
from toy import Block, BlockMLP, make_data, step_bytes


def plan(width, depth, ranks_of):
    """{(N, r): [param, grad, Adam bytes] rank r of N will hold}, for (N, r) in ranks_of. Call it in
    a process that has no process group (see main): each (N, r) gets a fake default group."""
    held = {}
    for n, r in tqdm(ranks_of, "planning", unit="rank", disable=None):  # stderr, on a terminal
        dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=n)  # no peers
        try:
            with torch.device("meta"):
                planned = BlockMLP(width, depth)
            mesh = init_device_mesh(
                "cpu", (n,)
            )  # the plan's mesh: only its size and our rank matter
            for block in planned.blocks:  # the taught step: per block, then the root, as for real
                fully_shard(block, mesh=mesh)
            fully_shard(planned, mesh=mesh)
            shards = [p.to_local() for p in planned.parameters()]  # rank r's rows, on meta
            # FSDP2 stores each shard padded to ceil(rows / N) rows (a meta storage knows its
            # size); its gradients are views of one reduce_scatter output of padded shards
            # (_fsdp_collectives.py). Adam: exp_avg and exp_avg_sq are zeros_like(param), the
            # unpadded local shard, plus a float32 `step` per parameter (torch/optim/adam.py).
            stored = sum(s.untyped_storage().nbytes() for s in shards)
            held[n, r] = [stored, stored, sum(2 * s.numel() * s.element_size() + 4 for s in shards)]
        finally:
            dist.destroy_process_group()
    return held


def main(args, ctx):
    sizes = [2**k for k in range(3, int(math.log2(args.max_ranks)) + 1)]  # 8, 16, ..., max
    if ctx.rank == 0:  # the planner: a fresh process (spawn), where the fake group is the default
        planner = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        big = planner.submit(plan, args.width, args.depth, [(n, 0) for n in [1, *sizes]])
        ranks = [(ctx.world_size, r) for r in range(ctx.world_size)]
        small = planner.submit(plan, args.real_width, 2, ranks)
    # Meanwhile the real thing, at this world size: the small model sharded for real, one Adam step.
    model = BlockMLP(args.real_width, 2).to(ctx.device)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = (t.to(ctx.device) for t in make_data(16, seed=ctx.rank))
    measured = step_bytes(model, torch.optim.Adam(model.parameters(), lr=1e-3), x, y)
    held = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(measured, held, dst=0)  # pickles: fine between our own ranks
    if ctx.rank != 0:  # done: only rank 0 waits for the planner, so no collective can time out
        return
    big, small = big.result(), small.result()
    planner.shutdown()
    # Activations, which FSDP does not shard: what one block keeps for backward, per token count.
    activations = saved_for_backward(Block(args.real_width).to(ctx.device), (16, 32, 64), ctx)
    failures = check_activations(activations, args.real_width)
    print_plan(big, args, sizes)
    print_strategies(big, args, sizes)
    failures += check_plan_against_formula(big, args.width, args.depth, sizes)
    failures += check_plan_against_real_run(small, held, ctx)
    if failures:
        raise RuntimeError("; ".join(failures))
    print0(
        f"OK: fully_shard on a fake group planned {args.depth} blocks of width {args.width} for "
        f"{sizes[0]}..{sizes[-1]} ranks as the ceil-rows formula says, and predicted to the byte "
        f"what each of {ctx.world_size} real ranks holds after a step; activations, which FSDP "
        f"does not shard, are 8 x width B per token and block"
    )


def saved_for_backward(block, token_counts, ctx):
    """[(tokens, bytes)]: what autograd keeps for backward in one forward of block, its parameters
    left out (the weight is saved for the input's gradient, but it is no activation)."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen = []
    for tokens in token_counts:
        saved = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        # requires_grad, as inside a model: then the weight is saved too (left out above)
        x = torch.randn(tokens, block.fc.in_features, device=ctx.device, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x).sum().backward()
        seen.append((tokens, sum(saved.values())))
    return seen


# ---- The lesson ends here. What follows is how it checks itself. ----


def formula(width, depth, n, r):
    """Rank r of N, by hand: dim 0 cut in chunks of ceil(rows/N) rows (torch.chunk), each rank's
    storage padded to one chunk."""
    with torch.device("meta"):
        shapes = [p.shape for p in BlockMLP(width, depth).parameters()]
    held = [0, 0, 0]
    for shape in shapes:
        rows, row = shape[0], math.prod(shape[1:])
        chunk = -(-rows // n)
        mine = max(0, min(chunk, rows - r * chunk))
        held = [held[0] + 4 * chunk * row, held[1] + 4 * chunk * row, held[2] + 8 * mine * row + 4]
    return held


def check_plan_against_formula(big, width, depth, sizes):
    wrong = [
        f"N={n}: plan {big[n, 0]} != formula {formula(width, depth, n, 0)}"
        for n in sizes
        if big[n, 0] != formula(width, depth, n, 0)
    ]
    return [f"fake-group plan differs from the ceil-rows formula: {'; '.join(wrong)}"] * bool(wrong)


def check_plan_against_real_run(small, held, ctx):
    """Bytes are counts: equal, not close, on any device (the state is fp32 on every one)."""
    for r, measured in enumerate(held):
        print0(
            f"[rank {r}] params, grads, Adam bytes: planned {small[ctx.world_size, r]}, "
            f"measured after a step {measured}"
        )
    return [
        f"rank {r} holds {m} after a step, the plan said {small[ctx.world_size, r]}"
        for r, m in enumerate(held)
        if m != small[ctx.world_size, r]
    ]


def check_activations(seen, width):
    """8 B per token and width unit: the fp32 input of the Linear (addmm saves it for the weight's
    grad) and the output of tanh (its backward uses it); the residual add saves nothing
    (torchgen/packaged/autograd/derivatives.yaml, in the wheel). Byte counts: equal, not close."""
    print0(
        f"one Block of width {width} keeps for backward: "
        + ", ".join(f"{t} tokens {b:,} B" for t, b in seen)
        + f" (8 x tokens x width: {', '.join(f'{8 * t * width:,}' for t, _ in seen)})"
    )
    return [f"activations {seen} != 8 x tokens x {width} B"] * any(
        b != 8 * t * width for t, b in seen
    )


def print_plan(big, args, sizes):
    with torch.device("meta"):
        n_params = sum(p.numel() for p in BlockMLP(args.width, args.depth).parameters())
    # the activations by the formula check_activations checks
    gib, acts = 2**30, 8 * args.width * args.tokens * args.depth
    print0(
        f"plan: {args.depth} blocks of width {args.width}, {n_params:,} parameters, "
        f"{16 * n_params / gib:.1f} GiB of fp32 params, grads and Adam state in one process; GiB "
        f"per rank (rank 0: it holds the most)"
    )
    print0(
        f"{'N':>6}{'params':>9}{'grads':>9}{'Adam':>9}{'state':>9}{'activations':>13}{'total':>9}"
        f"  (activations: {args.tokens} tokens per rank)"
    )
    for n in sizes:
        p, g, a = (b / gib for b in big[n, 0])
        state, a_gib = p + g + a, acts / gib
        print0(f"{n:>6}{p:>9.3f}{g:>9.3f}{a:>9.3f}{state:>9.3f}{a_gib:>13.3f}{state + a_gib:>9.3f}")
    over = [n for n in sizes if sum(big[n, 0]) < acts]
    where = f"from N = {over[0]} on they outweigh the sharded state" if over else "they stay below"
    print0(
        f"activations are not sharded: {where} (fewer tokens per rank, activation checkpointing or "
        f"sequence/context parallelism shrink them)"
    )


def print_strategies(big, args, sizes):
    """Params, grads and Adam per rank by strategy, from the plans at 1 rank (nothing sharded) and
    at N: ZeRO-1 shards Adam's state, ZeRO-2 the grads too, ZeRO-3 (FSDP) the params too (each as
    FSDP2's padded row shards; ZeRO: arxiv.org/abs/1910.02054); HSDP shards over the first size
    (a node of 8 GPUs) and replicates across, so it holds what ZeRO-3 holds at that size."""
    (p, g, a), node = big[1, 0], sizes[0]
    names = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", f"HSDP({node})"]
    gib = {
        n: [p + g + a, p + g + big[n, 0][2], p + sum(big[n, 0][1:]), sum(big[n, 0])] for n in sizes
    }
    gib = {n: [round(b / 2**30, 3) for b in [*held, sum(big[node, 0])]] for n, held in gib.items()}
    print0(
        f"GiB per rank of params, grads and Adam, by strategy (HSDP: {node} ranks a shard group)"
    )
    print0(f"{'N':>6}" + "".join(f"{name:>10}" for name in names))
    for n in sizes:
        print0(f"{n:>6}" + "".join(f"{b:>10.3f}" for b in gib[n]))
    if args.chart:  # rank 0 alone gets here
        lines = {name: [gib[n][i] for n in sizes] for i, name in enumerate(names)}
        title = f"params + grads + Adam per rank, {args.depth} blocks of width {args.width}"
        ranks = [str(n) for n in sizes]  # doubling: equally spaced categories, a log scale
        chart = charts.xychart(title, "ranks (N), doubling", ranks, "GiB per rank", lines)
        charts.write(args.chart, chart)


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    add = parser.add_argument
    add("--width", type=int_in(1, 1 << 20), default=16384, help="planned model: block width")
    add("--depth", type=int_in(1, 1024), default=16, help="planned model: number of blocks")
    add("--tokens", type=int_in(1, 1 << 24), default=4096, help="tokens per rank (activations)")
    # The fake group's set-up grows with N (measured on CPU: ~1.5 s at 1024, ~34 s at 16384).
    add("--max-ranks", type=int_in(8, 8192), default=1024, help="plan for 8, 16, ... this many")
    add(
        "--real-width", type=int_in(1, 4096), default=62, help="the model really sharded (62: pads)"
    )
    add("--chart", type=charts.path, help="GiB per rank by strategy, a Mermaid chart (.md)")
    run(main, parser.parse_args())
