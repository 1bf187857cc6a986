"""DeviceMesh: the ranks laid out as an n-D grid with named dimensions, a group per dimension.

init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp")) lays the world out as a
dp x tp grid, row-major: rank = i * tp + j. Along "tp" (a row) ranks split one model's layers;
along "dp" (a column) they hold replicas. get_group("tp") is my row's process group,
get_local_rank("tp") my place in it, get_coordinate() my (i, j). FSDP2, DTensor and tensor
parallelism take a mesh: distribute_tensor(t, mesh, placements), or `with mesh:` around the
call. Every rank must build the same shape, or it hangs (--mismatched-shape, below).

    torchrun --nproc_per_node=4 primitives/device_mesh.py            # 2 x 2
    python primitives/device_mesh.py --nproc 4 --tp 4                # 1 x 4
    python primitives/device_mesh.py --nproc 4 --mismatched-shape    # the pitfall

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.device_mesh.init_device_mesh
      https://pytorch.org/tutorials/recipes/distributed_device_mesh.html
"""

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    world = ctx.world_size
    tp = args.tp if args.tp is not None else (2 if world % 2 == 0 else 1)
    ctx.require(
        world % tp == 0,
        f"--tp {tp} does not divide the world size {world}: a {world}-rank mesh needs "
        f"dp x tp = {world}",
    )
    dp = world // tp
    if args.mismatched_shape:
        return mismatched_shape(ctx, dp, tp)
    mesh = init_device_mesh(ctx.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    i, j = mesh.get_coordinate()
    print0(f"mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))}:\n{mesh.mesh}")
    check_layout(mesh, ctx.rank, dp, tp)

    # A collective along each dimension: sum over my column (dp) and over my row (tp).
    mine = 100 * ctx.rank + torch.arange(args.size, device=ctx.device)
    over_dp, over_tp = mine.clone(), mine.clone()
    dist.all_reduce(over_dp, group=mesh.get_group("dp"))
    dist.all_reduce(over_tp, group=mesh.get_group("tp"))
    row = [torch.empty_like(mine) for _ in range(tp)]
    dist.all_gather(row, mine, group=mesh.get_group("tp"))

    print_in_order(
        f"coordinate {(i, j)}, dp rank {i}, tp rank {j}: sum over dp {over_dp.tolist()}, "
        f"over tp {over_tp.tolist()}, all_gather over tp {[r.tolist() for r in row]}"
    )
    check_collectives(over_dp, over_tp, row, ctx.rank, dp, tp, args.size)
    # The mesh in a DTensor call, with one placement per dimension: over dp a copy, over tp a split
    full = torch.arange(2.0 * tp * args.size, device=ctx.device)  # the same on every rank
    explicit = distribute_tensor(full, mesh, [Replicate(), Shard(0)])
    with mesh:  # or as the context: a DTensor call given no mesh takes the innermost `with`
        implicit = distribute_tensor(full, placements=[Replicate(), Shard(0)])
    check_dtensor(explicit, implicit, full, j, tp)
    print0(
        f"OK: {dp} x {tp} mesh (dp, tp): coordinates, local ranks and collectives along each "
        "dimension match numpy on the grid; distribute_tensor split over tp as torch.chunk does"
    )


def mismatched_shape(ctx, dp, tp):
    """PITFALL: the last rank builds a 1-D mesh, the others dp x tp; nothing compares shapes."""
    ctx.require(dp >= 2 and tp >= 2, "--mismatched-shape needs dp and tp >= 2 (e.g. --nproc 4)")
    shape = (ctx.world_size,) if ctx.rank == ctx.world_size - 1 else (dp, tp)
    with stop_if_stuck(ctx.rank, f"init_device_mesh{shape}"):
        mesh = init_device_mesh(ctx.device.type, shape)
    with stop_if_stuck(ctx.rank, f"distribute_tensor on the {shape} mesh"):
        d = distribute_tensor(torch.ones(4, device=ctx.device), mesh, [Replicate()] * mesh.ndim)
        d.to_local().tolist()  # waits on the host: on a GPU the broadcast is only queued
    raise RuntimeError(f"rank {ctx.rank}: the mismatched meshes did not hang")


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_layout(mesh, rank, dp, tp):
    """What the mesh object says, against the same layout by hand in numpy: rank = i * tp + j."""
    grid = np.arange(dp * tp).reshape(dp, tp)
    (i,), (j,) = np.nonzero(grid == rank)
    built = dict(names=mesh.mesh_dim_names, shape=tuple(mesh.shape), ranks=mesh.mesh.tolist())
    wanted = dict(names=("dp", "tp"), shape=(dp, tp), ranks=grid.tolist())
    if built != wanted:
        raise RuntimeError(f"the mesh built is {built}, numpy's grid is {wanted}")
    where = tuple(mesh.get_coordinate()), mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    if where != ((i, j), i, j):
        raise RuntimeError(
            f"rank {rank}: coordinate and local ranks (dp, tp) {where}; numpy says ({i}, {j})"
        )


class stop_if_stuck:
    """`with stop_if_stuck(rank, where):` a rank still inside the block after `seconds` prints one
    line and exits 1: it is blocked in C++, where no Python exception reaches it (a thread can)."""

    def __init__(self, rank, where, seconds=5.0):
        import threading  # only the pitfall needs these: imported here to keep the lesson short

        self.timer = threading.Timer(seconds, self.give_up, (rank, where, seconds))

    def __enter__(self):
        self.timer.start()

    def __exit__(self, *exc_info):
        self.timer.cancel()

    @staticmethod
    def give_up(rank, where, seconds):
        import os
        import sys
        import time

        sys.stderr.write(f"[rank {rank}] error: stuck in {where} for {seconds:g} s: hung\n")
        sys.stderr.flush()
        time.sleep(3)  # the launcher stops every rank when one exits: let the others print first
        os._exit(1)


def check_dtensor(explicit, implicit, full, j, tp):
    """Each rank holds chunk j of the full tensor (torch.chunk along dim 0) whichever way the mesh
    was given, and the pieces add up to the whole."""
    want = torch.chunk(full.cpu(), tp)[j]
    for how, d in (("given the mesh", explicit), ("under `with mesh`", implicit)):
        if not torch.equal(d.to_local().cpu(), want) or not torch.equal(d.full_tensor(), full):
            raise RuntimeError(
                f"distribute_tensor {how}: local {d.to_local().tolist()}, chunk {j} of "
                f"{tp} is {want.tolist()}"
            )


def check_collectives(over_dp, over_tp, row, rank, dp, tp, n):
    """Every rank's data by its place on the grid: sums down a column, along a row, the row."""
    grid = np.arange(dp * tp).reshape(dp, tp)
    (i,), (j,) = np.nonzero(grid == rank)
    values = 100 * grid[..., None] + np.arange(n)
    checks = [
        ("sum over dp", over_dp, values[:, j].sum(0)),
        ("sum over tp", over_tp, values[i, :].sum(0)),
        ("all_gather over tp", torch.stack(row), values[i]),
    ]
    for name, got, want in checks:
        if not np.array_equal(got.cpu().numpy(), want):
            raise RuntimeError(
                f"rank {rank}: {name} gave {got.tolist()}, numpy on the grid gives {want.tolist()}"
            )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--tp",
        type=int_in(1, 4096),
        default=None,
        help="size of the tp dimension (default: 2 if the world size is even, else 1)",
    )
    parser.add_argument("--size", type=int_in(1, 1_000_000), default=2, help="elements per rank")
    parser.add_argument(
        "--mismatched-shape",
        action="store_true",
        help="pitfall: the last rank builds a 1-D mesh, the others dp x tp; every rank hangs "
        "(stopped after 5 s with one line per rank)",
    )
    run(main, parser.parse_args())
