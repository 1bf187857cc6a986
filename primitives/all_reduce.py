"""all_reduce: combine one tensor from every rank and give every rank the result, in place.

Before: rank r holds x_r.  After all_reduce(t, op): every rank holds op(x_0, ..., x_{N-1}),
element by element. Each ReduceOp below is checked against numpy on the full data:
  SUM, PRODUCT, MIN, MAX   any dtype
  AVG                      floating point only (Gloo and NCCL)
  BAND, BOR, BXOR          integers, bitwise and/or/xor: Gloo only (NCCL has no bitwise op:
                           its op table in ProcessGroupNCCL.cpp is MIN, MAX, SUM, PRODUCT, AVG)
  PREMUL_SUM(factor)       sum of factor * x_r, the scaling fused into the reduction (used to
                           average gradients): NCCL (2.11+) and XCCL; Gloo refuses it

    torchrun --nproc_per_node=4 primitives/all_reduce.py
    python primitives/all_reduce.py --nproc 3

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce
      https://pytorch.org/docs/stable/distributed.html#torch.distributed.ReduceOp
"""

import numpy as np
import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    done = []
    for name in ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"]:
        if name.startswith("B") and ctx.backend == "nccl":
            print0(f"{name}: skipped, NCCL has no bitwise reductions")
            continue
        t = torch.from_numpy(inputs(name, ctx.rank, args.size)).to(ctx.device)
        before = t.tolist()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
        print_in_order(f"{name:8s} before {before}  after {t.tolist()}")
        check_against_numpy(name, t, ctx.world_size, args.size)
        done.append(name)

    # PREMUL_SUM multiplies each input by a factor, then sums. torch 2.13 makes it with the public
    # ReduceOp.PREMUL_SUM(factor), a float or a one-element tensor (ReduceOp's docstring); releases
    # before pytorch PR #172216 (Jan 2026) had only the private dist._make_nccl_premul_sum(factor).
    premul_sum = dist.ReduceOp.PREMUL_SUM
    if not callable(premul_sum):
        premul_sum = dist._make_nccl_premul_sum
    factor = 1.0 / ctx.world_size
    t = 100.0 * ctx.rank + torch.arange(args.size, dtype=torch.float32, device=ctx.device)
    try:
        dist.all_reduce(t, op=premul_sum(factor))
    except RuntimeError as e:  # Gloo: "Cannot use ReduceOp.PREMUL_SUM with Gloo", on every rank
        if ctx.backend == "nccl" or "PREMUL_SUM" not in str(e):
            raise
        print0(f"PREMUL_SUM: {ctx.backend} refuses it ({str(e).splitlines()[0]}); NCCL has it")
    else:
        print_in_order(f"PREMUL_SUM(1/{ctx.world_size}) after {t.tolist()}")
        check_premul_sum(t, factor, ctx.world_size, args.size)
        done.append("PREMUL_SUM")
    print0(f"OK: all_reduce with {', '.join(done)} over {ctx.world_size} rank(s) matches numpy")


def inputs(name, rank, n):
    """What rank `rank` starts with, per op (values chosen so products and bits stay readable)."""
    i = np.arange(n)
    return {
        "SUM": 100 * rank + i,
        "PRODUCT": rank + 1 + i,
        "MIN": 100 * rank + i,
        "MAX": 100 * rank + i,
        "AVG": (100 * rank + i).astype(np.float32),
        "BAND": (0b1111 ^ (1 << rank)) | i,  # every bit set but bit `rank`, then or'ed with i
        "BOR": (1 << rank) + 0 * i,  # only bit `rank`
        "BXOR": rank + i,
    }[name]


# ---- The lesson ends here. What follows is how it checks itself. ----

NUMPY = {
    "SUM": lambda a: a.sum(0),
    "PRODUCT": lambda a: a.prod(0),
    "MIN": lambda a: a.min(0),
    "MAX": lambda a: a.max(0),
    "AVG": lambda a: a.mean(0),
    "BAND": np.bitwise_and.reduce,
    "BOR": np.bitwise_or.reduce,
    "BXOR": np.bitwise_xor.reduce,
}


def check_against_numpy(name, t, world, n):
    expected = NUMPY[name](np.stack([inputs(name, r, n) for r in range(world)]))
    if not np.allclose(t.cpu().numpy(), expected):
        raise RuntimeError(f"all_reduce {name} gave {t.tolist()}, numpy gives {expected.tolist()}")


def check_premul_sum(t, factor, world, n):
    expected = factor * np.stack([100.0 * r + np.arange(n) for r in range(world)]).sum(0)
    if not np.allclose(t.cpu().numpy(), expected):
        raise RuntimeError(f"PREMUL_SUM gave {t.tolist()}, expected {expected.tolist()}")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--size", type=int_in(1, 1_000_000), default=3, help="elements per rank")
    run(main, parser.parse_args())
