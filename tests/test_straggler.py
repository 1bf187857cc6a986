"""launch/straggler.py (issue 53): the rank slowed by --slow-rank R --slow-ms T is named in every
report, by about T ms a step, and no other rank is, at 2, 3 and 4 ranks; the others' wait shows what
it costs them. Without the lever the lesson names no rank on purpose and its check is the timing
bound (every rank's compute + wait covers the slowest rank's compute). The mistakes a reader could
make (naming by wait, timing the wait into compute, not timing the wait) are copies of the lesson in
tests/test_mutations.py.
"""

import re

import pytest

from harness import assert_ok, run_lesson

LESSON = "launch/straggler.py"
T = 180
REPORT = re.compile(r"^step (\d+): compute\+wait ms/step by rank: (.*); slow: (.*)$", re.M)


@pytest.mark.parametrize("nproc, slow", [(2, 1), (3, 0), (4, 2)])
def test_the_slowed_rank_and_none_other_is_named(nproc, slow):
    result = run_lesson(LESSON, "--slow-rank", slow, nproc=nproc, launcher="warm", timeout=T)
    ok = assert_ok(result)
    assert ok.startswith(f"OK: all 3 reports named rank {slow} and no other"), ok
    reports = REPORT.findall(result.stdout)
    assert [int(step) for step, _, _ in reports] == [10, 20, 30], str(result)
    for _, times, named in reports:
        assert re.fullmatch(rf"rank {slow} by [\d.]+ ms \(\d+% of a step\)", named), str(result)
        pairs = [tuple(map(float, pair.split("+"))) for pair in times.split()]
        assert len(pairs) == nproc, times
        others = [wait for rank, (_, wait) in enumerate(pairs) if rank != slow]
        assert min(others) > 25, f"the others waited less than half of --slow-ms 50: {times}"


@pytest.mark.quick
def test_without_the_lever_it_runs_and_checks_its_timing():
    result = run_lesson(LESSON, nproc=3, launcher="python", timeout=T)
    assert assert_ok(result).startswith("OK: 3 reports, no rank slowed"), str(result)
