"""Issue 18, item 3: the pipelined ring all-reduce (primitives/ring_all_reduce_pipelined.py). The
warm launcher at 2 and 4 ranks, `python lesson.py --nproc 3`; lengths that divide by neither N nor
the chunk count, and lengths smaller than N x chunks (empty pieces). Adding a chunk before its
receive has completed fails the bit-for-bit check (tests/test_mutations.py); a 0 in --sizes or
--chunks is refused by argparse (tests/test_primitives_advanced.py, tests/test_flags.py)."""

import re

import pytest
from harness import assert_ok, run_lesson

LESSON = "primitives/ring_all_reduce_pipelined.py"
T = 240  # seconds: generous, the CI machine is small and shared
# 7 and 1001 divide by none of 2..4 nor by 3; 1 and 7 leave pieces empty
SIZES, CHUNKS = [1, 7, 1001], [1, 3]
ARGS = ["--sizes", ",".join(map(str, SIZES)), "--chunks", ",".join(map(str, CHUNKS))]


@pytest.mark.parametrize(
    "nproc,launcher", [(2, "warm"), (3, "python"), pytest.param(4, "warm", marks=pytest.mark.quick)]
)
def test_ring_all_reduce_pipelined(nproc, launcher):
    result = run_lesson(LESSON, *ARGS, "--iters", "1", nproc=nproc, launcher=launcher, timeout=T)
    ok = assert_ok(result)
    assert f"bit for bit on {nproc} ranks at sizes {SIZES}" in ok, ok
    assert "(1, 3 chunks per segment" in ok, ok
    ways = ["dist.all_reduce", "plain ring"] + [f"pipelined, {c} chunk(s)" for c in CHUNKS]
    rows = re.findall(r"^\s*(\d+)  (\S.*?)\s+(\d+\.\d+)\s+(\d+\.\d+)x$", result.stdout, re.M)
    assert [(int(n), way) for n, way, _, _ in rows] == [(n, way) for n in SIZES for way in ways], (
        result.stdout
    )
    for n, way, ms, speed in rows:  # measured: positive; dist.all_reduce is its own yardstick
        assert float(ms) > 0, (n, way, ms)
        assert way != "dist.all_reduce" or float(speed) == 1.0, (n, way, speed)
    split = re.findall(
        r"^\[rank (\d+)\] (\d+) chunk\(s\): total .* post (.*) wait (.*) add (.*) other",
        result.stdout,
        re.M,
    )
    assert [(r, c) for r, c, *_ in split] == [
        (str(r), str(c)) for c in CHUNKS for r in range(nproc)
    ], result.stdout
    # the lesson's timed_calls saw the three calls: each part is measured, not zero
    assert all(float(t) > 0 for *_, post, wait, add in split for t in (post, wait, add)), split
