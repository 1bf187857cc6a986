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
FSDP_BASICS = []


# --------------------------------------------------------------------------- transformer_basics/
TRANSFORMER_BASICS = [
    # benchmark.py --no-grad-sync (ddp+), removed: a comm hook that sends nothing
    Mutation(
        "benchmark-ddp+-sends-no-gradients",
        "transformer_basics/benchmark.py",
        [
            (
                "**tuned)\n",
                "**tuned)\n"
                "        from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks\n"
                "\n"
                '        if mode == "ddp+":\n'
                "            model.register_comm_hook(None, debugging_hooks.noop_hook)\n",
            )
        ],
        "should train the same model, but their losses differ",
        args=tuple("--modes ddp ddp+ --steps 3 --warmup 1 --n-layer 1 --n-embd 48".split()),
    ),
    # benchmark.py --no-grad-sync (fsdp+), removed: no reduce-scatter of the gradients
    Mutation(
        "benchmark-fsdp+-no-reduce-scatter",
        "transformer_basics/benchmark.py",
        [
            (
                "block.set_modules_to_backward_prefetch(blocks[i - 1 : i] if i else [])\n",
                "block.set_modules_to_backward_prefetch(blocks[i - 1 : i] if i else [])\n"
                "            model.set_requires_gradient_sync(False)\n",
            )
        ],
        "should train the same model, but their losses differ",
        args=tuple("--modes ddp fsdp+ --steps 3 --warmup 1 --n-layer 1 --n-embd 48".split()),
    ),
    # composition.py --no-preserve-rng-state, removed: the recomputation draws other dropout masks
    Mutation(
        "composition-recompute-without-rng-state",
        "transformer_basics/composition.py",
        [
            (
                "checkpoint(self.block, x, use_reentrant=False)",
                "checkpoint(self.block, x, use_reentrant=False, preserve_rng_state=False)",
            )
        ],
        "ddp, checkpointed, eager: losses differ from one process's plain model",
        args=("--parallel", "ddp", "--no-compile", "--dropout", "0.1", "--batch-size", "2"),
    ),
    # train.py: DDP never all-reduces (every micro-batch under no_sync): the replicas drift apart.
    # The second change only sends the copy's --out next to it, not into the checkout.
    Mutation(
        "train-ddp-never-syncs",
        "transformer_basics/train.py",
        [
            ("gradient_sync(model, micro == args.accum - 1)", "gradient_sync(model, False)"),
            ('"--out", default=out,', '"--out", default=__file__ + ".runs",'),
        ],
        "DDP replicas diverged: parameters differ between ranks",
        file="training.py",
        args=tuple(
            "--steps 3 --warmup 1 --batch-size 2 --accum 2 --n-layer 1 --sample-tokens 0".split()
        ),
    ),
    # train_2d.py: the data sharded by the tp index, so the ranks of one TP row read different
    # windows: step 0's gradients differ from the unsharded model's on the global batch
    Mutation(
        "train_2d-data-sharded-by-tp-rank",
        "transformer_basics/train_2d.py",
        [
            ('dp_rank = mesh["dp"].get_local_rank()', 'dp_rank = mesh["tp"].get_local_rank()'),
            ('out="runs/gpt_2d"', 'out=__file__ + ".runs"'),  # not into the checkout
        ],
        "first step: gradient of",
        nproc=4,
        args=tuple("--steps 3 --warmup 1 --batch-size 2 --n-layer 1".split()),
    ),
    # tensor_parallel.py: the final norm left out of the sequence-parallel plan: each rank's
    # ln_f gradient covers its own tokens only
    Mutation(
        "tensor_parallel-ln_f-not-sequence-parallel",
        "transformer_basics/tensor_parallel.py",
        [('"ln_f": SequenceParallel(),', "")],
        "gradient of ln_f.weight differs from the unsharded model's",
        args=("--sequence-parallel", "--steps", "1"),
    ),
    # pipeline_parallel.py: the tied embedding's two copies (first and last stage) not summed
    Mutation(
        "pipeline-tied-gradients-not-summed",
        "transformer_basics/pipeline_parallel.py",
        [("dist.all_reduce(tied.weight.grad, group=tie_group)", "pass")],
        "differs from single-process training",
        args=("--steps", "1"),
        quick=True,
    ),
]


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
