"""Issue 18, item 3: the pipelined ring all-reduce (primitives/ring_all_reduce_pipelined.py). Real torchrun at 2
ranks, `python lesson.py --nproc 3`, the warm launcher at 4; lengths that divide by neither N nor the chunk count,
and lengths smaller than N x chunks (empty pieces). Adding a chunk before its receive has completed must fail the
bit-for-bit check; bad flags stop every rank with one line."""

import re

import pytest
from harness import assert_fails, assert_ok, run_lesson

LESSON = "primitives/ring_all_reduce_pipelined.py"
T = 240  # seconds: generous, the CI machine is small and shared
SIZES, CHUNKS = (
    [1, 7, 1001],
    [1, 3],
)  # 7 and 1001 divide by none of 2..4 nor by 3; 1 and 7 leave pieces empty
ARGS = [
    "--sizes",
    ",".join(map(str, SIZES)),
    "--chunks",
    ",".join(map(str, CHUNKS)),
    "--iters",
    "1",
]


@pytest.mark.parametrize(
    "nproc,launcher",
    [(2, "torchrun"), (3, "python"), pytest.param(4, "warm", marks=pytest.mark.quick)],
)
def test_ring_all_reduce_pipelined(nproc, launcher):
    result = run_lesson(LESSON, *ARGS, nproc=nproc, launcher=launcher, timeout=T)
    ok = assert_ok(result)
    assert (
        f"bit for bit on {nproc} ranks at sizes {SIZES}" in ok and "(1, 3 chunks per segment" in ok
    ), ok
    ways = ["dist.all_reduce", "plain ring"] + [f"pipelined, {c} chunk(s)" for c in CHUNKS]
    rows = re.findall(r"^\s*(\d+)  (\S.*?)\s+(\d+\.\d+)\s+(\d+\.\d+)x$", result.stdout, re.M)
    assert [(int(n), way) for n, way, _, _ in rows] == [(n, way) for n in SIZES for way in ways], (
        result.stdout
    )
    for n, way, ms, speed in rows:  # measured: positive, and dist.all_reduce is its own yardstick
        assert float(ms) > 0 and (way != "dist.all_reduce" or float(speed) == 1.0), (
            n,
            way,
            ms,
            speed,
        )
    split = re.findall(
        r"^\[rank (\d+)\] (\d+) chunk\(s\): total .* post .* wait .* add .* other",
        result.stdout,
        re.M,
    )
    assert split == [(str(r), str(c)) for c in CHUNKS for r in range(nproc)], result.stdout


def test_reduce_before_wait_fails_the_check():
    # The add races the receive into the same buffer: with 4 pieces per segment at 3 ranks, 16 adds per rank on
    # 16 K-element pieces, every one of them would have to lose the race to the receive for the sum to come out right.
    result = run_lesson(
        LESSON,
        "--sizes",
        "65537",
        "--chunks",
        "4",
        "--iters",
        "1",
        "--reduce-before-wait",
        nproc=3,
        launcher="warm",
        timeout=T,
    )
    assert_fails(
        result, "pipelined ring (4 chunks) all-reduce of 65537 elements differs from a plain sum"
    )


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--chunks", "2,0"], "--chunks must be positive integers separated by commas"),
        (["--sizes", "4,-1"], "--sizes must be positive integers separated by commas"),
    ],
)
def test_bad_flags(flags, message):
    result = run_lesson(LESSON, *flags, nproc=2, launcher="warm", timeout=T)
    assert_fails(result, message, within=2)
    assert "Traceback" not in result.output, result.output
