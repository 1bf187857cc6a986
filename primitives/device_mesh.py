"""DeviceMesh: the ranks laid out as an n-D grid with named dimensions, a group per dimension.

init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp")) arranges the world
as a dp x tp grid, row-major: rank = i * tp + j. Along "tp" (a row) ranks split one
model's layers (tensor parallel); along "dp" (a column) ranks hold replicas (data
parallel). mesh.get_group("tp") is the process group of my row, get_local_rank("tp")
my place in it, get_coordinate() my (i, j). FSDP2, DTensor and tensor parallelism all
take a mesh; torchtitan builds every parallelism from one.

    torchrun --nproc_per_node=4 primitives/device_mesh.py            # 2 x 2
    python primitives/device_mesh.py --nproc 4 --tp 4                # 1 x 4

run() and ctx: init_process_group on ctx.device, main(args, ctx), destroy_process_group.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.device_mesh.init_device_mesh
      https://pytorch.org/tutorials/recipes/distributed_device_mesh.html
"""

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
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
    print0(
        f"OK: {dp} x {tp} mesh (dp, tp): coordinates, local ranks and collectives along each "
        "dimension match numpy on the grid"
    )


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
    run(main, parser.parse_args())
