"""ddp_basics/distributed_eval.py (issue 15): exact distributed evaluation against one process, at
world sizes that divide the data set (1, 2, 4 of 100 samples) and one that does not (3), as
`python lesson.py --nproc 3` and through the warm launcher (issue 33). The padding mask left out,
failing the check: tests/test_mutations.py (DDP_BASICS)."""

import re

import pytest

from harness import assert_ok, run_lesson

LESSON, TIMEOUT = "ddp_basics/distributed_eval.py", 240
FIGURES = re.compile(
    r"naive \(mean of the ranks' means\): loss (\S+), accuracy (\S+)\n"
    r"exact \(SUMs, padding masked\): +loss (\S+), accuracy (\S+) \((\d+)/(\d+)\)\n"
    r"one process, whole set: +loss (\S+), accuracy (\S+) \((\d+)/(\d+)\); "
    r"\|exact - one process\| (\S+) \(tolerance (\S+)\)"
)


def check_figures(result, nproc, samples=100):
    out = result.stdout
    each, padded = -(-samples // nproc), -samples % nproc
    assert f"{samples} samples, {nproc} rank(s), {each} each, {padded} padded" in out, out
    m = FIGURES.search(out)
    assert m, out
    naive_loss, _, exact_loss, _, correct, count, ref_loss, _, ref_correct, ref_count, diff, tol = (
        m.groups()
    )
    # the exact metrics equal one process's: counts exactly, the loss within the printed bound
    assert int(count) == int(ref_count) == samples and int(correct) == int(ref_correct), out
    assert float(diff) <= float(tol) < 1e-4, out
    assert abs(float(exact_loss) - float(ref_loss)) <= 2e-6, out
    # the naive loss is off (beyond the bound) exactly when the world size does not divide the set
    off = abs(float(naive_loss) - float(ref_loss))
    assert (off > 1e-4) if samples % nproc else (off < 2e-6), out
    gathered = f"rank 0 gathered {samples} predictions for {samples} samples: 0 duplicates, "
    assert gathered + "0 missing, 0 differ" in out, out


def test_python_launcher_3():  # 3 does not divide 100: 2 padded samples
    result = run_lesson(LESSON, nproc=3, launcher="python", timeout=TIMEOUT)
    assert "the naive mean of means is off by" in assert_ok(result)
    check_figures(result, 3)


@pytest.mark.parametrize("nproc", [1, 2, pytest.param(4, marks=pytest.mark.quick)])
def test_warm(nproc):
    result = run_lesson(LESSON, nproc=nproc, launcher="warm", timeout=TIMEOUT)
    assert "equals one process" in assert_ok(result)
    check_figures(result, nproc)


def test_other_sizes_warm():
    """7 samples on 4 ranks, batches of 1: one padded; 2 samples on 3 ranks: fewer samples than
    ranks, each sample once among the real ones."""
    for samples, nproc in [(7, 4), (2, 3)]:
        result = run_lesson(
            LESSON,
            *("--samples", samples, "--batch", "1"),
            nproc=nproc,
            launcher="warm",
            timeout=TIMEOUT,
        )
        assert_ok(result)
        check_figures(result, nproc, samples=samples)
