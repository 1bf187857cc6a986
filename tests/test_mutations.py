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
# ddp_checkpoint writes its checkpoint beside the mutated copy (in pytest's tmp_path), not in --out
CHECKPOINT_IN_COPY = (
    'path = os.path.join(args.out, "ddp_checkpoint.pt")',
    'path = os.path.join(os.path.dirname(__file__), "ddp_checkpoint.pt")',
)
DDP_BASICS = [
    Mutation(
        "ddp_minimal-forward-bypasses-ddp",
        "ddp_basics/ddp_minimal.py",
        [("F.cross_entropy(model(xb), yb)", "F.cross_entropy(model.module(xb), yb)")],
        "ranks disagree (params",
        args=("--epochs", "1"),
    ),
    Mutation(
        "ddp_minimal-no-set-epoch",
        "ddp_basics/ddp_minimal.py",
        [("        sampler.set_epoch(epoch)  # a new shuffle each epoch\n", "")],
        "DDP training differs from single-process training",
        args=("--epochs", "2"),
    ),
    Mutation(
        "ddp_minimal-evaluation-sums-not-all-reduced",
        "ddp_basics/ddp_minimal.py",
        [("dist.all_reduce(sums)  # every rank", "(sums)  # every rank")],
        "all_reduced metric",
        args=("--epochs", "1"),
    ),
    Mutation(
        "manual_data_parallel-gradients-not-averaged",
        "ddp_basics/manual_data_parallel.py",
        [
            (
                "dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)\n"
                "                    p.grad /= ctx.world_size",
                "pass",
            )
        ],
        "ranks hold different params",
        args=("--epochs", "1"),
        quick=True,
    ),
    Mutation(
        "manual_data_parallel-sum-not-divided",
        "ddp_basics/manual_data_parallel.py",
        [("p.grad /= ctx.world_size", "pass")],
        "params differ from single-process training",
        args=("--epochs", "1"),
    ),
    Mutation(
        "manual_data_parallel-no-broadcast",
        "ddp_basics/manual_data_parallel.py",
        [("dist.broadcast(p.data, src=0)", "pass")],
        "ranks hold different params",
        args=("--epochs", "1"),
    ),
    Mutation(
        "ddp_checkpoint-optimizer-not-restored",
        "ddp_basics/ddp_checkpoint.py",
        [CHECKPOINT_IN_COPY, ('opt.load_state_dict(ckpt["optimizer"])', "pass")],
        "the resumed run differs from the uninterrupted run",
    ),
    Mutation(
        "ddp_checkpoint-scheduler-not-restored",
        "ddp_basics/ddp_checkpoint.py",
        [CHECKPOINT_IN_COPY, ('sched.load_state_dict(ckpt["scheduler"])', "pass")],
        "the resumed run differs from the uninterrupted run",
    ),
    Mutation(
        "ddp_checkpoint-rng-not-restored",
        "ddp_basics/ddp_checkpoint.py",
        [
            CHECKPOINT_IN_COPY,
            ('torch.set_rng_state(ckpt["rng"]["cpu"][ctx.rank].cpu().clone())', "pass"),
        ],
        "the resumed run differs from the uninterrupted run",
    ),
    Mutation(
        "ddp_grad_accumulation-loss-not-divided",
        "ddp_basics/ddp_grad_accumulation.py",
        # 20 spaces: the line under no_sync (the one of the last micro-batch has 16)
        [
            (
                " " * 20 + "loss = F.cross_entropy(model(xb), yb) / args.accum",
                " " * 20 + "loss = F.cross_entropy(model(xb), yb)",
            )
        ],
        "accumulated DDP training differs from the large batch",
    ),
    Mutation(
        "ddp_grad_accumulation-no-sync-left-out",
        "ddp_basics/ddp_grad_accumulation.py",
        [("with model.no_sync():", "if True:")],
        "fewer all_reduces with no_sync",
    ),
    Mutation(
        "ddp_mixed_precision-clip-before-unscale",
        "ddp_basics/ddp_mixed_precision.py",
        [("scaler.unscale_(opt)  # true gradients", "pass  # true gradients")],
        "fp16 autocast + GradScaler ends",
    ),
    Mutation(
        "distributed_eval-padding-not-masked",
        "ddp_basics/distributed_eval.py",
        [("real = positions < len(dataset)", "real = positions >= 0")],
        "differ from one process's",
        nproc=3,
        quick=True,
    ),
    Mutation(
        "ddp_overlap-hook-sums-not-averages",
        "ddp_basics/ddp_overlap.py",
        [("buf.div_(ctx.world_size)", "pass")],
        "parameters differ from one process's beyond 1e-05",
    ),
    Mutation(
        "ddp_overlap-bucket-view-left-out",
        "ddp_basics/ddp_overlap.py",
        [("gradient_as_bucket_view=as_view,", "gradient_as_bucket_view=False,")],
        "bucket_cap_mb=0.25, gradient_as_bucket_view=True: gradients inside the bucket buffers: []",
    ),
    Mutation(
        "syncbatchnorm-by-hand-not-all-reduced",
        "ddp_basics/syncbatchnorm.py",
        [("dist.all_reduce(stats)  # SUM over ranks", "(stats)  # SUM over ranks")],
        "differ from those of the whole batch",
    ),
    Mutation(
        "benchmark_ddp-buckets-summed-not-averaged",
        "ddp_basics/benchmark_ddp.py",
        [("flat /= dist.get_world_size()", "pass")],
        "(b) flat buckets by hand: parameters differ from one-process training",
        args=("--steps", "3", "--warmup", "1"),
    ),
]


# ---------------------------------------------------------------------------------- fsdp_basics/
FSDP_BASICS = []


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
