"""redistribute is a collective: which one, for each pair of placements, found by counting the
calls.

DTensor.redistribute(mesh, [placement]) changes how a tensor is laid out over the mesh.
CommDebugMode (torch.distributed.tensor.debug) counts the collectives that run inside it, so the
lesson finds, for each pair, the call DTensor makes: Shard -> Replicate an all_gather, Partial ->
Replicate an all_reduce, Partial -> Shard a reduce_scatter, Shard(0) -> Shard(1) an all_to_all (on a
CPU mesh DTensor falls back to an all_gather and a chunk:
torch/distributed/tensor/_collective_utils.py), Replicate -> Shard nothing at all. distribute_tensor
and full_tensor are in the table too. Each result is checked against the plain tensor. The
placements themselves: dtensor_basics.py.

    torchrun --nproc_per_node=3 primitives/dtensor_redistribute.py
    python primitives/dtensor_redistribute.py --nproc 4 --rows 16 --cols 8

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python. Docs:
https://pytorch.org/docs/stable/distributed.tensor.html#torch.distributed.tensor.DTensor.redistribute
      https://pytorch.org/docs/stable/distributed.tensor.html#debugging (CommDebugMode)
"""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    rank, world = ctx.rank, ctx.world_size
    ctx.require(
        (100 * args.rows + args.cols) * world * (world + 1) < 2**24,
        "--rows too large for the exact float32 checks (the Partial's sum must stay below 2**24): "
        "try --rows 1000",
    )
    full = 100 * torch.arange(args.rows, device=ctx.device)[:, None]
    full = (full + torch.arange(args.cols, device=ctx.device)).float()  # where each value sits
    mesh = init_device_mesh(ctx.device.type, (world,))

    s0, s1, rep = (distribute_tensor(full, mesh, [p]) for p in (Shard(0), Shard(1), Replicate()))
    part = DTensor.from_local(full * (rank + 1), mesh, [Partial()])  # the value: sum of the terms

    def move(src, dst):
        return src.redistribute(mesh, [dst])  # a collective, on every rank of the mesh

    moves = {
        "distribute_tensor -> Shard(0)": lambda: distribute_tensor(full, mesh, [Shard(0)]),
        "distribute_tensor -> Replicate": lambda: distribute_tensor(full, mesh, [Replicate()]),
        "Shard(0) -> Replicate": lambda: move(s0, Replicate()),
        "Partial -> Replicate": lambda: move(part, Replicate()),
        "Partial -> Shard(0)": lambda: move(part, Shard(0)),
        "Shard(0) -> Shard(1)": lambda: move(s0, Shard(1)),
        "Shard(1) -> Shard(0)": lambda: move(s1, Shard(0)),
        "Replicate -> Shard(0)": lambda: move(rep, Shard(0)),
        "Replicate -> Partial": lambda: move(rep, Partial()),
        "Shard(0).full_tensor()": lambda: s0.full_tensor(),
        "Partial.full_tensor()": lambda: part.full_tensor(),
    }
    results = {}
    for name, call in moves.items():
        with CommDebugMode() as comms:  # counts every collective the call makes on this rank
            try:
                out = call()
            except RuntimeError as error:  # DTensor refuses some pairs: the reason is in the table
                out = error
        results[name] = (out, comms.get_comm_counts())

    print_table(results)
    check_and_print_pieces(ctx, results, full, args)


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_and_print_pieces(ctx, results, full, args):
    world = ctx.world_size
    value = {"Partial": full * world * (world + 1) / 2}  # what the Partial stands for; else: full
    pieces = [out.to_local().shape for out, _ in results.values() if isinstance(out, DTensor)]
    print_in_order(f"my pieces: {', '.join(str(tuple(shape)) for shape in pieces)}")
    check_results(ctx, results, full, value)
    print0(
        f"OK: {len(results)} moves over {world} rank(s) ({args.rows} x {args.cols}): each "
        "collective counted, each result equal to the plain tensor's piece"
    )


def collective_names(counts):
    names = [f"{getattr(op, '__name__', str(op)).rstrip('_')} x{k}" for op, k in counts.items()]
    return ", ".join(names) or "none"


def print_table(results):
    print0(f"{'move':<32} {'collectives on each rank':<36} result")
    for name, (out, counts) in results.items():
        got = (
            f"refused: {str(out).splitlines()[0]}"
            if isinstance(out, Exception)
            else f"{out.placements[0]}"
            if isinstance(out, DTensor)
            else "a plain tensor"
        )
        print0(f"{name:<32} {collective_names(counts):<36} {got}")


def piece(value, placement, rank, world):
    """What rank holds of value under placement, by hand: for Shard, torch.chunk's split."""
    if not isinstance(placement, Shard):
        return value
    n, size = value.shape[placement.dim], -(-value.shape[placement.dim] // world)
    start = min(rank * size, n)
    return value.narrow(placement.dim, start, min(start + size, n) - start)


def check_results(ctx, results, full, value):
    for name, (out, _) in results.items():
        src = name.split(" ")[0].split(".")[0]
        want = value.get(src, full)
        if name == "Replicate -> Partial":  # to Partial is for DTensor's internal use only
            if not isinstance(out, RuntimeError):
                raise RuntimeError(f"{name}: expected DTensor to refuse it, got {out}")
            continue
        if not isinstance(out, DTensor):  # full_tensor: the whole value on every rank
            mine, whole = out, out
        else:  # the local piece first, on every rank, before a collective on the wrong shapes
            mine = out.to_local()
            if not torch.equal(mine, piece(want, out.placements[0], ctx.rank, ctx.world_size)):
                raise RuntimeError(
                    f"rank {ctx.rank}: {name}: my piece {tuple(mine.shape)} is not my "
                    f"{out.placements[0]} piece of the plain tensor"
                )
            whole = out.full_tensor()
        if not torch.equal(whole, want):  # exact: integers below 2**24 add exactly in float32
            raise RuntimeError(
                f"rank {ctx.rank}: {name}: the whole tensor differs from plain torch"
            )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--rows", type=int_in(1, 4096), default=10, help="rows (10: uneven at 3 and 4 ranks)"
    )
    parser.add_argument("--cols", type=int_in(1, 4096), default=6, help="columns of the tensor")
    run(main, parser.parse_args())
