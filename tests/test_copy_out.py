"""A lesson copied out of this repository runs: launch/README.md's blocks replace the import.

For each lesson below (one per folder at least, and a DTensor lesson): copy it and the helper
modules of its folder that it imports (toy.py, model.py, ...; found by following its imports) into
an empty temporary directory outside the repository, replace its `from launch.dist_setup import
...` by the Python blocks of launch/README.md's section "Copying a lesson into your project" (read
from the README, so the README's blocks are what is tested), and run it under real torchrun at 2
ranks, from that directory and without PYTHONPATH. It must print its OK line.

The editable install still puts this repository's `launch` on sys.path, so the copy is read first:
no line of it may import or name the `launch` package; and the temporary directory holds a
`launch.py` that raises, so an import that slipped through fails the run instead of finding the
repository.
"""

import ast
import re
import sys

import pytest

from harness import ROOT, assert_ok, free_port, run_command

SECTION = "## Copying a lesson into your project"
IMPORT = re.compile(r"^from launch\.dist_setup import (\([^)]*\)|[^\n]*)$", re.M)
LAUNCH = re.compile(r"\b(from|import)\s+launch\b|\blaunch\.(dist_setup|argtypes|devices|printing)")
TIMEOUT = 240  # two ranks importing torch under a loaded machine; a hang is caught, not waited out

LESSONS = [
    pytest.param("primitives/all_reduce.py", marks=pytest.mark.quick),
    "ddp_basics/ddp_minimal.py",
    "fsdp_basics/fsdp_minimal.py",
    "transformer_basics/ring_attention.py",
    "primitives/dtensor_redistribute.py",
]


def readme_block():
    """The ```python blocks of launch/README.md's section, joined: what replaces the import."""
    text = (ROOT / "launch" / "README.md").read_text()
    assert SECTION in text, f"launch/README.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks, f"no ```python block in launch/README.md's {SECTION!r}"
    return "\n\n".join(blocks)


def defined(block):
    """The names the block defines at its top level (functions, classes, assignments)."""
    names = set()
    for node in ast.parse(block).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def imported_names(statement):
    return {a.asname or a.name for a in ast.parse(statement.strip()).body[0].names}


def siblings(lesson):
    """The lesson and every module of its folder that it imports, directly or through another."""
    folder, todo, found = (ROOT / lesson).parent, [ROOT / lesson], []
    while todo:
        path = todo.pop()
        if path in found:
            continue
        found.append(path)
        for node in ast.walk(ast.parse(path.read_text())):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            todo += [folder / f"{m}.py" for m in modules if (folder / f"{m}.py").is_file()]
    return found


def copy_out(lesson, into, block):
    """Copy the lesson and its siblings into `into`, each import from launch replaced by block."""
    for path in siblings(lesson):
        text = path.read_text()
        for statement in IMPORT.findall(text):
            missing = imported_names(f"from launch.dist_setup import {statement}") - defined(block)
            assert not missing, f"{path.name} imports {sorted(missing)}: the block lacks them"
        text = IMPORT.sub(lambda _: block, text)
        left = [line for line in text.splitlines() if LAUNCH.search(line)]
        assert not left, f"{path.name} still refers to the launch package: {left}"
        (into / path.name).write_text(text)
    (into / "launch.py").write_text('raise ImportError("a copied lesson imported launch")\n')
    return into / (ROOT / lesson).name


@pytest.mark.quick
def test_a_launch_reference_left_in_a_copy_is_caught(tmp_path):
    folder, into = tmp_path / "lessons", tmp_path / "out"
    folder.mkdir(), into.mkdir()
    (folder / "helper.py").write_text("from launch.printing import print0\n")
    (folder / "lesson.py").write_text("from launch.dist_setup import print0, run\nimport helper\n")
    with pytest.raises(AssertionError, match="helper.py still refers to the launch package"):
        copy_out(str(folder / "lesson.py"), into, readme_block())


@pytest.mark.quick
def test_the_block_provides_every_name_a_lesson_imports():
    """Every name any lesson imports from launch.dist_setup today, except test_flags, which issue
    29 removes from the lessons (tests/test_lesson_shape.py): so a lesson that starts importing a
    new name fails here, with that name, until the README's block has it."""
    from lesson_cli import lessons

    wanted = set()
    for lesson in lessons():
        for statement in IMPORT.findall((ROOT / lesson).read_text()):
            wanted |= imported_names(f"from launch.dist_setup import {statement}")
    missing = wanted - {"test_flags"} - defined(readme_block())
    assert not missing, f"launch/README.md's block lacks {sorted(missing)}"


@pytest.mark.parametrize("lesson", LESSONS)
def test_a_lesson_copied_out_runs_under_torchrun(lesson, tmp_path_factory):
    if "test_flags" in (ROOT / lesson).read_text():  # until issue 29 converts it (see above)
        pytest.skip(f"{lesson} still has a test-only flag group")
    into = tmp_path_factory.mktemp("copied_out")
    assert not into.resolve().is_relative_to(ROOT)
    copy = copy_out(lesson, into, readme_block())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    port = ["--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    # env -u: the repository must not be on the copy's path (run_command keeps the rest of the
    # environment the suite gives every run).
    command = ["env", "-u", "PYTHONPATH", *torchrun, *port, copy.name]
    result = run_command(command, timeout=TIMEOUT, cwd=into)
    assert "a copied lesson imported launch" not in result.stderr, str(result)
    assert_ok(result)
