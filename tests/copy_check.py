"""Checks copied-out lessons from inside the interpreter the copies run in (tests/test_copy_out.py).

    python copy_check.py REPOSITORY COPY...   # prints one JSON object: {COPY: [problem, ...]}

COPY is a directory holding one lesson (COPY/lesson.txt: its name and the flags it needs), the
modules of its folder and launch/dist_setup.py. For each copy, in this one process (torch is
imported once for all):
- every import statement of the lesson and its modules, in functions too, names a module found in
  the copy or outside REPOSITORY (statically: an import that only a later step would reach counts);
  packages installed in a venv inside REPOSITORY (torch in .venv/lib/...) count as outside;
- `lesson.py --help` exits 0 with a usage text, and no module was loaded from REPOSITORY;
- a lesson that calls dist_setup's run() and is started with plain python and no launcher ends
  with one line that says to use torchrun, and no rank is started.
"""

import ast
import contextlib
import importlib.util
import io
import json
import os
import runpy
import sys


def imported_modules(path):
    with open(path) as file:
        tree = ast.parse(file.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module


def forget(prefixes):
    """Drop the previous copy's modules (two folders have a toy.py) and every launch module."""
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if name == "launch" or name.startswith("launch.") or path.startswith(prefixes):
            del sys.modules[name]


def run_script(path, argv, env_drop=()):
    """Run path as __main__ with argv; return (exit code or message, what it printed)."""
    saved = list(sys.argv), dict(os.environ)
    out = io.StringIO()
    sys.argv = [path, *argv]
    for key in env_drop:
        os.environ.pop(key, None)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(path, run_name="__main__")
        code = "returned without exiting"
    except SystemExit as stop:
        code = stop.code
    except BaseException as error:  # noqa: BLE001 - reported, not raised: the next copy runs
        code = f"raised {type(error).__name__}: {error}"
    finally:
        sys.argv = saved[0]
        os.environ.clear()
        os.environ.update(saved[1])
    return code, out.getvalue()


def from_repository(path, repository):
    """A file of the repository itself: under it, and not under a directory of this interpreter's
    sys.path that lies inside it (a venv in the checkout holds torch there). The repository itself,
    or a folder above it, on sys.path exempts nothing: a copy that imports through it is caught."""
    installed = [
        entry + os.sep
        for entry in sys.path[1:]  # [0]: the copy
        if entry and (entry + os.sep).startswith(repository) and entry + os.sep != repository
    ]
    return path.startswith(repository) and not path.startswith(tuple(installed))


def check(copy, repository, copies):
    problems = []
    name, *plain_args = open(os.path.join(copy, "lesson.txt")).read().split()
    lesson = os.path.join(copy, name)
    forget(copies)
    sys.path[0] = copy
    for name in sorted(os.listdir(copy)):
        if not name.endswith(".py"):
            continue
        for module in imported_modules(os.path.join(copy, name)):
            try:
                spec = importlib.util.find_spec(module)
            except ImportError:
                spec = None
            origin = (getattr(spec, "origin", None) or "") if spec else ""
            if spec is None:
                problems.append(f"{name}: `import {module}` finds nothing in the copy")
            elif from_repository(origin, repository):
                problems.append(f"{name}: `import {module}` finds {origin}")
    code, out = run_script(lesson, ["--help"])
    if code not in (0, None) or "usage:" not in out:
        problems.append(f"--help: exit {code!r}, printed {out[-300:]!r}")
    source = open(lesson).read()
    if "from launch.dist_setup import" in source and "run(main" in source:
        code, out = run_script(lesson, plain_args, env_drop=("RANK", "WORLD_SIZE"))
        if not (isinstance(code, str) and code.startswith("error:") and "torchrun" in code):
            problems.append(f"plain python: exit {code!r}, printed {out[-300:]!r}")
    loaded = [m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)]
    problems += [f"loaded {path}" for path in loaded if from_repository(path, repository)]
    return problems


def main():
    repository, copies = sys.argv[1].rstrip(os.sep) + os.sep, sys.argv[2:]
    root = os.path.commonpath(copies) + os.sep
    # sys.path[0]: this script's directory (the test copies it out); check() sets it to the copy
    report = {copy: check(copy, repository, root) for copy in copies}
    sys.stdout.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
