"""argparse types that carry a range, so a bad value stops where it is parsed.

    parser.add_argument("--steps", type=int_in(1, 10_000), default=20)
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.1)
    parser.add_argument("--sizes", type=ints_in(1, 2**31), default=[1024])

`--steps 0` then ends with argparse's one line, "error: argument --steps: 0 is not an integer
in [1, 10000]", and exit code 2, on every rank (each rank parses under torchrun), before any
process group starts. Every number is finite and bounded above: nan, inf or 10**15 never reach
the lesson. The range shows in --help (launch/dist_setup.lesson_parser adds it). Constraints
between flags, or between a flag and the world size, are the lesson's `ctx.require(...)` lines.
"""

import argparse
import math
import os


def _bounds(low, high, low_open):
    return f"{'(' if low_open else '['}{low:g}, {high:g}]"


def _ranged(kind, low, high, low_open=False):
    noun = "an integer" if kind is int else "a number"
    where = _bounds(low, high, low_open)

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if (
            value is None
            or not math.isfinite(value)
            or value < low
            or (low_open and value == low)
            or value > high
        ):
            raise argparse.ArgumentTypeError(f"{text} is not {noun} in {where}")
        return value

    parse.__name__ = f"{noun} in {where}"
    parse.low, parse.high, parse.low_open, parse.kind = low, high, low_open, kind
    return parse


def int_in(low, high):
    """An integer in [low, high]."""
    return _ranged(int, low, high)


def float_in(low, high, low_open=False):
    """A finite number in [low, high], or in (low, high] with low_open=True."""
    return _ranged(float, float(low), float(high), low_open)


def ints_in(low, high):
    """A comma-separated list of integers, each in [low, high] (e.g. 1024,1048576)."""
    one, name = (
        int_in(low, high),
        f"a comma-separated list of integers in {_bounds(low, high, False)}",
    )

    def parse(text):
        parts = [p.strip() for p in text.split(",")]
        if not all(parts):
            raise argparse.ArgumentTypeError(f"{text!r} is not {name}")
        return [one(p) for p in parts]

    parse.__name__ = name
    parse.low, parse.high, parse.low_open, parse.kind = low, high, False, list
    return parse


def existing_file(text):
    """A path to a file that exists and can be read (a checkpoint to resume from, say)."""
    if not os.path.isfile(text) or not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text} is not a readable file")
    return text


existing_file.__name__ = "a readable file"
