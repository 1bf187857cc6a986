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
TRANSFORMER_BASICS = []


# -------------------------------------------------------------------------------------- launch/
LAUNCH = [
    Mutation(
        "legacy_launch-all_reduce-left-out",
        "launch/legacy_launch.py",
        [("dist.all_reduce(total)", "pass")],
        "all_reduce gave",
        quick=True,
    ),
    Mutation(  # each rank folds in only its own share of the batch: a partial sum
        "elastic-step-sum-not-all_reduced",
        "launch/elastic.py",
        [("dist.all_reduce(total)", "pass")],
        "differs from the serial computation",
        launcher="python",  # the warm launcher shares its store: elastic.py refuses it
    ),
    Mutation(
        "spawn_template-all_reduce-left-out",
        "launch/spawn_template.py",
        [("dist.all_reduce(total)", "pass")],
        ", expected 3",
        launcher="python",  # it starts its ranks itself (--nproc)
    ),
]


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
