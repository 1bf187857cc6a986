"""broadcast of a tensor whose shape and dtype only the source knows: a fixed-size header first.

broadcast(t, src) copies into a tensor that every rank has already allocated, so every rank
must know the shape and dtype before the call. When only the source knows them, broadcast a
small header of fixed size first (ndim, dtype code, dims), allocate from it, then broadcast
the data. Here rank 0 sends a 2-D float32 tensor, then rank 1 a 3-D int64 tensor (at 1 rank,
rank 0 is both sources); each source draws its shape from its own random generator.

    torchrun --nproc_per_node=3 primitives/broadcast_unknown_shape.py
    python primitives/broadcast_unknown_shape.py --nproc 2 --seed 7

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.broadcast
"""

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run

# The dtype code is an index in this list: it is code, not data, so every rank has the same list.
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DTYPES += [torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]
MAX_DIMS = 8


def broadcast_tensor(tensor, src, device):
    """Every rank calls this; src passes its tensor, the others None. Returns src's tensor on
    every rank. (broadcast_object_list([tensor], src) does it in one call, but it pickles (its
    docs warn so, torch 2.13): only for peers you trust.)"""
    if dist.get_rank() == src and tensor.dim() > MAX_DIMS:
        raise ValueError(f"{tensor.dim()} dims: the header has room for {MAX_DIMS}")
    header = torch.zeros(2 + MAX_DIMS, dtype=torch.int64, device=device)  # same size on every rank
    if dist.get_rank() == src:
        header[0], header[1] = tensor.dim(), DTYPES.index(tensor.dtype)
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64, device=device)
    dist.broadcast(header, src=src)
    ndim, code, *dims = header.tolist()  # one copy to the host, on GPUs too
    if dist.get_rank() != src:
        tensor = torch.empty(dims[:ndim], dtype=DTYPES[code], device=device)
    dist.broadcast(tensor, src=src)
    return tensor


def source_tensor(turn, src, seed):
    """What src holds on this turn: a shape and dtype of its own choosing (turn 0: 2-D float32,
    turn 1: 3-D int64)."""
    g = torch.Generator().manual_seed(1000 * seed + 10 * turn + src)
    shape = torch.randint(1, 6, (2 + turn,), generator=g, device="cpu").tolist()
    if turn == 0:
        return torch.randn(shape, generator=g, device="cpu")
    return torch.randint(-1000, 1000, shape, generator=g, device="cpu")


def main(args, ctx):
    rank, world = ctx.rank, ctx.world_size
    sources = [0, min(1, world - 1)]  # at 1 rank there is no rank 1: rank 0 sends both

    received = []
    for turn, src in enumerate(sources):
        mine = source_tensor(turn, src, args.seed).to(ctx.device) if rank == src else None
        held = describe(mine) if mine is not None else None
        print_in_order(
            f"turn {turn}, before: "
            + (f"holds {held}" if held else f"knows nothing of rank {src}'s tensor")
        )
        t = broadcast_tensor(mine, src, ctx.device)
        print_in_order(f"turn {turn}, after broadcast from rank {src}: {describe(t)}")
        received.append(t)

    check_against_rebuilt(received, sources, args.seed, rank)
    shapes = " then ".join(
        f"{describe(t, values=False)} from rank {s}" for t, s in zip(received, sources)
    )
    print0(
        f"OK: {world} rank(s) received {shapes}, shape and dtype learnt from a "
        f"{2 + MAX_DIMS}-element header; equal to the tensors rebuilt from the seed"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def describe(t, values=True):
    text = f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
    first = [round(v, 4) if isinstance(v, float) else v for v in t.flatten()[:3].tolist()]
    return text + f", first values {first}" if values else text


def check_against_rebuilt(received, sources, seed, rank):
    """Rebuild each source's tensor here with plain torch (every rank knows the seed) and
    compare, bit for bit."""
    for turn, (t, src) in enumerate(zip(received, sources)):
        expected = source_tensor(turn, src, seed)
        if (
            t.dtype != expected.dtype
            or t.shape != expected.shape
            or not torch.equal(t.cpu(), expected)
        ):
            raise RuntimeError(
                f"rank {rank}, turn {turn}: received {describe(t)}, "
                f"but rank {src} sent {describe(expected)}"
            )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--seed",
        type=int_in(0, 1_000_000_000),
        default=0,
        help="the sources' random shapes and values",
    )
    run(main, parser.parse_args())
