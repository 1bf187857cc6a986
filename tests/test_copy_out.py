"""Copying a lesson out is copying files, and nothing is edited (launch/README.md, "Copying a
lesson into your project"): the lesson, the modules of its folder that it imports (found by
following every import statement, in functions too) and launch/dist_setup.py (with
launch/charts.py where the lesson or one of its modules imports it), into an empty directory
outside the repository.

The copies run in an interpreter that cannot see this repository: a venv without pip whose only
path to other packages is a .pth line per directory that holds torch, numpy or tqdm (a path line
adds the directory; the .pth files in it, such as the editable install's finder of `launch`, are
not run), with no PYTHONPATH. That directory may lie anywhere, in a venv inside the checkout too
(.venv/lib/python3.X/site-packages): copy_check.py counts a module found there as outside the
repository, and any other file under the checkout as the repository's.
- Every lesson (tests/lesson_cli.lessons(), so a new lesson is covered), all in one process
  (tests/copy_check.py): its imports resolve inside the copy or outside the repository, `--help`
  works, and plain `python lesson.py` says in one line to use torchrun.
- A helper module that imports the repository's launch package (a mutation) fails that check.
- Under real torchrun at 2 ranks, from copies: the lessons of COPIED_RUNS, and train.py with
  --async-save, then --resume from what it saved.
"""

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from harness import ROOT, assert_ok, free_port, run_command
from lesson_cli import lessons

TIMEOUT = 240  # two ranks importing torch on a loaded machine; a hang is caught, not waited out
COPIED_RUNS = [
    pytest.param("primitives/all_reduce.py", marks=pytest.mark.quick),
    "primitives/barrier.py",  # imports float_in without int_in
    "ddp_basics/ddp_minimal.py",
    "fsdp_basics/fsdp_minimal.py",
    "transformer_basics/ring_attention.py",
    "primitives/dtensor_redistribute.py",
]

REQUIRED_FLAGS = {"primitives/weight_sync_two_jobs.py": ["--role", "trainer"]}  # plain python


def closure(lesson):
    """The lesson and every module of its folder that it imports, directly or through another."""
    folder, todo, found = (ROOT / lesson).parent, [ROOT / lesson], []
    while todo:
        path = todo.pop()
        if path in found:
            continue
        found.append(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            todo += [folder / f"{n}.py" for n in names if (folder / f"{n}.py").is_file()]
    return found


def launch_modules(paths):
    """The modules of launch/ that these files import: dist_setup.py, and charts.py if used."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "launch":
                names |= {f"launch.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
    return ["dist_setup.py"] + ["charts.py"] * ("launch.charts" in names)


def copy_out(lesson, into):
    """The reader's copy: the closure beside each other, dist_setup.py (and charts.py, for a lesson
    that draws) in launch/."""
    into.mkdir(parents=True)
    for path in closure(lesson):
        shutil.copy(path, into / path.name)
    (into / "launch").mkdir()
    for name in launch_modules(closure(lesson)):
        shutil.copy(ROOT / "launch" / name, into / "launch" / name)
    needs = REQUIRED_FLAGS.get(lesson, [])
    (into / "lesson.txt").write_text(" ".join([os.path.basename(lesson), *needs]))
    return into / os.path.basename(lesson)


@pytest.fixture(scope="module")
def python(tmp_path_factory):
    """A python that sees torch, numpy and tqdm, and neither this repository nor its install."""
    venv = tmp_path_factory.mktemp("copy_venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    import numpy
    import torch
    import tqdm

    where = {os.path.dirname(os.path.dirname(m.__file__)) for m in (torch, numpy, tqdm)}
    # Anywhere (a venv inside the checkout too), but not the checkout or a folder above it: the copy
    # would then see this repository's launch/ through packages.pth, and the check would pass
    # however a copy imported it.
    assert not any(ROOT.is_relative_to(w) for w in where), where
    site = sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
    (venv / "lib").mkdir(exist_ok=True)
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "packages.pth"), "w") as pth:
        pth.write("".join(f"{w}\n" for w in sorted(where)))
    return str(venv / "bin" / "python")


def check_copies(python, copies, tmp_path):
    """tests/copy_check.py over the copies, in one process; {copy: [problem, ...]}."""
    driver = tmp_path / "copy_check.py"
    shutil.copy(ROOT / "tests" / "copy_check.py", driver)
    command = ["env", "-u", "PYTHONPATH", python, driver, ROOT, *copies]
    result = run_command(command, timeout=TIMEOUT, cwd=tmp_path)
    assert result.returncode == 0 and not result.timed_out, str(result)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.quick
def test_every_lesson_copied_out_imports_only_its_copy(python, tmp_path):
    copies = [copy_out(lesson, tmp_path / lesson.replace("/", "__")).parent for lesson in lessons()]
    assert len(copies) >= 80, len(copies)
    report = check_copies(python, copies, tmp_path)
    problems = [f"{os.path.basename(c)}: {p}" for c, ps in report.items() for p in ps]
    assert not problems, "\n".join(problems)


@pytest.mark.quick
def test_a_helper_that_imports_the_repository_is_caught(python, tmp_path):
    """The mutation: checkpointing.py reaches for a launch module that the reader did not copy."""
    copy = copy_out("transformer_basics/train.py", tmp_path / "train").parent
    helper = copy / "checkpointing.py"
    helper.write_text("import launch.local_ranks  # noqa\n" + helper.read_text())
    problems = check_copies(python, [copy], tmp_path)[str(copy)]
    assert any("checkpointing.py: `import launch.local_ranks` finds nothing" in p for p in problems)
    assert any(p.startswith("--help: exit") for p in problems), problems


@pytest.mark.parametrize("module,allowed", [("dist_setup.py", {"torch"}), ("charts.py", set())])
def test_the_set_up_file_imports_only_the_standard_library_and_torch(module, allowed):
    """dist_setup.py: the standard library and torch; charts.py: the standard library alone."""
    tree = ast.parse((ROOT / "launch" / module).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in top if isinstance(n, ast.ImportFrom)}
    outside = {n for n in names if n.split(".")[0] not in sys.stdlib_module_names | allowed}
    assert not outside, f"launch/{module} imports {sorted(outside)} when it is imported"


def torchrun(python, copy, *args):
    command = [python, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    command += ["--master_addr=127.0.0.1", f"--master_port={free_port()}", copy.name, *args]
    return run_command(["env", "-u", "PYTHONPATH", *command], timeout=TIMEOUT, cwd=copy.parent)


@pytest.mark.parametrize("lesson", COPIED_RUNS)
def test_a_lesson_copied_out_runs_under_torchrun(lesson, python, tmp_path):
    assert not tmp_path.resolve().is_relative_to(ROOT)
    assert_ok(torchrun(python, copy_out(lesson, tmp_path / "copy")))


@pytest.mark.quick
def test_train_copied_out_is_five_files():
    """Issue 50: a reader copies train.py with model.py, data.py, checkpointing.py and
    launch/dist_setup.py, nothing else (train_2d.py: those, train.py and tensor_parallel.py)."""
    paths = closure("transformer_basics/train.py")
    names = sorted(p.name for p in paths) + [f"launch/{n}" for n in launch_modules(paths)]
    assert names == ["checkpointing.py", "data.py", "model.py", "train.py", "launch/dist_setup.py"]


def test_train_copied_out_saves_asynchronously_and_resumes(python, tmp_path):
    copy = copy_out("transformer_basics/train.py", tmp_path / "copy")
    args = ["--steps", "8", "--warmup", "2", "--eval-every", "4", "--save-every", "2"]
    assert_ok(torchrun(python, copy, *args, "--async-save", "--out", "run", "--stop-after", "4"))
    # --resume finds the DCP checkpoint/ that --async-save wrote, without being told (issue 50)
    resumed = torchrun(python, copy, *args, "--out", "run", "--resume")
    assert_ok(resumed)
    assert "resumed at step 4" in resumed.stdout, str(resumed)


@pytest.mark.quick
def test_every_module_imports_the_set_up_once_at_its_top():
    """Lessons and their helper modules import launch.dist_setup (and launch.charts, which the copy
    brings along) and nothing else of launch, at module level (an import inside a function is
    found only when that function runs)."""
    from lesson_cli import FOLDERS

    problems = []
    for path in sorted(p for folder in FOLDERS for p in (ROOT / folder).glob("*.py")):
        if path.parent.name == "launch" and path.name in ("dist_setup.py", "local_ranks.py"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "launch" and not node.level:
                names = [
                    f"launch.{alias.name}" for alias in node.names
                ]  # from launch import charts
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            for name in [n for n in names if n.split(".")[0] == "launch"]:
                if name not in ("launch.dist_setup", "launch.charts"):
                    problems.append(f"{where}: imports {name}, which a copy does not have")
                elif node not in tree.body:
                    problems.append(f"{where}: imports {name} inside a block")
    assert not problems, "\n".join(problems)
