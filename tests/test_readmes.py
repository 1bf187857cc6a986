"""Every README.md says what is true about the repository:

- every relative link resolves to a file (and its #anchor to a heading of that file);
- every row of a lesson table (first column `lesson` or `file`) links to its file;
- every command a README gives to run a lesson (in a code block or in `backticks`: `torchrun ...`,
  `python lesson.py ...`, `python -m torch.distributed.run|launch ...`, and the lesson handed to
  `bash launch/*.sh` or `sbatch launch/slurm.sbatch`) parses with that lesson's own flags, and the
  launcher's options with the launcher's parser.

Parsing runs nothing: the checker replaces launch/dist_setup.run, from outside, with a stand-in
that prints the parsed flags and exits 0 before a rank starts (the lessons hold no hook for it); an
unknown or malformed flag makes argparse exit 2. The few lessons that do not go through
dist_setup.run (they set up by hand) stop right after parse_args.
Every command of one lesson is checked in one process (each start imports torch), so a failure
names the README, the line and the command.
"""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from harness import ROOT, lesson_env, repository_files

pytestmark = pytest.mark.quick  # about 10 s: one process parses every command

READMES = sorted([*repository_files("README.md"), ROOT / "CONTRIBUTING.md"])
# `torchrun ... LESSON.py`: any lesson, not one
PLACEHOLDER = re.compile(r"(^|/)(lesson|LESSON)\.py$")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def rel(path):
    path = Path(path)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


# ---------------------------------------------------------------------------------------- links


def slug(heading):
    """The anchor GitHub gives a heading: link text only, lower case, punctuation dropped, spaces
    to -."""
    text = LINK.sub(r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown_file):
    seen, found = {}, set()
    in_code = False
    for line in markdown_file.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            base = slug(line.lstrip("#"))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(readme):
    """(line number, line, target) for every relative link outside code blocks."""
    in_code = False
    for number, line in enumerate(readme.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for _, target in LINK.findall(line):
            if not re.match(r"[a-z]+:", target):  # not https:, mailto:
                yield number, line, target


def link_problem(readme, target):
    path, _, anchor = target.partition("#")
    file = (readme.parent / path).resolve() if path else readme
    if not file.exists():
        return f"{path} does not exist"
    if anchor and file.suffix == ".md" and anchor not in anchors(file):
        return f"{rel(file)} has no heading #{anchor}"
    return None


def table_rows(readme):
    """(line number, first cell, row) for each data row of a table whose first column is lesson or
    file."""
    lines = readme.read_text().splitlines()
    lesson_table = False
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            lesson_table = False
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if i + 1 < len(lines) and re.match(r"\|[\s:|-]+\|$", lines[i + 1]):  # a header row
            lesson_table = cells[0].lower() in ("lesson", "file")
        elif lesson_table and not re.match(r"\|[\s:|-]+\|$", line):
            yield i + 1, cells[0], line


def test_every_relative_link_resolves():
    problems = [
        f"{rel(readme)}:{n}: [{target}] {problem}"
        for readme in READMES
        for n, _, target in links(readme)
        if (problem := link_problem(readme, target))
    ]
    assert not problems, "\n".join(problems)


def test_every_lesson_table_row_links_to_its_file():
    problems, rows = [], 0
    for readme in READMES:
        for n, first, line in table_rows(readme):
            rows += 1
            targets = [t for _, t in LINK.findall(first) if not re.match(r"[a-z]+:", t)]
            if not targets:
                problems.append(f"{rel(readme)}:{n}: first cell is not a link: {line}")
    assert rows > 50, f"found only {rows} lesson table rows: did the tables change shape?"
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------- commands


def command_lines(readme):
    """(line number, text) of every shell command: code-block lines and `inline code` spans."""
    lines = readme.read_text().splitlines()
    in_code, i = False, 0
    while i < len(lines):
        line, number = lines[i], i + 1
        i += 1
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            text = re.sub(r"^\s*\$ ", "", line)
            while text.endswith("\\") and i < len(lines):  # continued on the next line
                text = text[:-1] + " " + lines[i].strip()
                i += 1
            yield number, text.strip()
        else:
            for span in re.findall(r"`([^`]+)`", line):
                yield number, span.replace("\\|", "|")  # a | inside a table cell is written \|


def parse_command(text):
    """[(lesson, args, env, launcher, launcher_args)] for each lesson run in a shell line."""
    try:
        lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: not a shell line (output, prose)
        return []
    runs, segment = [], []
    for token in tokens + [";"]:
        if token in ("&&", "||", ";", "|", "&"):
            runs += parse_segment(segment)
            segment = []
        else:
            segment.append(token)
    return runs


def parse_segment(tokens):
    env = {}
    tokens = list(tokens)
    while tokens and (tokens[0] == "sudo" or re.match(r"[A-Z_][A-Z0-9_]*=", tokens[0])):
        word = tokens.pop(0)
        if word != "sudo":
            key, _, value = word.partition("=")
            env[key] = value
    if not tokens:
        return []
    launcher, launcher_args, rest = None, [], None
    if tokens[0] == "torchrun":
        launcher, rest = "torch.distributed.run", tokens[1:]
    elif tokens[0] in ("python", "python3"):
        if tokens[1:2] == ["-m"]:
            if tokens[2:3] not in (["torch.distributed.run"], ["torch.distributed.launch"]):
                return []  # python -m pytest, pip, ...
            launcher, rest = tokens[2], tokens[3:]
        elif len(tokens) > 1 and tokens[1].endswith(".py"):
            rest = tokens[1:]
    elif tokens[0] in ("bash", "sbatch"):  # launch/*.sh, slurm.sbatch: the lesson is an argument
        rest = [t for t in tokens[1:] if not t.startswith("launch/")]
    if rest is None:
        return []
    scripts = [i for i, t in enumerate(rest) if t.endswith(".py")]
    if not scripts or PLACEHOLDER.search(rest[scripts[0]]):
        return []
    at = scripts[0]
    if launcher:
        launcher_args = rest[:at]
    args = rest[at + 1 :]
    if launcher == "torch.distributed.launch" and not {"--use-env", "--use_env"} & set(
        launcher_args
    ):
        args = args + ["--local-rank=0"]  # what the old launcher appends for each rank
    return [(rest[at], args, env, launcher, launcher_args)]


def readme_commands():
    found = []
    for readme in READMES:
        for number, text in command_lines(readme):
            for lesson, args, env, launcher, launcher_args in parse_command(text):
                found.append(
                    dict(
                        readme=rel(readme),
                        line=number,
                        text=text,
                        lesson=lesson,
                        args=args,
                        env=env,
                        launcher=launcher,
                        launcher_args=launcher_args,
                    )
                )
    return found


# Runs every command in one Python, lesson after lesson: torch is imported once, and the modules
# of the lessons' folders and of launch/ are dropped between lessons (two folders have a toy.py),
# so each lesson imports afresh. Only those folders, not everything under the checkout: a venv
# inside the checkout (.venv/lib/.../site-packages) holds torch, numpy and typing_extensions there,
# and torch imported a second time in one process crashes (torch 2.14.1+cu130: SystemError in
# `from torch._C import *`, then SIGSEGV while collecting garbage; issue 48).
CHECKER = r"""
import argparse, contextlib, importlib, io, json, os, runpy, sys
root = os.getcwd()
jobs = json.load(sys.stdin)
folders = {os.path.join(root, os.path.dirname(job["lesson"])) for job in jobs}
folders.add(os.path.join(root, "launch"))
results, previous = [], None
for job in jobs:
    if job["lesson"] != previous:
        for name, module in list(sys.modules.items()):
            if os.path.dirname(getattr(module, "__file__", None) or "") in folders:
                del sys.modules[name]
        previous = job["lesson"]
    out = io.StringIO()
    code = 0
    saved_env, saved_argv, saved_path = dict(os.environ), list(sys.argv), list(sys.path)
    original = argparse.ArgumentParser.parse_args
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if job["launcher"]:
                importlib.import_module(job["launcher"]).parse_args(
                    [*job["launcher_args"], job["lesson"], *job["args"]])
            os.environ.update(job["env"])
            import launch.dist_setup

            def parsed_then_stop(main, args, *a, **k):
                print(f"parsed: {vars(args)}")
                sys.exit(0)
            launch.dist_setup.run = parsed_then_stop
            if not job["uses_run"]:  # set up by hand: stop right after the flags are parsed
                def parse_then_stop(self, *a, **k):
                    print(f"parsed: {vars(original(self, *a, **k))}")
                    sys.exit(0)
                argparse.ArgumentParser.parse_args = parse_then_stop
            sys.argv = [job["lesson"], *job["args"]]
            sys.path[0] = os.path.dirname(os.path.abspath(job["lesson"]))
            runpy.run_path(job["lesson"], run_name="__main__")
            code = ("ran to the end without stopping after its flags "
                    "(dist_setup.run was not reached)")
    except SystemExit as stop:
        code = (stop.code if isinstance(stop.code, int)
                else 0 if stop.code is None else str(stop.code))
    except BaseException as error:
        code = f"{type(error).__name__}: {error}"
    finally:
        argparse.ArgumentParser.parse_args = original
        os.environ.clear(); os.environ.update(saved_env)
        sys.argv, sys.path[:] = saved_argv, saved_path
    results.append({"code": code, "output": out.getvalue()[-2000:]})
print("RESULTS " + json.dumps(results))
"""


def uses_dist_setup_run(lesson):
    source = (ROOT / lesson).read_text()
    return (
        "launch.dist_setup import" in source and re.search(r"^\s*run\(", source, re.M) is not None
    )


def check_commands(commands):
    """Sets each command's "result": code 0 if it parses, else the exit code or error, and the
    output."""
    jobs = []
    for c in sorted(commands, key=lambda c: c["lesson"]):
        if (ROOT / c["lesson"]).is_file():
            jobs.append(c)
        else:
            c["result"] = {"code": f"{c['lesson']} does not exist", "output": ""}
    payload = json.dumps([dict(c, uses_run=uses_dist_setup_run(c["lesson"])) for c in jobs])
    proc = subprocess.run(
        [sys.executable, "-c", CHECKER],
        cwd=ROOT,
        input=payload,
        text=True,
        timeout=300,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=lesson_env({"PYTHONPATH": str(ROOT)}),
    )
    found = re.search(r"^RESULTS (.*)$", proc.stdout, re.M)
    assert found, f"the checker failed (exit {proc.returncode}):\n{proc.stdout[-5000:]}"
    for c, result in zip(jobs, json.loads(found.group(1)), strict=True):
        c["result"] = result
    return commands


COMMANDS = readme_commands()


@pytest.fixture(scope="session")  # session, not module: kept while the worker runs other modules
def checked():
    return [c["result"] for c in check_commands([dict(c) for c in COMMANDS])]


def test_readmes_give_commands():
    lessons = {c["lesson"] for c in COMMANDS}
    assert len(COMMANDS) > 60 and len(lessons) > 40, (
        f"{len(COMMANDS)} commands for {len(lessons)} lessons"
    )


@pytest.mark.xdist_group("readme_commands")  # one worker checks them all, once
@pytest.mark.parametrize(
    "index",
    range(len(COMMANDS)),
    ids=[f"{c['readme']}:{c['line']}:{c['lesson']}" for c in COMMANDS],
)
def test_readme_command_parses(index, checked):
    command, result = COMMANDS[index], checked[index]
    assert result["code"] == 0, (
        f"{command['readme']}:{command['line']}: {command['text']}\n"
        f"{command['lesson']} {' '.join(command['args'])}: exit {result['code']}\n"
        f"{result['output']}"
    )


def test_the_check_catches_a_bad_flag_a_missing_lesson_and_a_bad_link(tmp_path):
    """The checks above can fail: a README with a broken command, a missing lesson and a dead
    link."""
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Title\n\n| lesson | run |\n|---|---|\n| broadcast.py | `torchrun --nproc_per_node=2 "
        "primitives/broadcast.py --no-such-flag` |\n\n"
        "```bash\npython primitives/broadcast.py --src two\n"
        "torchrun --nproc_per_nodes=2 primitives/broadcast.py\npython primitives/no_such.py\n```\n"
        "[a](primitives/broadcast.py) [b](no_such.md) [c](#title) [d](#no-such-heading)\n"
    )
    rows = list(table_rows(readme))
    assert len(rows) == 1 and not LINK.findall(rows[0][1])
    problems = [link_problem(readme, t) for _, _, t in links(readme)]
    assert problems == [
        "primitives/broadcast.py does not exist",
        "no_such.md does not exist",
        None,
        "README.md has no heading #no-such-heading",
    ], problems
    commands = [
        dict(
            readme="README.md",
            line=n,
            text=text,
            lesson=lesson,
            args=args,
            env=env,
            launcher=launcher,
            launcher_args=launcher_args,
        )
        for n, text in command_lines(readme)
        for lesson, args, env, launcher, launcher_args in parse_command(text)
    ]
    assert [c["line"] for c in commands] == [5, 8, 9, 10], commands
    codes = [c["result"]["code"] for c in check_commands(commands)]
    assert codes[:3] == [2, 2, 2] and codes[3] == "primitives/no_such.py does not exist", codes


@pytest.mark.quick
def test_no_merge_conflict_markers_in_tracked_files():
    # a merge that kept both sides by hand once committed "<<<<<<< HEAD" into two README tables
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    marked = [
        f"{name}:{i}"
        for name in files
        if name.endswith((".py", ".md", ".sh", ".toml", ".txt", ".sbatch"))
        and (ROOT / name).exists()
        for i, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
        if re.match(r"(<{7}|>{7}) |={7}$", line)
    ]
    assert not marked, f"merge conflict markers at {marked}"


@pytest.mark.quick
def test_ci_runs_the_quick_start_that_the_readme_shows():
    """.ci/readme_path.sh reads the commands it runs from README.md: the lines of the bash block
    under "## Quick start", unchanged, the last one the README's test command."""
    section = (ROOT / "README.md").read_text().partition("\n## Quick start\n")[2]
    block = re.search(r"^```bash\n(.*?)^```", section.partition("\n## ")[0], re.M | re.S)
    assert block, "README.md: no ```bash block under ## Quick start"
    shown = [line for line in block.group(1).splitlines() if line.strip()]
    printed = subprocess.run(
        ["bash", ".ci/readme_path.sh", "--print"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert printed == shown, (printed, shown)
    assert printed[-1].endswith("pytest -m quick"), printed
