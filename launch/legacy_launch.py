"""For code still started with `python -m torch.distributed.launch` (deprecated: use torchrun).

The old launcher passes each process its local rank as an argument, `--local-rank=N`
(torch >= 2.0; `--local_rank=N` before), unless `--use-env` is given; it always sets the
environment too. A script that must work under both launchers accepts both spellings and
falls back to the LOCAL_RANK variable, which is all torchrun sets:

    python -m torch.distributed.launch --nproc_per_node=2 launch/legacy_launch.py
    python -m torch.distributed.launch --nproc_per_node=2 --use-env launch/legacy_launch.py
    torchrun --nproc_per_node=2 launch/legacy_launch.py        # the one-line migration

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#launch-utility
"""

import os

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    local_rank, source = local_rank_of(args, ctx)
    print_in_order(f"local rank {local_rank} from the {source}; device {ctx.device}")
    total = torch.tensor([ctx.rank], device=ctx.device)
    dist.all_reduce(total)
    check_sum(total, ctx.world_size, source)


def local_rank_of(args, ctx):
    """The --local-rank argument if the launcher passed one, else the LOCAL_RANK variable."""
    from_env = os.environ.get("LOCAL_RANK")
    if args.local_rank is None:
        ctx.require(
            from_env is not None,
            "no --local-rank argument and no LOCAL_RANK variable: "
            "start with torchrun or python -m torch.distributed.launch",
        )
        return int(from_env), "environment LOCAL_RANK"
    agree = from_env is None or int(from_env) == args.local_rank
    ctx.require(agree, f"--local-rank {args.local_rank} disagrees with LOCAL_RANK={from_env}")
    return args.local_rank, "argument --local-rank"


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_sum(total, world_size, source):
    if total.item() != world_size * (world_size - 1) // 2:
        raise RuntimeError(f"all_reduce gave {total.item()}")
    print0(
        f"OK: {world_size} rank(s) found their local rank from the {source}; migrate with: "
        f"torchrun --nproc_per_node=N {os.path.relpath(__file__)} "
        "(and read LOCAL_RANK from the environment)"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    # Both spellings: torch.distributed.launch writes --local-rank since torch 2.0, --local_rank
    # before (the docstring of torch/distributed/launch.py, torch 2.13).
    parser.add_argument(
        "--local-rank", "--local_rank", dest="local_rank", type=int_in(0, 4095), default=None
    )
    args = parser.parse_args()
    if args.local_rank is not None and "RANK" in os.environ:
        # dist_setup picks the device from LOCAL_RANK; the old launcher sets it too
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    run(main, args)
