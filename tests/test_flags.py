"""Every flag of every lesson is refused where it is parsed when its value makes no sense.

For each lesson (found by tests/lesson_cli.lessons(), so a lesson added later is covered without
editing this file), in this process and with no rank started: build its parser, then give each
numeric flag 0, -1, nan, inf, -inf and 10**15, and each file flag a missing file. Each value is
either refused by argparse (exit 2, one "error:" line that names the flag) or inside the range the
flag's type declares, which --help prints (launch/dist_setup.py). A numeric flag with a bare
`type=int` or `type=float` fails here: it has no range, so 0 or 10**15 would reach the lesson.
"""

import argparse
import math

import pytest

from lesson_cli import lesson_parser, lessons, parse

pytestmark = pytest.mark.quick

BAD_NUMBERS = ["0", "-1", "nan", "inf", "-inf", "1e15", str(10**15)]
LARGEST = 10**12  # an upper bound must be finite and below this: 10**15 steps would never end


def flags(parser):
    """The options that take a value (not --help, not store_true)."""
    return [a for a in parser._actions if a.option_strings and a.nargs != 0]


def declared_legal(kind, text):
    try:
        kind(text)
        return True
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        return False


def flag_problems(lesson):
    parser = lesson_parser(lesson)
    problems = []
    for action in flags(parser):
        name, kind = action.option_strings[-1], action.type
        if kind in (int, float):
            problems.append(
                f"{name}: bare type={kind.__name__}; use launch.dist_setup (int_in, ...)"
            )
            continue
        high = getattr(kind, "high", None)
        if high is not None:
            if not (math.isfinite(high) and high < LARGEST):
                problems.append(f"{name}: its upper bound {high} is not below {LARGEST:g}")
            values = BAD_NUMBERS
        elif getattr(kind, "__name__", "") == "a readable file":
            values = ["/nonexistent/not-a-checkpoint.pt"]
        else:
            continue  # strings (checked by the lesson) and choices (argparse checks those)
        for value in values:
            code, output, _ = parse(parser, [name, value])
            if declared_legal(kind, value):
                if code != 0:
                    problems.append(f"{name} {value}: inside its declared range but exits {code}")
                continue
            errors = [line for line in output.splitlines() if "error:" in line]
            if code != 2 or len(errors) != 1 or name not in errors[0]:
                problems.append(f"{name} {value}: exit {code}, output {output[-300:]!r}")
    return problems


@pytest.mark.parametrize("lesson", lessons())
def test_every_flag_refuses_what_makes_no_sense(lesson):
    problems = flag_problems(lesson)
    assert not problems, f"{lesson}:\n" + "\n".join(problems)


def test_a_lesson_without_a_range_fails_here(tmp_path):
    """The test above catches the mistake it is for: a lesson flag with a bare type=int."""
    from harness import ROOT, mutant

    assert flag_problems(ROOT / "primitives/all_reduce.py") == []
    copy = mutant(tmp_path, "primitives/all_reduce.py", ("type=int_in(1, 1_000_000)", "type=int"))
    problems = flag_problems(copy)
    assert problems == ["--size: bare type=int; use launch.dist_setup (int_in, ...)"], problems
