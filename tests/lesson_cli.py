"""A lesson's command line, parsed in this process, with nothing run: no rank, no process group.

    parser = lesson_parser("primitives/all_reduce.py")   # the ArgumentParser the lesson builds
    code, output, args = parse(parser, ["--size", "0"])  # argparse's verdict: 2 and its error line

The lesson's file is run as __main__ with ArgumentParser.parse_args stopped on entry, so whatever
the lesson does before it parses (import its siblings, build the parser) happens, nothing after it.
The lessons hold no hook for this: tests/test_flags.py uses it from outside.
"""

import argparse
import contextlib
import io
import os
import re
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class _Stop(Exception):
    def __init__(self, parser):
        self.parser = parser


def forget_repository_modules():
    """Drop the lesson folders' modules (a lesson's siblings) so the next lesson imports its own:
    two folders have a toy.py. launch/ stays: it is the same for every lesson; so do the tests'
    own modules (the warm launcher's module holds its servers)."""
    folders = tuple(str(ROOT / folder) + os.sep for folder in FOLDERS if folder != "launch")
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if path.startswith(folders) and not name.startswith("launch"):
            del sys.modules[name]


def lesson_parser(lesson, env=None):
    """The parser that `lesson` (a path, relative to the repository or absolute) builds."""
    path = Path(lesson) if Path(lesson).is_absolute() else ROOT / lesson
    forget_repository_modules()
    saved = list(sys.argv), list(sys.path), dict(os.environ)
    original = argparse.ArgumentParser.parse_args

    def stop(self, *args, **kwargs):
        raise _Stop(self)

    argparse.ArgumentParser.parse_args = stop
    try:
        os.environ.update(env or {})
        sys.argv = [str(path)]
        sys.path.insert(0, str(path.parent))
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(path), run_name="__main__")
    except _Stop as stopped:
        return stopped.parser
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv, sys.path[:] = saved[0], saved[1]
        os.environ.clear()
        os.environ.update(saved[2])
    raise AssertionError(f"{lesson} ran to its end without parsing a command line")


def parse(parser, argv):
    """(exit code, what argparse printed, the parsed namespace or None): 0 when argv parses."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            args = parser.parse_args([str(a) for a in argv])
    except SystemExit as stop:
        return (stop.code if isinstance(stop.code, int) else 1), out.getvalue(), None
    return 0, out.getvalue(), args


FOLDERS = ("launch", "primitives", "ddp_basics", "fsdp_basics", "transformer_basics")


def lessons():
    """Every lesson: a Python file of a lesson folder that runs as a script."""
    return sorted(
        str(p.relative_to(ROOT))
        for folder in FOLDERS
        for p in (ROOT / folder).glob("*.py")
        if re.search(r'^if __name__ == "__main__":', p.read_text(), re.M)
    )
