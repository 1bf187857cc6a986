"""primitives/flight_recorder.py: each fault's culprit and collective are found in the ranks' flight
records, by the lesson's own reading and by torch's analyzer, at 2, 3 and 4 ranks.

The mistakes that the check must catch (the wrong rank singled out, the fault made on another rank
than the lesson thinks) are rows of tests/test_mutations.py.
"""

import pytest

from harness import assert_fails, assert_ok, run_lesson

LESSON = "primitives/flight_recorder.py"
T = 240  # three 3 s hangs, one analyzer run, under the suite's load


@pytest.mark.parametrize(
    "nproc, launcher, args",
    [
        pytest.param(2, "python", [], marks=pytest.mark.quick),
        (3, "warm", []),
        (4, "warm", ["--culprit", "1"]),
    ],
)
def test_every_fault_names_its_culprit(nproc, launcher, args):
    result = run_lesson(LESSON, *args, nproc=nproc, launcher=launcher, timeout=T)
    culprit = args[1] if args else str(nproc - 1)
    assert assert_ok(result).startswith(f"OK: the flight record names the culprit, rank {culprit}")
    for fault in ("skip", "order", "size"):
        assert f"[{fault}] last collective per rank" in result.stdout, result
    assert "Not all ranks joining collective, sequence number: 5" in result.stdout, result


def test_a_culprit_outside_the_world_is_one_line():
    result = run_lesson(LESSON, "--culprit", "3", nproc=2, launcher="warm", timeout=60)
    assert_fails(result, "--culprit must be a rank below 2", within=2)
