"""fsdp_basics/fsdp_memory_plan.py (issue 15): per-rank FSDP2 bytes planned on a fake process group
for 8..1024 ranks, and equal to what real ranks hold after a step at 3 (`python lesson.py --nproc`),
2 and 4 (warm launcher); GiB per rank by strategy against the formula (its flags' bounds:
tests/test_flags.py). The plan made without fully_shard, and the saved weight counted as an
activation, are rows of tests/test_mutations.py."""

import math
import re

import pytest

from harness import assert_ok, run_lesson

LESSON = "fsdp_basics/fsdp_memory_plan.py"
T = 300  # generous: the lesson starts a planner process (torch import)
REAL_WIDTH = 62
ROW = re.compile(r"^ +(\d+) +(\S+) +(\S+) +(\S+) +(\S+) +(\S+) +(\S+)$", re.M)
STRATEGY = re.compile(r"^ +(\d+)" + r" +([\d.]+)" * 5 + "$", re.M)  # N, DDP, ZeRO-1, -2, -3, HSDP
RANK = re.compile(
    r"^\[rank (\d+)\] params, grads, Adam bytes: planned \[(\d+), (\d+), (\d+)\], "
    r"measured after a step \[(\d+), (\d+), (\d+)\]$",
    re.M,
)


def shapes(width, depth, classes=4):
    """toy.BlockMLP's parameter shapes, written out again here: input layer, blocks, head."""
    return (
        [(width, 2), (width,)] + [(width, width), (width,)] * depth + [(classes, width), (classes,)]
    )


def expected(width, depth, n, r):
    """[params, grads, Adam] bytes of rank r of n: storage padded to ceil(rows/n) rows, Adam on the
    unpadded rows."""
    held = [0, 0, 0]
    for shape in shapes(width, depth):
        chunk, row = -(-shape[0] // n), math.prod(shape[1:])
        rows = max(0, min(chunk, shape[0] - r * chunk))
        held = [held[0] + 4 * chunk * row, held[1] + 4 * chunk * row, held[2] + 8 * rows * row + 4]
    return held


def check_output(result, nproc, width=16384, depth=16, tokens=4096, max_ranks=1024):
    out = result.stdout
    ranks = [tuple(map(int, m)) for m in RANK.findall(out)]
    assert [m[0] for m in ranks] == list(range(nproc)), out
    for r, *got in ranks:
        assert got[:3] == got[3:] == expected(REAL_WIDTH, 2, nproc, r), (r, got, out)
    rows = ROW.findall(out)
    sizes = [2**k for k in range(3, int(math.log2(max_ranks)) + 1)]
    assert [int(row[0]) for row in rows] == sizes, out
    psi = sum(math.prod(s) for s in shapes(width, depth))
    for n, params, grads, adam, state, acts, total in rows:
        gib, n = 2**30, int(n)
        share = pytest.approx(4 * psi / n / gib, abs=0.002)
        assert float(params) == float(grads) == share, (n, out)
        assert float(state) == pytest.approx(16 * psi / n / gib, abs=0.003), (n, out)
        assert float(acts) == pytest.approx(8 * width * tokens * depth / gib, abs=0.001), out
        assert float(total) == pytest.approx(16 * psi / n / gib + float(acts), abs=0.004), out
    for t in (16, 32, 64):
        assert f"{t} tokens {8 * t * REAL_WIDTH:,} B" in out, out
    # the progress is a tqdm bar on stderr, on a terminal only: stdout holds the tables alone
    assert "planned rank" not in out and "planning" not in result.stderr, result.stderr[-500:]
    (p1, g1, a1), node = expected(width, depth, 1, 0), sizes[0]
    strategies = {int(m[0]): list(map(float, m[1:])) for m in STRATEGY.findall(out)}
    assert sorted(strategies) == sizes, out
    for n, got in strategies.items():  # DDP, ZeRO-1, ZeRO-2, ZeRO-3, HSDP(8), formula by formula
        p, g, a = expected(width, depth, n, 0)
        want = [
            p1 + g1 + a1,
            p1 + g1 + a,
            p1 + g + a,
            p + g + a,
            sum(expected(width, depth, node, 0)),
        ]
        assert got == pytest.approx([b / 2**30 for b in want], abs=6e-4), (n, got, out)
    return strategies


@pytest.mark.parametrize(
    "nproc,launcher", [(2, "warm"), (3, "python"), pytest.param(4, "warm", marks=pytest.mark.quick)]
)
def test_plan_matches_formula_and_real_run(nproc, launcher):
    result = run_lesson(LESSON, nproc=nproc, launcher=launcher, timeout=T)
    ok = assert_ok(result)
    assert "for 8..1024 ranks" in ok and f"each of {nproc} real ranks" in ok, ok
    check_output(result, nproc)
