"""Every check of every lesson fails when the lesson is wrong.

Each row below is a mistake a reader could make copying a lesson, written into a copy of the
lesson (tests/harness.mutant: a copy of the lesson's folder in a temporary directory, with `old`
replaced by `new`, each `old` occurring exactly once in the file), and the message the lesson's own
check prints when it catches that mistake. The copy runs as the lesson does (the warm launcher
by default) and must exit non-zero, print that message and no OK line. No lesson has a flag for it.

test_every_mutation_still_applies checks in a second, in this process, that every `old` still
occurs once in today's lessons: a change to a lesson that moves the text fails there first.
"""

from dataclasses import dataclass, field

import pytest

from harness import ROOT, assert_fails, mutant, run_lesson


@dataclass
class Mutation:
    id: str  # the name of the test case
    lesson: str  # the lesson that is run
    changes: list  # [(old, new), ...], made in `file`
    message: str  # what the lesson's check prints when it catches the mistake
    nproc: int = 2
    args: tuple = ()
    file: str = None  # a sibling of the lesson to change instead of the lesson (e.g. "model.py")
    launcher: str = "warm"
    timeout: int = 120
    quick: bool = False  # also in `pytest -m quick`
    marks: list = field(default_factory=list)


# ---------------------------------------------------------------------------------- primitives/
PRIMITIVES = [
    Mutation(
        "all_reduce-call-left-out",
        "primitives/all_reduce.py",
        [("dist.all_reduce(t, op=getattr(dist.ReduceOp, name))", "pass")],
        "all_reduce SUM gave",
        quick=True,
    )
]


# ---------------------------------------------------------------------------------- ddp_basics/
DDP_BASICS = []


# ---------------------------------------------------------------------------------- fsdp_basics/
FSDP_BASICS = [
    # fsdp_minimal: the optimizer made before fully_shard holds the replaced parameters
    Mutation(
        "fsdp_minimal-optimizer-before-fully-shard",
        "fsdp_basics/fsdp_minimal.py",
        [
            (
                "    opt = torch.optim.Adam(model.parameters(), lr=args.lr)  # after fully_shard",
                "    pass  # ",
            ),
            (
                "    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))\n",
                "    opt = torch.optim.Adam(model.parameters(), lr=args.lr)\n"
                "    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))\n",
            ),
        ],
        "FSDP and one process differ by",
        quick=True,
    ),
    # fsdp_offload: reset_parameters() on the shards (every CPU rank draws rank 0's numbers)
    Mutation(
        "fsdp_offload-reset-parameters-on-shards",
        "fsdp_basics/fsdp_offload.py",
        [
            (
                "    init_shards_(model)\n    opt",
                "    [m.reset_parameters() for m in model.modules() if isinstance(m, nn.Linear)]\n"
                "    opt",
            )
        ],
        "offloaded training is",
    ),
    # fsdp_checkpoint: a crash inside the save of step 6, after dcp.save and before the publish
    # (was --crash-during-save; tests/test_fsdp_basics.py resumes from what it leaves)
    Mutation(
        "fsdp_checkpoint-crash-during-save",
        "fsdp_basics/fsdp_checkpoint.py",
        [
            (
                "    dist.barrier()  # every rank's files are complete before the directory is",
                "    if step == 6:\n"
                "        raise RuntimeError(f'simulated crash during save: {tmp.name} written, "
                "`latest` still names the previous one')\n"
                "    dist.barrier()  # every rank's files are complete before the directory is",
            ),
            ('default="runs/fsdp_checkpoint"', 'default=str(Path(__file__).with_name("ck"))'),
        ],
        "simulated crash during save: step_000006.tmp written",
    ),
    # fsdp_overlap (was --ignore-reshard, --no-grad-sync; the backward prefetches: issue 32)
    Mutation(
        "fsdp_overlap-reshard-ignored",
        "fsdp_basics/fsdp_overlap.py",
        [("reshard_after_forward=reshard)", "reshard_after_forward=False)")],
        "reshard_after_forward=True: 4 all_gathers, 4 reduce_scatters, 0 forward-prefetched, "
        "0 backward-prefetched; expected 7, 4, 0, 3",
    ),
    Mutation(
        "fsdp_overlap-no-gradient-sync",
        "fsdp_basics/fsdp_overlap.py",
        [
            (
                "    opt = torch.optim.Adam(model.parameters(), lr=args.lr)\n",
                "    model.set_requires_gradient_sync(False)\n"
                "    opt = torch.optim.Adam(model.parameters(), lr=args.lr)\n",
            )
        ],
        "parameters differ from one process's beyond 1e-4",
    ),
    Mutation(
        "fsdp_overlap-backward-prefetch-left-out",
        "fsdp_basics/fsdp_overlap.py",
        [("block.set_modules_to_backward_prefetch(", "print(")],
        "True, explicit prefetch of 2: prefetched ",
    ),
    # zero_stages (was --skip-all-gather, --keep-full-grads; a SUM for the AVG: issue 32)
    Mutation(
        "zero_stages-all-gather-left-out",
        "fsdp_basics/zero_stages.py",
        [("all_gather(flat, shard.detach().clone())", "pass")],
        "ZeRO by hand differs from single-process training by",
    ),
    Mutation(
        "zero_stages-full-gradient-kept",
        "fsdp_basics/zero_stages.py",
        [("model.zero_grad(set_to_none=True)", "pass")],
        "ZeRO-2 holds",
    ),
    Mutation(
        "zero_stages-sum-not-average",
        "fsdp_basics/zero_stages.py",
        [
            (
                "reduce_scatter(mine_only, grads, op=dist.ReduceOp.AVG)",
                "reduce_scatter(mine_only, grads, op=dist.ReduceOp.SUM)",
            )
        ],
        "the averaged gradient slices differ from one process's gradient by",
    ),
    # zero_redundancy_optimizer (was --leave-out-last; --skip-optimizer-load needs a checkpoint:
    # tests/test_zero_stages.py makes that mutation)
    Mutation(
        "zero_redundancy_optimizer-last-parameter-left-out",
        "fsdp_basics/zero_redundancy_optimizer.py",
        [
            (
                "ZeroRedundancyOptimizer(ddp.parameters(),",
                "ZeroRedundancyOptimizer(list(ddp.parameters())[:-1],",
            ),
            (
                'default="runs/zero_redundancy_optimizer.pt"',
                'default=os.path.join(os.path.dirname(__file__), "z.pt")',
            ),
        ],
        "the ranks' optimizer shards hold [7, 2070] tensors/elements, not [8, 2074]",
    ),
    # fsdp_memory_plan (was --no-shard, --count-params)
    Mutation(
        "fsdp_memory_plan-planned-without-fully-shard",
        "fsdp_basics/fsdp_memory_plan.py",
        [
            ("for block in planned.blocks:", "for block in []:"),
            ("fully_shard(planned, mesh=mesh)", "pass"),
            ("[p.to_local() for p in planned.parameters()]", "list(planned.parameters())"),
        ],
        "fake-group plan differs from the ceil-rows formula: N=8: plan",
        nproc=3,
        args=("--max-ranks", "16"),
    ),
    Mutation(
        "fsdp_memory_plan-weight-counted-as-activation",
        "fsdp_basics/fsdp_memory_plan.py",
        [("{p.untyped_storage().data_ptr() for p in block.parameters()}", "set()")],
        "!= 8 x tokens x 62 B",
        args=("--max-ranks", "8"),
    ),
    # hsdp (was --shard-mesh-only, --same-probe-batch; the transposed mesh: issue 32)
    Mutation(
        "hsdp-shard-mesh-only",
        "fsdp_basics/hsdp.py",
        [
            ("fully_shard(block, mesh=mesh)", 'fully_shard(block, mesh=mesh["shard"])'),
            ("fully_shard(model, mesh=mesh)", 'fully_shard(model, mesh=mesh["shard"])'),
        ],
        "RuntimeError: HSDP and one process differ by",
        nproc=4,
    ),
    Mutation(
        "hsdp-shard-mesh-only-collectives",  # the first check loosened: the next one sees it
        "fsdp_basics/hsdp.py",
        [
            ("fully_shard(block, mesh=mesh)", 'fully_shard(block, mesh=mesh["shard"])'),
            ("fully_shard(model, mesh=mesh)", 'fully_shard(model, mesh=mesh["shard"])'),
        ],
        "RuntimeError: expected 3 all_reduce (replicate) and 3 reduce_scatter_single (shard)",
        nproc=4,
        args=("--tol", "1"),
    ),
    Mutation(
        "hsdp-same-probe-batch",  # the replicas agree without their all_reduce: nothing shown
        "fsdp_basics/hsdp.py",
        [
            (
                "rank_batch(x, y, 0, args.batch, ctx)  # each rank its own rows",
                "(x[: args.batch // ctx.world_size], y[: args.batch // ctx.world_size])",
            )
        ],
        "RuntimeError: expected the 2-D mesh to hold more than the 1-D",
        nproc=4,
    ),
    Mutation(
        "hsdp-mesh-transposed",  # (N/R, R) for (R, N/R): at 2 ranks DDP instead of FSDP
        "fsdp_basics/hsdp.py",
        [("(R, ctx.world_size // R), mesh_dim_names", "(ctx.world_size // R, R), mesh_dim_names")],
        "expected 3 all_reduce (replicate) and 3 reduce_scatter_single (shard), nothing on "
        "another group; got 3 all_reduce (shard)",
    ),
    Mutation(
        "hsdp-mesh-dim-names-swapped",  # trains as asked (FSDP reads dims by position)
        "fsdp_basics/hsdp.py",
        [
            (
                'ctx.world_size // R), mesh_dim_names=("replicate", "shard")',
                'ctx.world_size // R), mesh_dim_names=("shard", "replicate")',
            )
        ],
        "mesh, groups, placements, local rows built ((2, 2), ('shard', 'replicate')",
        nproc=4,
    ),
]


# --------------------------------------------------------------------------- transformer_basics/
TRANSFORMER_BASICS = []


# -------------------------------------------------------------------------------------- launch/
LAUNCH = []


MUTATIONS = PRIMITIVES + DDP_BASICS + FSDP_BASICS + TRANSFORMER_BASICS + LAUNCH


@pytest.mark.quick
def test_mutation_ids_are_unique():
    ids = [m.id for m in MUTATIONS]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


@pytest.mark.quick
def test_every_mutation_still_applies():
    problems = []
    for m in MUTATIONS:
        text = (ROOT / m.lesson).with_name(m.file or (ROOT / m.lesson).name).read_text()
        problems += [
            f"{m.id}: {old!r} occurs {text.count(old)} times"
            for old, _ in m.changes
            if text.count(old) != 1
        ]
    assert not problems, "\n".join(problems)


def _param(m):
    marks = list(m.marks) + ([pytest.mark.quick] if m.quick else [])
    return pytest.param(m, id=m.id, marks=marks)


@pytest.mark.parametrize("m", [_param(m) for m in MUTATIONS])
def test_check_fails_when_the_lesson_is_wrong(m, tmp_path):
    copy = mutant(tmp_path, m.lesson, *m.changes, file=m.file)
    result = run_lesson(copy, *m.args, nproc=m.nproc, launcher=m.launcher, timeout=m.timeout)
    assert_fails(result, m.message)
