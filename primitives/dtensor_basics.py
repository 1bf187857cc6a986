"""DTensor: one logical tensor spread over a DeviceMesh, each rank holding its piece.

A DTensor is a global tensor plus a placement per mesh dimension: Shard(d) (split along dim d,
torch.chunk-style when it does not divide), Replicate() (a full copy on every rank) or Partial()
(every rank holds a term; the value is their sum). distribute_tensor makes one from a full tensor,
DTensor.from_local from the pieces ranks already hold, to_local gives the piece back, full_tensor
the whole. Ops on DTensors run on the pieces and say what placement comes out. Meshes themselves:
primitives/device_mesh.py; which collective each change of placement costs: dtensor_redistribute.py.

    torchrun --nproc_per_node=3 primitives/dtensor_basics.py   # 10 rows over 3 ranks: 4, 4, 2
    python primitives/dtensor_basics.py --nproc 4 --rows 8

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.
Docs: https://pytorch.org/docs/stable/distributed.tensor.html
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    rank, world, n = ctx.rank, ctx.world_size, args.rows
    ctx.require(
        (100 * n + args.cols) * n * args.cols < 2**24,
        "--rows x --cols too large for the exact float32 checks (the sum of all entries must stay "
        "below 2**24): try --rows 200 --cols 4",
    )
    torch.backends.cuda.matmul.fp32_precision = "ieee"  # no TF32: the checks below are exact
    full = 100 * torch.arange(n, device=ctx.device)[:, None]
    full = (full + torch.arange(args.cols, device=ctx.device)).float()  # where each value sits
    w = (torch.arange(args.cols * 3, device=ctx.device) % 5 - 2).float().reshape(args.cols, 3)

    mesh = init_device_mesh(ctx.device.type, (world,))
    rows = distribute_tensor(full, mesh, [Shard(0)])  # rank 0's tensor, scattered: r keeps chunk r
    w_all = distribute_tensor(w, mesh, [Replicate()])  # rank 0's tensor, broadcast to every rank
    mine = rows.to_local()  # my piece: a plain tensor
    # The same DTensor from pieces the ranks already hold (no communication). The global shape
    # cannot be guessed from uneven pieces: from_local assumes local shape x world unless told.
    size = -(-n // world)  # torch.chunk: ceil(n / world) rows each, the last ranks what is left
    piece = full[min(rank * size, n) : min((rank + 1) * size, n)]
    rebuilt = DTensor.from_local(piece, mesh, [Shard(0)], shape=full.shape, stride=full.stride())
    terms = DTensor.from_local(full * (rank + 1), mesh, [Partial()])  # the value: sum of the terms
    cols, w_rows = distribute_tensor(full, mesh, [Shard(1)]), distribute_tensor(w, mesh, [Shard(0)])

    with CommDebugMode() as op_comms:  # ops run on the pieces; the placement says what they hold
        products = rows @ w_all  # Shard(0): my rows of the product
        cols_w = cols @ w_rows  # Partial: my columns' share of every entry of the product
        total = rows.sum()  # Partial: the sum of my rows
    dtensors = {"from_local(Partial)": terms, "rows @ w": products, "Shard(1) @ Shard(0)": cols_w}
    dtensors["rows.sum()"] = total
    # The value of each: full_tensor() (a Partial's to_local() is this rank's term only).
    values = {name: d.full_tensor() for name, d in dtensors.items()}

    # One seed on every rank, as DTensor's random ops expect. On CPU each rank draws its piece from
    # its own generator: a seed per rank gives other numbers, which check_random catches. On CUDA
    # the first random op's RNG tracker copies rank 0's RNG state to every rank and logs a warning
    # (OffsetBasedRNGTracker, torch/distributed/tensor/_random.py, torch 2.13): a seed per rank is
    # overridden there, so that mistake fails on CPU only.
    torch.manual_seed(args.seed)
    noise = torch.rand_like(rows)  # a random op on a sharded DTensor: what each rank draws is below
    drawn = [round(v, 4) for v in noise.to_local().flatten()[:2].tolist()]
    print_in_order(
        f"rows {rows.placements[0]} of {tuple(rows.shape)}: local piece {tuple(mine.shape)}, "
        f"first row {mine[:1].tolist()}; noise {drawn}"
    )
    check_pieces(ctx, full, rows, mine, rebuilt, size)
    check_ops(ctx, full, w, dtensors, values, op_comms)
    print_ok(args, ctx, size, check_random(args, ctx, noise))


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_pieces(ctx, full, rows, mine, rebuilt, size):
    """My piece is my torch.chunk of the full tensor; from_local rebuilds the same DTensor;
    full_tensor gathers it."""
    want = full[min(ctx.rank * size, len(full)) : min((ctx.rank + 1) * size, len(full))]
    if not torch.equal(mine, want):
        raise RuntimeError(
            f"rank {ctx.rank}: distribute_tensor left me {tuple(mine.shape)}, torch.chunk says "
            f"{tuple(want.shape)}"
        )
    if rebuilt.shape != full.shape:  # on every rank, before a collective on mismatched shapes
        raise RuntimeError(
            f"rank {ctx.rank}: from_local gave global shape {tuple(rebuilt.shape)}, not "
            f"{tuple(full.shape)}: uneven pieces need shape= and stride="
        )
    for name, d in (("distribute_tensor", rows), ("from_local", rebuilt)):
        if not torch.equal(d.full_tensor(), full):  # an all_gather (see dtensor_redistribute.py)
            raise RuntimeError(f"rank {ctx.rank}: {name}(...).full_tensor() is not the full tensor")


def check_ops(ctx, full, w, dtensors, values, op_comms):
    """Each op's placement and value against plain torch. Exact equality: every value is an integer
    below 2**24, so float32 holds each product and partial sum exactly (IEEE 754; no TF32)."""
    world = ctx.world_size
    want = {
        "from_local(Partial)": (Partial(), full * world * (world + 1) / 2),
        "rows @ w": (Shard(0), full @ w),
        "Shard(1) @ Shard(0)": (Partial(), full @ w),
        "rows.sum()": (Partial(), full.sum()),
    }
    for name, (placement, value) in want.items():
        d, same = dtensors[name], values[name].shape == value.shape
        same = same and torch.equal(values[name], value)
        print0(f"{name}: placement {d.placements[0]}, full_tensor matches plain torch: {same}")
        if d.placements != (placement,) or not same:
            raise RuntimeError(
                f"rank {ctx.rank}: {name}: placement {d.placements[0]} (expected {placement}), "
                f"value {'equal' if same else 'not equal'} to plain torch's"
            )
    if op_comms.get_total_counts() != 0:
        raise RuntimeError(f"the three ops communicated: {op_comms.get_comm_counts()}")
    print0(
        "the three ops ran on the local pieces: 0 collectives (the Partial ones wait for a "
        "reduction)"
    )


def check_random(args, ctx, noise):
    """On CPU DTensor has no RNG tracker (OffsetBasedRNGTracker takes CUDA-like devices only,
    torch/distributed/tensor/_random.py): each rank draws its piece from its own generator, the same
    seed, so every shard starts with the same numbers. On CUDA the tracker moves each shard to its
    own offset in one Philox stream. True when every shard drew the same numbers (CPU)."""
    if ctx.device.type == "cpu":  # my piece: the first draws of a generator seeded like mine
        local = noise.to_local()
        gen = torch.Generator().manual_seed(args.seed)
        own_draw = torch.rand(local.shape, generator=gen, device="cpu")
        drew_it = torch.tensor([float(torch.equal(local, own_draw))], device=ctx.device)
        every = torch.empty(ctx.world_size, device=ctx.device)
        dist.all_gather_single(every, drew_it)  # every rank learns who failed: none prints OK alone
        if not every.all():
            raise RuntimeError(
                f"rand_like on CPU: ranks {every.eq(0).nonzero().flatten().tolist()} did not draw "
                f"what a generator seeded with --seed {args.seed} draws: seed every rank alike"
            )
        return True
    pieces = noise.full_tensor().split(-(-noise.shape[0] // ctx.world_size))  # in rank order
    repeats = [
        r for r, p in enumerate(pieces[1:], 1) if len(p) and torch.equal(p, pieces[0][: len(p)])
    ]
    if repeats:
        raise RuntimeError(
            f"rank {ctx.rank}: rand_like on {ctx.device.type}: the shards of ranks {repeats} "
            "repeat rank 0's numbers"
        )
    return False


def print_ok(args, ctx, size, same_draws):
    draws = "every shard drew the same numbers (CPU)" if same_draws else "distinct shards"
    print0(
        f"OK: {args.rows} rows over {ctx.world_size} rank(s) as Shard(0) (pieces of {size} rows, "
        "the last ones smaller), Replicate and Partial; from_local with shape, to_local, "
        f"full_tensor and three ops match plain torch; rand_like on Shard(0): {draws}"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--rows", type=int_in(1, 4096), default=10, help="rows, sharded (10: uneven at 3, 4 ranks)"
    )
    parser.add_argument("--cols", type=int_in(1, 4096), default=4, help="columns of the tensor")
    parser.add_argument(
        "--seed", type=int_in(0, 2**31 - 1), default=0, help="seed of the random draw"
    )
    run(main, parser.parse_args())
