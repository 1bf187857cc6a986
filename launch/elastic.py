"""Elastic training with torchrun: a rank dies and the job resumes; a node joins and the
world grows. Both work the same way: torchrun stops every worker, runs a new rendezvous,
and starts them all again, with RANK and WORLD_SIZE possibly changed. So the job must
checkpoint often and resume from its last checkpoint at whatever world size it gets.

The job is a stand-in for training with an exactly reproducible result: each step folds
in a sum over a fixed global "batch" of integers, split across the ranks and all_reduced.
Integer sums are exact, so the final state must equal a serial computation bit for bit,
whatever failed and however many ranks did the work along the way.

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1     # needed for restarts in torch 2.5+, see below
    torchrun --nnodes=1:2 --nproc_per_node=2 --max-restarts=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo --rdzv-conf=last_call_timeout=2 \\
        launch/elastic.py --fail-at-step 5
    # a second node joining while it runs: the same command in another terminal, with
    # --steps 60 on both, and without --fail-at-step

Why the variable: since torch 2.5 torchrun's agent serves the store the workers
initialise on, and keeps it across restarts; the restarted workers then read the
previous attempt's addresses from it and fail with "Gloo connectFullMesh failed ...
Connection refused" (pytorch/pytorch#135712). With it set, rank 0 serves a fresh store
each attempt. This lesson refuses to start without it rather than fail at the restart.

Docs: https://pytorch.org/docs/stable/elastic/run.html#elastic-min-1-max-4-tolerates-up-to-3-membership-changes-or-failures
"""

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from launch.dist_setup import lesson_parser, print0, print_rank, run

MOD = 2**31 - 1


def step_sum(step, indices):
    """The sum of one share of step `step`'s batch (plain Python ints: exact)."""
    return sum((step * 7919 + i * i) % 1000 for i in indices)


def serial(steps, batch):
    w = 1
    for step in range(steps):
        w = (w * 31 + step_sum(step, range(batch))) % MOD
    return w


def save_atomically(state, path):
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)  # a death mid-save leaves the previous checkpoint intact


def main(args, ctx):
    path = os.path.join(args.ckpt_dir, "elastic.pt")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    state = {"step": 0, "w": 1, "world_sizes": []}
    if os.path.exists(
        path
    ):  # every rank reads it before anyone writes: rank 0 writes after an all_reduce
        state = torch.load(path, weights_only=True, map_location="cpu")
    state["world_sizes"].append([state["step"], ctx.world_size])
    print0(
        f"start: restart {restart}, world size {ctx.world_size}, resuming at step {state['step']}"
    )

    w = state["w"]
    for step in range(state["step"], args.steps):
        if step == args.fail_at_step and restart == 0 and ctx.rank == ctx.world_size - 1:
            print_rank(
                f"dying at step {step} (--fail-at-step)"
            )  # one write, so no other rank's line cuts it
            os._exit(1)  # an abrupt death, like a lost machine: no cleanup, no exception
        mine = range(ctx.rank, args.batch, ctx.world_size)  # this rank's share, at any world size
        total = torch.tensor([step_sum(step, mine)], dtype=torch.int64, device=ctx.device)
        dist.all_reduce(total)
        w = (w * 31 + total.item()) % MOD
        if ctx.rank == 0:  # one writer: on several nodes, ckpt-dir must be shared storage
            save_atomically({"step": step + 1, "w": w, "world_sizes": state["world_sizes"]}, path)
        time.sleep(args.step_time)  # a real step takes time: room for failures and joins
    dist.barrier()

    expected = serial(args.steps, args.batch)
    if w != expected:
        raise RuntimeError(f"final state {w} differs from the serial computation {expected}")
    sizes = " -> ".join(f"{n} ranks from step {s}" for s, n in state["world_sizes"])
    print0(
        f"OK: {args.steps} steps, final state {w} equals the serial computation; "
        f"{len(state['world_sizes'])} attempt(s): {sizes}"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--batch", type=int, default=1000, help="integers summed per step, split over ranks"
    )
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds each step sleeps")
    parser.add_argument(
        "--fail-at-step",
        type=int,
        default=-1,
        help="the last rank dies at this step (first attempt only)",
    )
    parser.add_argument(
        "--ckpt-dir", help="default: one folder per run id (TORCHELASTIC_RUN_ID) in the temp dir"
    )
    args = parser.parse_args()
    if (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    ):  # before init: a restart would hang in it
        sys.stderr.write(
            f"[rank {os.environ.get('RANK')}] error: the agent shares its store and torch "
            f"{torch.__version__} restarts workers on stale keys (pytorch#135712): run torchrun "
            "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --rdzv-backend=c10d\n"
        )
        sys.exit(2)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if (
        args.ckpt_dir is None
    ):  # the same folder for every attempt of this run, a new one for the next run
        args.ckpt_dir = (
            os.path.join(tempfile.gettempdir(), f"elastic_{run_id}")
            if run_id
            else tempfile.mkdtemp(prefix="elastic_")
        )  # spawned: the children inherit args
    os.makedirs(args.ckpt_dir, exist_ok=True)
    run(main, args)
