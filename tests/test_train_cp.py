"""Issue 16: the GPT trained with a context-parallel dimension (transformer_basics/train_cp.py).
`python lesson.py --nproc 4` (dp 2 x cp 2), the warm launcher at 2 (cp 2), 3 (cp 3) and 1; a --cp
that does not divide the world and a --block-size that is not a multiple of 2 x cp get a one-line
error. The position embedding given 0..T/cp-1 (model.py's numbering) is a source mutation in
tests/test_mutations.py, which the check against one process catches."""

import re

import pytest
from harness import assert_fails, assert_ok, run_lesson

LESSON = "transformer_basics/train_cp.py"
T = 240  # seconds: generous, the CI machine is small and shared
BLOCK, LAYERS, BATCH, STEPS, EMBD = 96, 2, 2, 3, 32  # the lesson's defaults
ERRORS = re.compile(
    r"^\[rank (\d+)\] max error vs one process: loss (\S+) \(relative\), parameters (\S+) of the "
    r"largest update \((\S+)\); bound (\S+)$",
    re.M,
)


def bound(dp):
    return 8 * STEPS * (dp * BATCH * BLOCK + 4 * EMBD) * 2.0**-23  # check_against_one_process


@pytest.mark.parametrize(
    "nproc,launcher,cp",
    [
        (2, "warm", 2),
        (4, "python", 2),
        (3, "warm", 3),
        pytest.param(1, "warm", 1, marks=pytest.mark.quick),
    ],
)
def test_train_cp(nproc, launcher, cp):
    result = run_lesson(LESSON, nproc=nproc, launcher=launcher, timeout=T)
    ok, out, dp, c = assert_ok(result), result.stdout, nproc // cp, BLOCK // (2 * cp)
    assert ok.startswith(
        f"OK: the GPT trained {STEPS} steps with context parallelism on a {dp}x{cp} (dp x cp) "
        "mesh, ring attention in every block: losses and parameters equal one process's"
    ), ok
    # rank r = d * cp + j: the cp rows are neighbouring ranks; chunks j and 2cp-1-j
    for r in range(nproc):
        d, j = divmod(r, cp)
        assert (
            f"[rank {r}] dp {d}/{dp}, cp {j}/{cp}: positions {j * c}..{(j + 1) * c - 1} and "
            f"{(2 * cp - 1 - j) * c}..{(2 * cp - j) * c - 1} of {BATCH} window(s) per step"
        ) in out, out
        # per block: forward passes K, V on cp-1 times, backward cp times (the last hop brings
        # dK, dV home), each pass an isend and an irecv; the model's ~0.15 MB of gradients fit
        # one DDP bucket (the first: 1 MiB)
        p2p = LAYERS * 2 * (2 * cp - 1) if cp > 1 else 0
        assert (
            f"[rank {r}] one step: {p2p} p2p ops (isend + irecv, cp row), 1 all_reduce (DDP, world)"
            in out
        ), out
    rows = re.findall(
        r"^  T +(\d+): one process, T tokens +([\d,.]+) \| cp (\d+), T/\d+ tokens +([\d,.]+) \| "
        r"ratio (\S+)$",
        out,
        re.M,
    )
    assert [int(t) for t, *_ in rows] == [BLOCK // 4, BLOCK // 2, BLOCK], out
    one = [float(a.replace(",", "")) for _, a, *_ in rows]
    for _, a, got_cp, b, ratio in rows:  # activations per token: a rank of cp holds 1/cp of them
        assert int(got_cp) == cp and float(ratio) == pytest.approx(1 / cp, abs=0.002), out
    assert one[1] == pytest.approx(2 * one[0], rel=0.01) and one[2] == pytest.approx(
        2 * one[1], rel=0.01
    ), out
    assert len(re.findall(r"^step \d+: loss \S+ \(one process \S+\)$", out, re.M)) == STEPS, out
    errors = ERRORS.findall(out)
    assert [int(r) for r, *_ in errors] == list(range(nproc)), out
    for _, loss, params, _, printed in errors:
        assert float(printed) == pytest.approx(bound(dp), rel=0.05), out
        assert float(loss) <= float(printed) and float(params) <= float(printed), out


@pytest.mark.parametrize(
    "args,nproc,message",
    [
        (["--cp", "3"], 2, "--cp 3 must divide the world size 2: the ranks form a dp x cp grid"),
        (
            ["--block-size", "50"],
            2,
            "--block-size 50 must be a multiple of 2 x --cp = 4: each cp rank takes two chunks",
        ),
    ],
)
def test_bad_size_is_one_line(args, nproc, message):
    assert_fails(
        run_lesson(LESSON, *args, nproc=nproc, launcher="warm", timeout=T), message, within=nproc
    )
