"""Issue 16, context parallelism: transformer_basics/ring_attention.py (causal zig-zag ring
attention by hand) at 3 (python --nproc), 2 and 4 ranks (warm launcher), and
transformer_basics/ulysses.py (all_to_all between a sequence split and a head split) at 1 (python
--nproc), 2 and 4 (warm). The mistakes their checks catch (an average instead of the log-sum-exp
merge, no last hop home for dK, dV, a received block read before its wait(), no transpose before
the all_to_all back) are source mutations in tests/test_mutations.py; here, a bad size gets a
one-line error."""

import re

import pytest
from harness import assert_fails, assert_ok, run_lesson

RING, ULYSSES = "transformer_basics/ring_attention.py", "transformer_basics/ulysses.py"
T = 240  # seconds: generous, the CI machine is small and shared
ERRORS = re.compile(
    r"^\[rank (\d+)\] max error vs full attention, relative to the largest entry: output (\S+), "
    r"dq (\S+), dk (\S+), dv (\S+) \(bound (\S+)\)$",
    re.M,
)


def check_errors(out, nproc, seq=48, head_dim=8):
    found = ERRORS.findall(out)
    assert [int(r) for r, *_ in found] == list(range(nproc)), out
    for _, *errors, bound in found:
        # the lessons' bound
        assert float(bound) == pytest.approx(8 * (seq + head_dim) * 2.0**-52, rel=0.05), out
        assert all(float(e) <= float(bound) for e in errors), out


@pytest.mark.parametrize(
    "nproc,launcher", [(2, "warm"), (3, "python"), pytest.param(4, "warm", marks=pytest.mark.quick)]
)
def test_ring_attention(nproc, launcher):
    result = run_lesson(RING, nproc=nproc, launcher=launcher, timeout=T)
    ok = assert_ok(result)
    c = 48 // (2 * nproc)
    assert ok.startswith(
        f"OK: causal ring attention over {nproc} rank(s) (zig-zag, {c} tokens per chunk) equals "
        "full attention"
    ), ok
    check_errors(result.stdout, nproc)
    rows = re.findall(
        r"^\[rank (\d+)\] chunks (\d+) and (\d+): positions (\d+)\.\.(\d+) and (\d+)\.\.(\d+); "
        r"(\d+) ring step\(s\), (\d+) query-key scores computed "
        r"\(a contiguous split would give it (\d+)\)$",
        result.stdout,
        re.M,
    )
    got = [tuple(map(int, row)) for row in rows]
    # rank r holds chunks r and 2N-1-r; every rank computes the same number of scores (the
    # zig-zag's point): its own two chunks causally (2c x 2c, masked), then half a 2c x 2c block
    # at each of the N-1 other steps
    assert got == [
        (
            r,
            r,
            2 * nproc - 1 - r,
            r * c,
            (r + 1) * c - 1,
            (2 * nproc - 1 - r) * c,
            (2 * nproc - r) * c - 1,
            nproc,
            4 * c * c + (nproc - 1) * 2 * c * c,
            (r + 1) * 4 * c * c,
        )
        for r in range(nproc)
    ], result.stdout


def test_ring_attention_bad_seq_is_one_line():
    assert_fails(
        run_lesson(RING, "--seq", "50", nproc=2, launcher="warm", timeout=T),
        "--seq 50 must divide into 2 x 2 chunks: use a multiple of 4",
        within=2,
    )


@pytest.mark.parametrize(
    "nproc,launcher", [(2, "warm"), (1, "python"), pytest.param(4, "warm", marks=pytest.mark.quick)]
)
def test_ulysses(nproc, launcher):
    result = run_lesson(ULYSSES, nproc=nproc, launcher=launcher, timeout=T)
    ok = assert_ok(result)
    h, t = 8 // nproc, 48 // nproc
    assert ok.startswith(
        f"OK: Ulysses attention over {nproc} rank(s) ({h} head(s) each between two all_to_alls) "
        "equals full attention"
    ), ok
    check_errors(result.stdout, nproc)
    for r in range(nproc):
        assert (
            f"[rank {r}] positions {r * t}..{(r + 1) * t - 1} of all 8 heads (2, 8, {t}, 8) -> "
            f"heads {r * h}..{(r + 1) * h - 1} at all 48 positions (2, {h}, 48, 8) -> back"
        ) in result.stdout, result


def test_ulysses_heads_must_divide_is_one_line():
    assert_fails(
        run_lesson(ULYSSES, nproc=3, launcher="warm", timeout=T),
        "--heads 8 must divide by the world size 3",
        within=3,
    )
