"""Issue 15: gradients through collectives (primitives/grad_through_collectives.py). The warm
launcher at 1, 2 and 4 ranks, `python lesson.py --nproc 3`; the deprecated
torch.distributed.nn.functional path under its flag. The hand-written backward without its
all_reduce fails its check: tests/test_mutations.py."""

import re

import pytest
from harness import assert_ok, run_lesson

LESSON = "primitives/grad_through_collectives.py"
T = 240  # seconds: generous, the CI machine is small and shared
LAUNCHERS = [
    (2, "warm"),
    (3, "python"),
    (1, "warm"),
    pytest.param(4, "warm", marks=pytest.mark.quick),
]
FIXED = ["functional all_gather_single", "autograd.Function by hand"]


def errors(out):
    """{way: (max gradient error, bound or None)} from rank 0's lines."""
    return {
        name: (float(err), float(bound) if bound else None)
        for name, err, bound in re.findall(
            r"^with (.+?): max gradient error (\S+) \((?:bound (\S+)\)|expected: .*\))$", out, re.M
        )
    }


def bound(nproc, batch=8, dim_in=16):
    """The lesson's bound, derived in its check_gradients."""
    return 8 * (nproc * batch + dim_in) * 2.0**-23


@pytest.mark.parametrize("nproc,launcher", LAUNCHERS)
def test_grad_through_collectives(nproc, launcher):
    result = run_lesson(LESSON, nproc=nproc, launcher=launcher, timeout=T)
    ok = assert_ok(result)
    assert ok.startswith(
        f"OK: a global-batch contrastive loss over {nproc} rank(s) gets the single-process "
        "gradient through a differentiable all_gather (2 ways)"
    ), ok
    found = errors(result.stdout)
    assert list(found) == ["plain dist.all_gather", *FIXED], result.stdout
    for name in FIXED:
        err, printed_bound = found[name]
        assert printed_bound == pytest.approx(bound(nproc), rel=0.05) and err <= printed_bound, (
            name,
            found,
        )
    buggy = found["plain dist.all_gather"][0]
    if nproc == 1:  # nothing crosses ranks: the plain gather is exact too
        assert buggy <= bound(1) and "plain dist.all_gather does too at 1 rank" in ok, result.stdout
    else:  # the missing terms are a large part of the gradient, not rounding
        assert buggy > 0.05 and "plain dist.all_gather does not" in ok, result.stdout
    rows = re.findall(
        r"^\[rank (\d+)\] rows (\d+)\.\.(\d+) of (\d+), local loss", result.stdout, re.M
    )
    assert [(int(r), int(lo), int(hi), int(n)) for r, lo, hi, n in rows] == [
        (r, 8 * r, 8 * r + 7, 8 * nproc) for r in range(nproc)
    ], result.stdout


def test_deprecated_nn_functional_all_gather():
    result = run_lesson(LESSON, "--nn-functional", nproc=2, launcher="warm", timeout=T)
    ok = assert_ok(
        result,
        deprecated_on_purpose=r"torch\.distributed\.nn\.functional\.all_gather is deprecated",
    )
    assert "(3 ways)" in ok, ok
    err, printed_bound = errors(result.stdout)["torch.distributed.nn.functional.all_gather"]
    assert err <= printed_bound, result.stdout
