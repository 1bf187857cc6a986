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
    ),
    Mutation(  # was the flag --no-barrier
        "barrier-left-out",
        "primitives/barrier.py",
        [("dist.barrier()  # nobody reads before the preparer has written", "pass")],
        "does not exist yet",
        args=("--delay", "3"),  # the readers fail at once; the preparer is still asleep
        quick=True,
    ),
    Mutation(  # a hard-coded root: right only when --src is 0
        "broadcast-from-rank-0-always",
        "primitives/broadcast.py",
        [("dist.broadcast(t, src=args.src)", "dist.broadcast(t, src=0)")],
        "expected rank 1's",
        args=("--src", "1"),
    ),
    Mutation(  # the last element sent left instead of right: every halo is the wrong edge
        "ring_exchange-wrong-edge-sent",
        "primitives/ring_exchange.py",
        [
            (
                "dist.P2POp(dist.isend, chunk[-1:].contiguous(), right)",
                "dist.P2POp(dist.isend, chunk[:1].contiguous(), right)",
            )
        ],
        "!= numpy",
        nproc=3,
    ),
    Mutation(  # the shift by SUM of the local maxima: softmax and logsumexp cancel it out, so
        # only the check of m itself can see it (at --offset 0, where exp does not underflow)
        "distributed_softmax-shift-by-sum",
        "primitives/distributed_softmax.py",
        [("dist.all_reduce(m, op=dist.ReduceOp.MAX)", "dist.all_reduce(m, op=dist.ReduceOp.SUM)")],
        "global max",
        args=("--offset", "0"),
    ),
    Mutation(  # SUM where the lesson shares by MAX: each slot comes out x its group size
        "process_groups-shared-by-sum",
        "primitives/process_groups.py",
        [
            (
                "dist.all_reduce(by_max, op=dist.ReduceOp.MAX)",
                "dist.all_reduce(by_max, op=dist.ReduceOp.SUM)",
            )
        ],
        "sharing by MAX gave",
        nproc=3,
    ),
    Mutation(  # the mesh's dimensions swapped: the check reads the mesh built, not the request
        "device_mesh-dims-swapped",
        "primitives/device_mesh.py",
        [("ctx.device.type, (dp, tp)", "ctx.device.type, (tp, dp)")],
        "the mesh built is",
    ),
]


# ---------------------------------------------------------------------------------- ddp_basics/
DDP_BASICS = []


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
