"""Every README block of expected output is what its command prints today (issue 45).

Each fenced block without a language (a block of output, a diagram) follows one marker, an HTML
comment on the line right above its opening fence (GitHub does not show it):

    <!-- output: torchrun --nproc_per_node=3 primitives/dtensor_basics.py -->
        the block is that command's standard output; the command must also stand in the prose
        just above (so the marker cannot drift from what the reader is told to run)
    <!-- output -->
        the block gives its commands itself, each on a `$ ` line followed by what it printed;
        the commands run one after another in one fresh folder (a --resume finds what the
        run before it saved)
    <!-- output not compared: why -->
        timings in every line, two jobs at once, a cluster, a crash written into a copy...
    <!-- not output: what -->
        a diagram or a sketch

Inside a compared block, what the reader sees marks what is not compared:

    sync SGD   1   4.22  0.8450  # varies: `ms/step`
                                               the values named in backquotes change from run to
                                               run; the rest of the line is compared. A name is a
                                               label in the line (`max diff`: the word after it
                                               varies; `failed: ...`: all that follows it), a
                                               pattern in which each word N varies (`N ms/step`,
                                               `by N ms (N%`: wherever it matches), else a column
                                               heading of a line above it in the block (the words
                                               under the heading vary)
    [rank 1]   ...                             lines left out: `...` alone, or ending or starting a
                                               line, stands for any number of lines (0 or more)
    [rank 2] error: stuck in ...  # any order  consecutive lines marked so are the same lines in
                                               an order that changes from run to run
    (the same warning from ranks 1 and 2)  # stderr   on stderr, or a note: not compared
                                               (only standard output is)
    [replica 1] failed: reset  # any order; varies: `failed: ...`
                                               both at once

Every other line must equal the output's line (trailing spaces ignored), in order, and a block
without `...` must be the whole output. The `torch X.Y.Z...` of the `[setup]` line is not compared
(the suite runs on other releases too).

How it runs: a lesson command (torchrun or `python lesson.py --nproc N`, as
tests/test_readmes.py parses it) runs through the warm launcher (tests/warm_launcher.py: the
environment torchrun gives, ranks forked from a process that imported torch once), whose server
here sees the first 2 CPUs of this process only, so that `dist_setup` gives each rank the threads
it gets on the 2-core machine the blocks were printed on (float results can depend on the number
of threads). Each block runs in a fresh folder, so that what a lesson writes (`runs/...`) lands
there; an argument under /tmp/ is moved into that folder, and the output's folder is written back
as /tmp/. What the warm launcher cannot run as written runs as written, as a subprocess: `python
-c CODE`, the legacy launcher (`python -m torch.distributed.launch`: it hands each rank an argument
of its own) and a lesson that starts its own processes (one that does not go through
`dist_setup.run`: hello_distributed.py, spawn_template.py), with the lesson's folder linked into
the fresh one, so that its path reads as the README writes it.
"""

import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

import pytest

import warm_launcher
from harness import ROOT, lesson_env, run_command
from test_readmes import READMES, parse_command, rel, uses_dist_setup_run

MARKER = re.compile(r"<!-- (output|output: (?P<cmd>.+)|output not compared: (?P<why>.+)|"
                    r"not output: (?P<what>.+)) -->$")  # fmt: skip
NAMES = r"`[^`]+`(?:, `[^`]+`)*"
MARKS = re.compile(rf"\s+# ((?:any order|varies: {NAMES})(?:; (?:any order|varies: {NAMES}))*)$")
VARIES = re.compile(r"\s+# varies\b.*$")
TEMPLATE_WORD = re.compile(r"\bN\b")  # in a name of what varies: a word that varies
ANY_ORDER = re.compile(r"\s+# any order$")
STDERR = re.compile(r"\s+# stderr$")
ELISION = re.compile(r"^(\.\.\.(\s.*)?|.*\s\.\.\.)$")
TORCH_VERSION = re.compile(r"\btorch \d+\.\d+\.\d+\S*")
CODE_LANGUAGES = ("bash", "python", "mermaid")  # commands, code, diagrams: not output


def fenced_blocks(readme):
    """(line of the opening fence, info string, the line above it, block lines, the 14 lines above
    it) of every fenced block."""
    lines = readme.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, info = i, lines[i][3:].strip()
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
            marker = lines[start - 1] if start else ""
            yield start + 1, info, marker, lines[start + 1 : i], lines[max(0, start - 14) : start]
        i += 1


def output_blocks():
    """Every block that needs a marker, as a dict."""
    found = []
    for readme in READMES:
        for line, info, marker, body, before in fenced_blocks(readme):
            if info in CODE_LANGUAGES:
                continue
            m = MARKER.match(marker)
            found.append(
                dict(
                    readme=rel(readme),
                    line=line,
                    marker=m,
                    body=body,
                    before=before,
                    compared=bool(m and not m["why"] and not m["what"]),
                )
            )
    return found


def segments(block):
    """[(command, output lines shown)] of a compared block."""
    if block["marker"]["cmd"]:
        return [(block["marker"]["cmd"], block["body"])]
    found = []
    for text in block["body"]:
        if text.startswith("$ "):
            found.append((text[2:], []))
        elif not found:
            raise AssertionError(
                f"an `<!-- output -->` block must start with a `$ ` line: {text!r}"
            )
        else:
            found[-1][1].append(text)
    for _, shown in found:  # a blank line between two commands is no output
        while shown and not shown[-1].strip():
            shown.pop()
    return found


class Varies:
    """What `# varies: `a`, `b`` leaves out of a line: each name is a label in the line (the word
    after it, or with ` ...` all that follows it), else a column heading of a line above it."""

    HOLE = "<varies>"

    def __init__(self, names, above):
        self.names, self.columns = names, {}
        for name in names:
            for line in reversed(above):  # the nearest heading above
                if found := re.search(rf"(?:^|(?<=\s)){re.escape(name)}(?=\s|$)", line):
                    self.columns[name] = found.span()
                    break

    def spans(self, line, strict):
        spans = []
        for name in self.names:
            if TEMPLATE_WORD.search(name):  # `N ms/step`: every match, each N a hole
                parts = [re.escape(part) for part in TEMPLATE_WORD.split(name)]
                found = list(re.finditer(r"(\S+)".join(parts), line))
                spans += [m.span(g) for m in found for g in range(1, len(parts))]
                if found or not strict:
                    continue
            label, rest = (name[:-4], True) if name.endswith(" ...") else (name, False)
            at = line.find(label)
            if at >= 0:
                end = at + len(label)
                word = re.compile(r"\s*(\S*?)[,;:)]*(?:\s|$)").match(line, end)
                if rest or word.group(1):
                    spans.append((end, len(line)) if rest else word.span(1))
                    continue
            if name in self.columns:
                low, high = self.columns[name]  # the words that overlap the heading
                words = re.finditer(r"\S+", line)
                spans += [w.span() for w in words if w.start() < high and w.end() > low]
            elif strict:
                raise AssertionError(
                    f"`{name}` is neither in the line nor a column heading above it: {line!r}"
                )
        return sorted(spans)

    def __call__(self, line, strict=False):
        """The line with each varying value made a hole (strict: each name must be found)."""
        for low, high in reversed(self.spans(line, strict)):
            line = line[:low] + self.HOLE + line[high:]
        return re.sub(rf"\s*{self.HOLE}\s*", f" {self.HOLE} ", line)  # a wider value, less space


def pattern(shown):
    """The shown lines as items: ("line", text), ("any",), ("order", [texts], varies),
    ("holes", text, varies)."""
    items, above = [], []
    for text in shown:
        text = text.rstrip()
        if STDERR.search(text):
            continue
        marks = MARKS.search(text)
        if marks:
            clauses = marks.group(1).split("; ")
            names = [n for c in clauses for n in re.findall(r"`([^`]+)`", c)]
            text = normal(text[: marks.start()])
            varies = Varies(names, above)
            holes = varies(text, strict=True)
            if "any order" not in clauses:
                items.append(("holes", holes, varies))
            elif items and items[-1][0] == "order" and items[-1][2] is not None:
                items[-1][1].append(holes)
                items[-1][2].names += [n for n in names if n not in items[-1][2].names]
                items[-1][2].columns.update(varies.columns)
            else:
                items.append(("order", [holes], varies))
        elif VARIES.search(text):
            raise AssertionError(f"a marker that names no value in backquotes: {text!r}")
        elif ANY_ORDER.search(text):
            text = normal(ANY_ORDER.sub("", text))
            if items and items[-1][0] == "order" and items[-1][2] is None:
                items[-1][1].append(text)
            else:
                items.append(("order", [text], None))
        elif ELISION.match(text.strip()):
            items.append(("any",))
        else:
            items.append(("line", normal(text)))
        above.append(text)
    return items


def normal(text):
    return TORCH_VERSION.sub("torch <version>", text.rstrip())


def matches(items, lines):
    """Whether the output lines are what the items show, all of them, in order."""
    lines = [normal(t) for t in lines]
    memo = {}

    def at(i, j):
        if (i, j) not in memo:
            if i == len(items):
                memo[i, j] = j == len(lines)
            else:
                kind = items[i][0]
                if kind == "any":
                    memo[i, j] = any(at(i + 1, k) for k in range(j, len(lines) + 1))
                elif kind == "order":
                    n, varies = len(items[i][1]), items[i][2] or (lambda line: line)
                    window = [varies(line) for line in lines[j : j + n]]
                    memo[i, j] = sorted(window) == sorted(items[i][1]) and at(i + 1, j + n)
                elif kind == "holes":
                    memo[i, j] = (
                        j < len(lines) and items[i][2](lines[j]) == items[i][1] and at(i + 1, j + 1)
                    )
                else:
                    memo[i, j] = j < len(lines) and lines[j] == items[i][1] and at(i + 1, j + 1)
        return memo[i, j]

    return at(0, 0)


# ------------------------------------------------------------------------------------------- runs


def two_cpus():
    cpus = sorted(os.sched_getaffinity(0))
    return set(cpus[:2])


class Runner:
    """A warm launcher server of our own, started with the first 2 CPUs of this process."""

    def __init__(self):
        self.env = lesson_env({"PYTHONPATH": str(ROOT)})
        mine = os.sched_getaffinity(0)
        os.sched_setaffinity(0, two_cpus())  # the server inherits it; we take ours back at once
        try:
            self.server = warm_launcher.Server(self.env, str(ROOT))
        finally:
            os.sched_setaffinity(0, mine)
        self.cpu_s = 0.0

    def run(self, command, folder, timeout=300):
        """(exit code, stdout, stderr) of one README command, run in folder."""
        command = command.replace("/tmp/", f"{folder}/tmp/")
        runs = parse_command(command)
        if not runs and command.startswith(("python -c ", "python3 -c ")):
            proc = subprocess.run(
                [sys.executable, "-c", shlex.split(command)[2]],
                cwd=folder,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            return proc.returncode, proc.stdout, proc.stderr
        assert len(runs) == 1, f"not one lesson run: {command!r}"
        lesson, args, env, launcher, launcher_args = runs[0]
        back = lambda text: text.replace(f"{folder}/tmp/", "/tmp/")  # noqa: E731
        if launcher == "torch.distributed.launch" or not (launcher or uses_dist_setup_run(lesson)):
            if launcher and args[-1:] == ["--local-rank=0"]:  # what parse_command adds for it
                args = args[:-1]
            start = [sys.executable, *(["-m", launcher, *launcher_args] if launcher else [])]
            top = lesson.split("/")[0]  # the lesson's path as written (it may print it)
            if not os.path.exists(f"{folder}/{top}"):
                os.symlink(ROOT / top, f"{folder}/{top}")
            result = run_command(
                [*start, lesson, *args],
                timeout=timeout,
                env={"PYTHONPATH": str(ROOT), **env},
                cwd=folder,
            )
            assert not result.timed_out, f"{command} timed out after {timeout} s\n{result}"
            return result.returncode, back(result.stdout), back(result.stderr)
        nproc = launcher_nproc(launcher, launcher_args) if launcher else python_nproc(args)
        env = dict(self.env, **env)
        os.makedirs(f"{folder}/tmp", exist_ok=True)
        _, code, out, err, timed_out, _ = self.server.run(
            str(ROOT / lesson), args, nproc, env, str(folder), timeout
        )
        self.cpu_s += warm_launcher.last_cpu_s or 0.0
        assert not timed_out, f"{command} timed out after {timeout} s\n{out}\n{err}"
        return code, back(out), back(err)

    def close(self):
        self.server.close()


def launcher_nproc(launcher, launcher_args):
    assert launcher == "torch.distributed.run", f"{launcher}: not run through the warm launcher"
    nproc, rest = 1, list(launcher_args)
    while rest:
        word = rest.pop(0)
        key, _, value = word.partition("=")
        if key in ("--nproc_per_node", "--nproc-per-node"):
            nproc = int(value or rest.pop(0))
        elif key in ("--master_port", "--master-port"):
            value or rest.pop(0)  # the warm launcher picks a free port
        else:
            raise AssertionError(f"torchrun {word}: the warm launcher cannot run it; mark the "
                                 "block `output not compared: why`")  # fmt: skip
    return nproc


def python_nproc(args):
    for i, word in enumerate(args):
        if word == "--nproc":
            return int(args[i + 1])
        if word.startswith("--nproc="):
            return int(word.partition("=")[2])
    return 2  # dist_setup's default without GPUs


# ------------------------------------------------------------------------------------------ tests

BLOCKS = output_blocks()
COMPARED = [b for b in BLOCKS if b["compared"]]


@pytest.mark.quick  # in-process: no run
def test_every_block_of_output_has_a_marker():
    missing = [
        f"{b['readme']}:{b['line']}: {b['body'][0] if b['body'] else ''!r}"
        for b in BLOCKS
        if not b["marker"]
    ]
    assert not missing, (
        "a fenced block without a language and without a marker line right above it (see "
        "tests/test_output_blocks.py): \n" + "\n".join(missing)
    )
    assert len(COMPARED) > 25, f"only {len(COMPARED)} blocks compared"


@pytest.mark.quick  # in-process: no run
def test_a_marker_names_a_command_the_prose_gives():
    problems = []
    for b in COMPARED:
        command = b["marker"]["cmd"]
        if command:
            prose = " ".join(" ".join(b["before"]).split())
            if " ".join(command.split()) not in prose:
                problems.append(f"{b['readme']}:{b['line']}: {command!r} is not in the prose above")
        elif not any(t.startswith("$ ") for t in b["body"]):
            problems.append(f"{b['readme']}:{b['line']}: `<!-- output -->` without a `$ ` line")
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="session")  # one server for every block, on the one worker that runs them
def runner():
    runner = Runner()
    started = time.monotonic()
    yield runner
    runner.close()
    if os.environ.get("TEST_LAUNCH_LOG"):
        with open(os.environ["TEST_LAUNCH_LOG"], "a") as f:
            f.write(f"output-blocks {time.monotonic() - started:.1f} {runner.cpu_s:.1f} - -\n")


@pytest.mark.xdist_group("output_blocks")
@pytest.mark.parametrize("block", COMPARED, ids=[f"{b['readme']}:{b['line']}" for b in COMPARED])
def test_output_block_is_what_the_command_prints(block, runner):
    with tempfile.TemporaryDirectory(prefix="output_block_") as folder:
        for command, shown in segments(block):
            code, out, err = runner.run(command, folder)
            lines = out.rstrip("\n").splitlines()  # a blank line at the end is not compared
            if not matches(pattern(shown), lines):
                diff = "\n".join(
                    difflib.unified_diff(shown, lines, "README", "the run", lineterm="", n=1)
                )
                raise AssertionError(
                    f"{block['readme']}:{block['line']}: the block for `{command}` is not what it "
                    f"prints (exit code {code}). Update the block, or mark what varies (see "
                    f"tests/test_output_blocks.py):\n{diff}\n--- stderr (not compared)\n"
                    f"{err[-3000:]}"
                )


@pytest.mark.quick  # in-process: no run
def test_the_comparison_can_fail():
    """Each marker does what it says, and a changed, missing or extra line fails."""
    shown = [
        "[setup] 2 rank(s), torch 2.13.0+cpu",
        "pid 123  # varies: `pid`",
        "[rank 1] b  # any order",
        "[rank 0] a  # any order",
        "a warning  # stderr",
        "...",
        "OK: done",
    ]
    run = ["[setup] 2 rank(s), torch 2.14.1+cu130", "pid 9", "[rank 0] a", "[rank 1] b"]
    assert matches(pattern(shown), run + ["x", "y", "OK: done"])
    assert matches(pattern(shown), run + ["OK: done"])
    assert not matches(pattern(shown), run + ["OK: done", "extra"])
    assert not matches(pattern(shown), run[:1] + run[2:] + ["OK: done"])  # the pid line missing
    assert not matches(pattern(shown), run[:2] + ["[rank 0] a", "[rank 1] c", "OK: done"])
    assert not matches(pattern(shown), ["[setup] 3 rank(s), torch 2.13.0+cpu"] + run[1:])
    assert not matches(pattern(["a", "b"]), ["a"]) and not matches(pattern(["a"]), ["a", "b"])
    assert matches(pattern(["a", "[rank 1]   ...", "b"]), ["a", "c", "d", "b"])
    # named values: the rest of the line is compared
    table = [
        "method    H  ms/step    loss  |w - sim|",
        "sync      1     4.22  0.8450  3.6e-07  # varies: `ms/step`, `|w - sim|`",
        "OK: max diff 7.9e-07, tol 1e-4  # varies: `max diff`",
        "[replica 1] failed: closed  # any order; varies: `failed: ...`",
        "[replica 0] failed: reset  # any order; varies: `failed: ...`",
    ]
    head = table[0]
    run = [head, "sync      1    14.30  0.8450  5.0e-07", "OK: max diff 1.0e-06, tol 1e-4"]
    failed = ["[replica 0] failed: reset by peer", "[replica 1] failed: closed by peer"]
    assert matches(pattern(table), run + failed)
    assert matches(pattern(table), run + failed[::-1])
    assert not matches(
        pattern(table), [head, run[1].replace("0.8450", "0.8451"), *run[2:], *failed]
    )
    assert not matches(pattern(table), [head, run[1].replace("sync ", "Sync "), *run[2:], *failed])
    assert not matches(pattern(table), run[:2] + ["OK: max diff 1.0e-06, tol 1e-3"] + failed)
    assert not matches(pattern(table), run + [failed[0], "[replica 2] failed: reset"])
    with pytest.raises(AssertionError, match="neither in the line nor a column heading"):
        pattern(["a b", "1 2  # varies: `c`"])
    with pytest.raises(AssertionError, match="a marker that names no value"):
        pattern(["a b", "1 2  # varies: `a`, b"])
    with pytest.raises(AssertionError, match="a marker that names no value"):
        pattern(["pid 123  # varies: pid"])
    # patterns: each N varies, wherever the pattern matches; the rest is compared
    steps = [
        "step 10: loss 3.008, 620.6 ms/step  # varies: `N ms/step`",
        "ms/step by rank: 4.8+53.1 53.0+3.7; slow: rank 1 by 48.2 ms (85%  # varies: "
        "`rank: N N;`, `by N ms (N%`",
    ]
    run = [
        "step 10: loss 3.008, 1620.65 ms/step",
        "ms/step by rank: 1+2 3+4; slow: rank 1 by 9 ms (9%",
    ]
    assert matches(pattern(steps), run)
    assert not matches(pattern(steps), [run[0].replace("3.008", "3.009"), run[1]])
    assert not matches(pattern(steps), [run[0], run[1].replace("rank 1 by", "rank 2 by")])
    assert not matches(pattern(steps), [run[0], run[1].replace("1+2 3+4", "1+2 3+4 5+6")])
    with pytest.raises(AssertionError, match="neither in the line nor a column heading"):
        pattern(["step 1: 2 s/step  # varies: `N ms/step`"])
    assert segments(dict(marker=MARKER.match("<!-- output -->"), body=["$ x", "1", "", "$ y"])) == [
        ("x", ["1"]),
        ("y", []),
    ]
