"""What the launcher handed each process: the environment variables, in rank order, checked.

torchrun (and Slurm + torchrun, and platforms that set the same variables) tells each
process who it is only through the environment. This prints exactly what each rank got
and checks that it adds up: RANK is the process group's rank, ranks are 0..WORLD_SIZE-1,
RANK = GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK (the node's block of ranks), and every
rank agrees on WORLD_SIZE, MASTER_ADDR:MASTER_PORT and the run id.

    torchrun --nproc_per_node=3 launch/print_env.py
    bash launch/multinode_local.sh static launch/print_env.py   # 2 "nodes" x 2 ranks
    python launch/print_env.py --nproc 2                        # spawned: no torchrun variables

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/elastic/run.html#environment-variables
"""

import os
import socket

import torch.distributed as dist
from launch.dist_setup import lesson_parser, print0, print_in_order, run

# What differs from rank to rank, and what every rank of the job must share.
PER_RANK = [
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "LOCAL_WORLD_SIZE",
    "SLURM_NODEID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
]
SHARED = [
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
    "SLURM_JOB_ID",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_NUM_NODES",
    "SLURM_NTASKS",
]


def main(args, ctx):
    env = {k: os.environ[k] for k in PER_RANK + SHARED if k in os.environ}
    env["host"] = socket.gethostname()  # not a variable: which machine ("node") the rank is on
    print_in_order(" ".join(f"{k}={env[k]}" for k in PER_RANK + ["host"] if k in env))
    print0("shared by all ranks: " + " ".join(f"{k}={env[k]}" for k in SHARED if k in env))
    # Everyone's environment, on every rank (pickled: fine between our own ranks).
    views = [None] * ctx.world_size
    dist.all_gather_object(views, env)
    check_views(views, ctx.world_size)


# ---- The lesson ends here. What follows is how it checks itself. ----


def check(views, n):
    """Everything that must hold between the ranks' environments; returns the problems found."""
    problems = []
    for i, v in enumerate(views):  # views[i] came from process-group rank i
        if int(v["RANK"]) != i:
            problems.append(f"process-group rank {i} has RANK={v['RANK']}")
        lr, lws = int(v["LOCAL_RANK"]), int(v["LOCAL_WORLD_SIZE"])
        if not 0 <= lr < lws:
            problems.append(f"rank {i}: LOCAL_RANK {lr} not below LOCAL_WORLD_SIZE {lws}")
        if "GROUP_RANK" in v and i != int(v["GROUP_RANK"]) * lws + lr:
            problems.append(
                f"rank {i}: RANK != GROUP_RANK {v['GROUP_RANK']} x {lws} + LOCAL_RANK {lr}"
            )
        if "ROLE_RANK" in v and int(v["ROLE_RANK"]) != i:  # one role: its ranks are the ranks
            problems.append(f"rank {i}: ROLE_RANK {v['ROLE_RANK']} differs")
    for key in SHARED:
        values = {v.get(key) for v in views}
        if len(values) > 1:
            problems.append(f"ranks disagree on {key}: {sorted(map(str, values))}")
    if int(views[0]["WORLD_SIZE"]) != n:
        problems.append(f"WORLD_SIZE={views[0]['WORLD_SIZE']} but the process group has {n} ranks")
    if "GROUP_WORLD_SIZE" in views[0]:
        nodes = int(views[0]["GROUP_WORLD_SIZE"])
        if sorted({int(v["GROUP_RANK"]) for v in views}) != list(range(nodes)):
            problems.append(f"GROUP_RANKs are not 0..{nodes - 1}")
    return problems


def check_views(views, n):
    problems = check(views, n)
    if problems:
        raise RuntimeError("inconsistent launcher environment: " + "; ".join(problems))
    env = views[0]
    if "TORCHELASTIC_RUN_ID" in env:
        print0(
            f"OK: {n} rank(s) on {env['GROUP_WORLD_SIZE']} node(s) via torchrun: ranks "
            f"0..{n - 1} match the process group, RANK = GROUP_RANK x LOCAL_WORLD_SIZE + "
            f"LOCAL_RANK, all agree on {env['MASTER_ADDR']}:{env['MASTER_PORT']}"
        )
    else:
        print0(
            f"OK: {n} rank(s) without torchrun (spawned): only RANK, LOCAL_RANK, WORLD_SIZE, "
            "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, consistent"
        )


if __name__ == "__main__":
    run(main, lesson_parser(__doc__).parse_args())
