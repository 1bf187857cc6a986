"""ddp_basics/distributed_eval.py (issue 15): exact distributed evaluation against one process, at world
sizes that divide the data set (1, 2, 4 of 100 samples) and one that does not (3), under real torchrun,
the `python lesson.py --nproc N` path and the warm launcher; the padding mask broken on purpose."""

import re

import pytest

from harness import assert_fails, assert_ok, run_lesson

LESSON, TIMEOUT = "ddp_basics/distributed_eval.py", 240
FIGURES = re.compile(
    r"naive \(mean of the ranks' means\): loss (\S+), accuracy (\S+)\n"
    r"exact \(SUMs, padding masked\): +loss (\S+), accuracy (\S+) \((\d+)/(\d+)\)\n"
    r"one process, whole set: +loss (\S+), accuracy (\S+) \((\d+)/(\d+)\); "
    r"\|exact - one process\| (\S+) \(tolerance (\S+)\)"
)


def check_figures(result, nproc, samples=100):
    out = result.stdout
    assert (
        f"{samples} samples, {nproc} rank(s), {-(-samples // nproc)} each, {-samples % nproc} padded"
        in out
    ), out
    m = FIGURES.search(out)
    assert m, out
    naive_loss, _, exact_loss, _, correct, count, ref_loss, _, ref_correct, ref_count, diff, tol = (
        m.groups()
    )
    # the exact metrics equal one process's: counts exactly, the loss within the printed float32 bound
    assert int(count) == int(ref_count) == samples and int(correct) == int(ref_correct), out
    assert float(diff) <= float(tol) < 1e-4 and abs(float(exact_loss) - float(ref_loss)) <= 2e-6, (
        out
    )
    # the naive loss is off (beyond the bound) exactly when the world size does not divide the data set
    off = abs(float(naive_loss) - float(ref_loss))
    assert (off > 1e-4) if samples % nproc else (off < 2e-6), out
    assert (
        f"rank 0 gathered {samples} predictions for {samples} samples: 0 duplicates, 0 missing, 0 differ"
        in out
    ), out


def test_torchrun_2():
    result = run_lesson(LESSON, nproc=2, launcher="torchrun", timeout=TIMEOUT)
    assert "equals one process" in assert_ok(result)
    check_figures(result, 2)


def test_python_launcher_3():  # 3 does not divide 100: 2 padded samples
    result = run_lesson(LESSON, nproc=3, launcher="python", timeout=TIMEOUT)
    assert "the naive mean of means is off by" in assert_ok(result)
    check_figures(result, 3)


@pytest.mark.parametrize("nproc", [1, pytest.param(4, marks=pytest.mark.quick)])
def test_warm(nproc):
    result = run_lesson(LESSON, nproc=nproc, launcher="warm", timeout=TIMEOUT)
    assert_ok(result)
    check_figures(result, nproc)


def test_other_sizes_warm():  # 7 samples on 4 ranks, batches of 1: one padded; on 4 ranks 2 samples pad alike
    result = run_lesson(
        LESSON, "--samples", "7", "--batch", "1", nproc=4, launcher="warm", timeout=TIMEOUT
    )
    assert_ok(result)
    check_figures(result, 4, samples=7)


def test_forgetting_the_mask_fails():
    result = run_lesson(LESSON, "--no-mask", nproc=3, launcher="warm", timeout=TIMEOUT)
    assert_fails(result, "differ from one process's")
    # printed by rank 0 before the barrier that precedes every raise, so it is there whichever rank fails first
    assert (
        "rank 0 gathered 102 predictions for 100 samples: 2 duplicates, 0 missing" in result.stdout
    ), result
    assert re.search(r"^exact \(SUMs, padding masked\):.*\(\d+/102\)$", result.stdout, re.M), result


def test_bad_flag_is_one_line():
    assert_fails(
        run_lesson(LESSON, "--samples", "0", nproc=2, launcher="warm", timeout=TIMEOUT),
        "--samples must be at least 1, got 0",
        within=2,
    )
