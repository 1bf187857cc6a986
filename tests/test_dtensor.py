"""Issue 15: DTensor from scratch (primitives/dtensor_basics.py, dtensor_redistribute.py,
dtensor_loss_parallel.py). Each lesson: the warm launcher at 3 ranks (uneven pieces) and 4,
`python lesson.py --nproc 2`. The taught step done wrong (from_local without shape, to_local read as
the value, a seed per rank, a relabel instead of redistribute, cross_entropy outside loss_parallel,
its backward outside it) fails its check: tests/test_mutations.py. A class count that leaves a rank
no class stops every rank with one line."""

import re

import pytest
from harness import assert_fails, assert_ok, run_lesson

BASICS, REDISTRIBUTE, LOSS = (
    f"primitives/dtensor_{name}.py" for name in ("basics", "redistribute", "loss_parallel")
)
T = 240  # seconds: generous, the CI machine is small and shared
LAUNCHERS = [(3, "warm"), (2, "python"), pytest.param(4, "warm", marks=pytest.mark.quick)]


def chunk_sizes(n, world):
    """torch.chunk's split, as DTensor's Shard uses it (distribute_tensor's docstring): ceil(n /
    world) each."""
    size = -(-n // world)
    return [max(0, min(size, n - r * size)) for r in range(world)]


@pytest.mark.parametrize("nproc,launcher", LAUNCHERS)
def test_dtensor_basics(nproc, launcher):
    result = run_lesson(BASICS, nproc=nproc, launcher=launcher, timeout=T)
    ok = assert_ok(result)
    assert ok.startswith(f"OK: 10 rows over {nproc} rank(s) as Shard(0)"), ok
    pieces = re.findall(
        r"^\[rank (\d+)\] rows S\(0\) of \(10, 4\): local piece \((\d+), 4\).*; noise (\[.*\])$",
        result.stdout,
        re.M,
    )
    assert [(int(r), int(k)) for r, k, _ in pieces] == list(enumerate(chunk_sizes(10, nproc))), (
        result.stdout
    )
    # CPU: no DTensor RNG tracker, every rank draws from its own generator with the same seed
    assert (
        len({noise for *_, noise in pieces}) == 1
        and "every shard drew the same numbers (CPU)" in ok
    ), ok
    for name, placement in [
        ("from_local(Partial)", "P(sum)"),
        ("rows @ w", "S(0)"),
        ("Shard(1) @ Shard(0)", "P(sum)"),
        ("rows.sum()", "P(sum)"),
    ]:
        assert (
            f"{name}: placement {placement}, full_tensor matches plain torch: True" in result.stdout
        ), result.stdout
    assert "the three ops ran on the local pieces: 0 collectives" in result.stdout, result.stdout


# What each move costs on Gloo/CPU, as the lesson counts it (Shard -> Shard: an all_gather and a
# chunk, since DTensor's shard_dim_alltoall falls back on CPU:
# torch/distributed/tensor/_collective_utils.py).
CPU_TABLE = {
    "distribute_tensor -> Shard(0)": ("scatter x1", "S(0)"),
    "distribute_tensor -> Replicate": ("broadcast x1", "R"),
    "Shard(0) -> Replicate": ("all_gather_into_tensor x1", "R"),
    "Partial -> Replicate": ("all_reduce x1", "R"),
    "Partial -> Shard(0)": ("reduce_scatter_tensor x1", "S(0)"),
    "Shard(0) -> Shard(1)": ("all_gather_into_tensor x1", "S(1)"),
    "Shard(1) -> Shard(0)": ("all_gather_into_tensor x1", "S(0)"),
    "Replicate -> Shard(0)": ("none", "S(0)"),
    "Replicate -> Partial": ("none", "refused: Can not redistribute from R to P(sum)"),
    "Shard(0).full_tensor()": ("all_gather_into_tensor x1", "a plain tensor"),
    "Partial.full_tensor()": ("all_reduce x1", "a plain tensor"),
}


@pytest.mark.parametrize("nproc,launcher", LAUNCHERS)
def test_dtensor_redistribute(nproc, launcher):
    result = run_lesson(REDISTRIBUTE, nproc=nproc, launcher=launcher, timeout=T)
    ok = assert_ok(result)
    assert ok.startswith(f"OK: 11 moves over {nproc} rank(s) (10 x 6)"), ok
    rows = {
        m[0].strip(): (m[1].strip(), m[2].strip())
        for m in re.findall(r"^(.{32}) (.{36}) (.+)$", result.stdout, re.M)
        if m[0].strip() in CPU_TABLE
    }
    for move, (calls, placement) in CPU_TABLE.items():
        assert rows[move][0] == calls and rows[move][1].startswith(placement), (
            move,
            rows.get(move),
            result.stdout,
        )
    sizes = chunk_sizes(10, nproc)
    for r in range(nproc):
        assert f"[rank {r}] my pieces: ({sizes[r]}, 6), (10, 6)" in result.stdout, result.stdout


@pytest.mark.parametrize("nproc,launcher", LAUNCHERS)
def test_dtensor_loss_parallel(nproc, launcher):
    result = run_lesson(LOSS, nproc=nproc, launcher=launcher, timeout=T)
    ok = assert_ok(result)
    assert ok.startswith(
        f"OK: cross-entropy on logits sharded by class over {nproc} rank(s) (8 x 16)"
    ), ok
    assert "gradient, Shard(1) like the logits; the logits were never gathered" in ok, ok
    shapes = re.findall(
        r"^\[rank (\d+)\] logits \(8, 16\) split by class: local logits \(8, (\d+)\), "
        r"local gradient \(8, (\d+)\)$",
        result.stdout,
        re.M,
    )
    assert [(int(r), int(a), int(b)) for r, a, b in shapes] == [
        (r, k, k) for r, k in enumerate(chunk_sizes(16, nproc))
    ], result.stdout
    assert "collectives on each rank, forward and backward: {'all_reduce': 3}" in result.stdout, (
        result.stdout
    )
    errs = re.search(r"relative error (\S+), gradient (\S+) \(bound (\S+)\)", result.stdout)
    assert errs and max(float(errs[1]), float(errs[2])) <= float(errs[3]), result.stdout


@pytest.mark.parametrize("classes,nproc", [(2, 3), (5, 4)])
def test_dtensor_loss_parallel_refuses_a_rank_without_a_class(classes, nproc):
    """torch.chunk's split of 2 classes over 3 ranks, or 5 over 4 (2, 2, 1, 0), leaves the last rank
    no class: one line on every rank, no traceback (--classes 0 itself: tests/test_flags.py)."""
    result = run_lesson(LOSS, "--classes", str(classes), nproc=nproc, launcher="warm", timeout=T)
    assert_fails(result, "leaves the last rank no class", within=nproc)
    assert "Traceback" not in result.output, result.output
