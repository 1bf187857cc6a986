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
    # ring_all_reduce, ring_all_reduce_pipelined, benchmark_collectives, weight_sync, the DTensor
    # lessons, grad_through_collectives: one block, kept at the end of this list.
    Mutation(
        "ring_all_reduce-copy-instead-of-add",
        "primitives/ring_all_reduce.py",
        [("chunks[recv_i].add_(incoming)", "chunks[recv_i].copy_(incoming)")],
        "ring all-reduce of 7 elements differs from a plain sum",
        nproc=3,
        args=("--sizes", "7", "--iters", "1"),
        quick=True,
    ),
    Mutation(  # was --reduce-before-wait: with 4 pieces per segment at 3 ranks, 16 adds per rank
        # on 16 K-element pieces race their receives; every add would have to lose the race for
        # the sum to come out right
        "ring_all_reduce_pipelined-add-before-wait",
        "primitives/ring_all_reduce_pipelined.py",
        [  # the add moved from after the wait to before it
            (
                "into, works = posted[k]\n",
                "into, works = posted[k]\n        if add:\n            recv.add_(into)\n",
            ),
            ("            recv.add_(into)  # the overlap", "            pass  # the overlap"),
        ],
        "pipelined ring (4 chunks) all-reduce of 65537 elements differs from a plain sum",
        nproc=3,
        args=("--sizes", "65537", "--chunks", "4", "--iters", "1"),
    ),
    Mutation(  # was --corrupt-for-testing: the in-place all_gather idiom, the input never copied in
        "benchmark_collectives-all-gather-in-place-without-its-input",
        "primitives/benchmark_collectives.py",
        [
            (
                "lambda: ALL_GATHER_SINGLE(out, inp)",
                "lambda: ALL_GATHER_SINGLE(out, out[rank * part : (rank + 1) * part])",
            )
        ],
        "wrong result of all_gather",
        args=("--ops", "all_reduce,all_gather", "--max-bytes", "4K"),
        file="benchmark_calls.py",
    ),
    Mutation(  # the worker receives each bucket into a new tensor, not the one its parameters view
        "weight_sync-bucket-received-into-a-copy",
        "primitives/weight_sync.py",
        [
            (
                "dist.broadcast(flats[i], src=trainer, group=sync_group)",
                "dist.broadcast(_flatten_dense_tensors(bucket), src=trainer, group=sync_group)",
            )
        ],
        "after bucketed sync at step 0 a parameter of shape",
        args=("--steps", "1"),
    ),
    Mutation(  # was --from-local-without-shape: 10 rows as 4, 4, 2; from_local assumes 3 x local
        "dtensor_basics-from-local-without-shape",
        "primitives/dtensor_basics.py",
        [(", [Shard(0)], shape=full.shape, stride=full.stride())", ", [Shard(0)])")],
        "from_local gave global shape",
        nproc=3,
    ),
    Mutation(  # was --local-as-full: a Partial's to_local() is this rank's term, not the value
        "dtensor_basics-to-local-read-as-the-value",
        "primitives/dtensor_basics.py",
        [("{name: d.full_tensor() for", "{name: d.to_local() for")],
        "from_local(Partial): placement P(sum), full_tensor matches plain torch: False",
        nproc=3,
    ),
    Mutation(  # was --seed-per-rank; on CPU only: on CUDA DTensor copies rank 0's RNG state
        "dtensor_basics-a-seed-per-rank",
        "primitives/dtensor_basics.py",
        [("torch.manual_seed(args.seed)", "torch.manual_seed(args.seed + rank)")],
        "rand_like on CPU: ranks [1] did not draw what a generator seeded with --seed 0 draws",
    ),
    Mutation(  # was --relabel: a new label on the same local data, nothing moved
        "dtensor_redistribute-relabel-instead-of-redistribute",
        "primitives/dtensor_redistribute.py",
        [
            (
                "return src.redistribute(mesh, [dst])",
                "return DTensor.from_local(src.to_local(), mesh, [dst], shape=src.shape, "
                "stride=src.stride())",
            )
        ],
        "is not my R piece of the plain tensor",
        nproc=3,
    ),
    Mutation(  # was --without-loss-parallel: the same call outside the context gathers the logits
        "dtensor_loss_parallel-without-the-context",
        "primitives/dtensor_loss_parallel.py",
        [("with loss_parallel():", "with torch.enable_grad():")],
        "the logits were gathered ({'all_gather_into_tensor': 1})",
    ),
    Mutation(  # issue 32: the backward outside loss_parallel() runs, but gathers the gradient
        "dtensor_loss_parallel-backward-outside-the-context",
        "primitives/dtensor_loss_parallel.py",
        [("        with CommDebugMode() as backward:", "    with CommDebugMode() as backward:")],
        "the gradient of the logits is Replicate() with local shape (8, 16), not Shard(1)",
    ),
    Mutation(  # was --unreduced-backward: the hand-written gather is then the plain one
        "grad_through_collectives-backward-without-its-all-reduce",
        "primitives/grad_through_collectives.py",
        [("dist.all_reduce(grad, op=dist.ReduceOp.SUM)", "pass  # no all_reduce")],
        "autograd.Function by hand: max gradient error",
        nproc=3,
        args=("--batch", "4"),
        quick=True,
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
