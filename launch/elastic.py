"""Elastic torchrun: a rank dies and the job resumes; a node joins and the world grows. Either
way torchrun stops every worker, rendezvous again and restarts them all (RANK, WORLD_SIZE may
change): so the job checkpoints every step and resumes at whatever world size it gets. Each step
adds an all_reduced sum of integers (exact): the result must equal a serial computation exactly.

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1     # needed for restarts in torch 2.5+, see below
    torchrun --nnodes=1:2 --nproc_per_node=2 --max-restarts=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo --rdzv-conf=last_call_timeout=2 \\
        launch/elastic.py --fail-at-step 5
    # a node joining: the same command in another terminal, --steps 60 on both, no --fail-at-step

The variable: torchrun's agent (torch 2.5+) keeps the store the workers meet at across restarts;
restarted workers read stale addresses from it ("Gloo connectFullMesh failed", pytorch#135712).
With it set, rank 0 serves a fresh store each attempt; without it this lesson refuses to start.
run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.
Docs: https://pytorch.org/docs/stable/elastic/run.html#elastic-min-1-max-4-tolerates-up-to-3-membership-changes-or-failures
"""

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from launch.dist_setup import UsageError, float_in, int_in, lesson_parser, print0, print_rank, run

MOD = 2**31 - 1


def main(args, ctx):
    path = os.path.join(args.ckpt_dir, "elastic.pt")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    state = load_checkpoint(path, args.steps)  # every rank reads it before rank 0 writes again
    first, w = state["step"], state["w"]
    state["world_sizes"].append([first, ctx.world_size])
    print0(f"start: restart {restart}, world size {ctx.world_size}, resuming at step {first}")
    for step in range(first, args.steps):
        if step == args.fail_at_step and restart == 0 and ctx.rank == ctx.world_size - 1:
            die(step)
        mine = range(ctx.rank, args.batch, ctx.world_size)  # this rank's share, at any world size
        total = torch.tensor([step_sum(step, mine)], dtype=torch.int64, device=ctx.device)
        dist.all_reduce(total)
        w = (w * 31 + total.item()) % MOD
        if ctx.rank == 0:  # one writer: on several nodes, ckpt-dir must be shared storage
            save_atomically({"step": step + 1, "w": w, "world_sizes": state["world_sizes"]}, path)
        time.sleep(args.step_time)  # a real step takes time: room for failures and joins
    dist.barrier()
    check_against_serial(w, args, state["world_sizes"])
    if ctx.rank == 0:  # the job is done: the next run in this folder starts afresh
        os.remove(path)


def step_sum(step, indices):  # one share of step `step`'s batch, in plain Python ints: exact
    return sum((step * 7919 + i * i) % 1000 for i in indices)


def save_atomically(state, path):
    torch.save(state, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)  # a death mid-save leaves the previous checkpoint intact


def load_checkpoint(path, steps):
    if not os.path.exists(path):
        return {"step": 0, "w": 1, "world_sizes": []}
    try:  # another lesson's file or a corrupt one: one line, not a traceback
        state = torch.load(path, weights_only=True, map_location="cpu")
        at = state["step"]
    except Exception as error:
        raise UsageError(f"{path}: not elastic.py's checkpoint ({type(error).__name__})") from None
    if at > steps:
        raise UsageError(f"{path} is at step {at}, past --steps {steps}: remove it")
    return state


def die(step):
    print_rank(f"dying at step {step} (--fail-at-step)")  # one write: no other rank's line cuts it
    os._exit(1)  # an abrupt death, like a lost machine: no clean-up, no exception


# ---- The lesson ends here. What follows is how it checks itself. ----


def serial(steps, batch):
    w = 1
    for step in range(steps):
        w = (w * 31 + step_sum(step, range(batch))) % MOD
    return w


def check_against_serial(w, args, world_sizes):
    expected = serial(args.steps, args.batch)
    if w != expected:
        raise RuntimeError(f"final state {w} differs from the serial computation {expected}")
    sizes = " -> ".join(f"{n} ranks from step {s}" for s, n in world_sizes)
    print0(
        f"OK: {args.steps} steps, final state {w} equals the serial computation; "
        f"{len(world_sizes)} attempt(s): {sizes}"
    )


def refuse_the_shared_agent_store():
    """Before any init: a restart would hang on the agent's store (see the docstring)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        sys.stderr.write(
            f"[rank {os.environ.get('RANK')}] error: the agent shares its store and torch "
            f"{torch.__version__} restarts workers on stale keys (pytorch#135712): run torchrun "
            "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --rdzv-backend=c10d\n"
        )
        sys.exit(2)


def default_ckpt_dir():
    """The same folder for every attempt of one run (torchrun's TORCHELASTIC_RUN_ID), a new one
    for each run started with plain python (the spawned ranks inherit it in args)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        return os.path.join(tempfile.gettempdir(), f"elastic_{run_id}")
    return tempfile.mkdtemp(prefix="elastic_")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--steps", type=int_in(1, 100_000), default=20)
    parser.add_argument(
        "--batch", type=int_in(1, 1_000_000), default=1000, help="integers summed per step"
    )
    parser.add_argument(
        "--step-time", type=float_in(0, 60), default=0.05, help="seconds each step sleeps"
    )
    parser.add_argument(
        "--fail-at-step",
        type=int_in(0, 100_000),
        help="the last rank dies at this step (first attempt only)",
    )
    parser.add_argument("--ckpt-dir", help="default: one folder per run id in the temp dir")
    args = parser.parse_args()
    refuse_the_shared_agent_store()
    args.ckpt_dir = args.ckpt_dir or default_ckpt_dir()
    os.makedirs(args.ckpt_dir, exist_ok=True)
    run(main, args)
