"""Issue 41: the lessons' charts (`--chart PATH`, launch/charts.py) are Mermaid that GitHub can
draw, and hold the numbers the lesson printed in the same run.

- The checker (tests/mermaid_check.py, our own reading of Mermaid's xychart and gantt grammars)
  reads what launch/charts.py writes and refuses what Mermaid refuses: a number with an exponent,
  a string left open, fewer values than categories, a task whose text holds a colon, ...
- Each lesson that draws, in a short run with --chart: every block of the file parses, and its
  numbers are those printed (busbw per size, GiB per rank, the timelines' ms). (train.py drew its
  losses until issue 50: its copy is five files, launch/charts.py not among them.)
- benchmark_collectives' chart at 3 ranks, where busbw and algbw differ, and a copy of it that
  draws algbw under busbw's title fails that comparison.
- A path the chart cannot be written to is refused by argparse, before any rank starts (parsed
  in this process), for each of the four lessons that draw.
- tools/merge_charts.py: the lines of several runs in one chart; a file it cannot read (missing,
  not text, no chart, a value edited into something that is no number) is refused in one line.
Every run is small (tiny sizes, few steps) and goes through the warm launcher.
"""

import json
import re
import sys

import pytest

from harness import ROOT, assert_ok, mutant, run_command, run_lesson
from lesson_cli import lesson_parser
from lesson_cli import parse as parse_flags
from mermaid_check import MermaidError, blocks, parse

from launch import charts

T = 240


def one_chart(path):
    """The charts of a file the lesson wrote, parsed."""
    found = blocks(path.read_text())
    assert found, path.read_text()
    return [parse(block) for block in found]


# ---- the checker and the writer ----


def test_what_charts_writes_parses_back():
    line = charts.xychart("busbw, 2 ranks", "size", ["1 KiB", "4 KiB"], "GB/s", {"a": [0.5, 2]})
    (chart,) = [parse(b) for b in blocks(line)]
    assert chart["title"] == "busbw, 2 ranks" and chart["x"] == ["1 KiB", "4 KiB"]
    assert chart["x_title"] == "size" and chart["y_title"] == "GB/s"
    assert chart["lines"] == [("line", "a", [0.5, 2.0])]
    timeline = charts.gantt("rank 0", {"compute": [("backward net.8", 6.4, 7.2)], "sent": []})
    (chart,) = [parse(b) for b in blocks(timeline)]
    assert chart["date_format"] == "x" and chart["sections"][0] == (
        "compute",
        [("backward net.8", 6, 7)],
    )
    assert chart["sections"][1] == ("sent", [])


def test_a_tiny_value_is_written_without_an_exponent():
    (chart,) = [parse(b) for b in blocks(charts.xychart("t", "x", ["a"], "y", {"l": [1e-7]}, 9))]
    assert chart["lines"][0][2] == [1e-7]


XY = 'xychart-beta\n    title "t"\n    x-axis "x" ["a", "b"]\n    y-axis "y"\n    line "l" [1, 2]\n'
GANTT = (
    "gantt\n    title t\n    dateFormat x\n    axisFormat %Q\n    section s\n    task one :5, 9\n"
)


@pytest.mark.parametrize(
    "block,why",
    [
        (XY.replace("[1, 2]", "[1e-05, 2]"), "expected"),  # xychart's numbers have no exponent
        (XY.replace('"l" [1, 2]', '"l [1, 2]'), "ends inside a string"),
        (XY.replace("[1, 2]", "[1]"), "1 values for 2 categories"),
        (XY.replace("[1, 2]", "[1, 2,]"), "expected NUMBER"),
        (XY.replace("xychart-beta", "xychart-bet"), "not a diagram"),
        (XY.replace('    line "l" [1, 2]\n', ""), "without a line"),
        (GANTT.replace("task one", "task: one"), "start in ms"),  # a colon ends the task's text
        (GANTT.replace(":5, 9", ":9, 5"), "before it starts"),
        (GANTT.replace(":5, 9", ":5.5, 9"), "start in ms"),
        (GANTT.replace("task one", "call one"), "click, call and href"),
        (GANTT.replace("dateFormat x", "dateFormat YYYY"), "reads x only"),
    ],
    ids=lambda value: re.sub(r"\W+", "-", value)[:24] if len(value) < 40 else None,
)
def test_the_checker_refuses_what_mermaid_refuses(block, why):
    parse(XY), parse(GANTT)  # both parse as they are
    with pytest.raises(MermaidError, match=why):
        parse(block)


def test_the_writer_refuses_a_text_that_would_break_the_chart():
    for bad in ['a "quoted" name', "a: b", "50%", ""]:
        with pytest.raises(ValueError, match="a chart text"):
            charts.xychart(bad, "x", ["a"], "y", {"l": [1]})
    with pytest.raises(ValueError, match="cannot be drawn"):
        charts.xychart("t", "x", ["a"], "y", {"l": [float("nan")]})


def test_every_chart_in_the_readmes_parses():
    """The charts pasted from real runs (gantts in dateFormat x; xychart-beta)."""
    checked = 0
    for readme in ROOT.glob("*/README.md"):
        for block in blocks(readme.read_text()):
            head = block.lstrip().split(None, 1)[0].lower()
            if head.startswith("xychart") or (head == "gantt" and "dateFormat x\n" in block):
                parse(block)
                checked += 1
    assert checked >= 5, checked


DRAWING = [
    "primitives/benchmark_collectives.py",
    "fsdp_basics/fsdp_memory_plan.py",
    "ddp_basics/ddp_overlap.py",
    "fsdp_basics/fsdp_overlap.py",
    "transformer_basics/parity.py",  # its chart's run: tests/test_parity.py (a --mistake run)
]


@pytest.mark.parametrize("lesson", DRAWING)
def test_a_path_that_cannot_be_written_is_refused_up_front(lesson, tmp_path):
    """By argparse (in this process, as tests/test_flags.py does): one error line, exit 2, before
    any rank starts; nothing is written. Refused: a path under a file, under a folder where even
    root cannot make a file (/proc: os.access says yes to root), a folder, a name ending in /, an
    empty string. A folder that does not exist yet is fine (rank 0 makes it)."""
    (tmp_path / "file").write_text("")
    parser = lesson_parser(lesson)
    cannot = [tmp_path / "file" / "c.md", "/proc/c.md"]
    no_name = [tmp_path, f"{tmp_path}/new/", "", " "]
    for bad, why in [(p, "cannot write a chart there") for p in cannot] + [
        (p, "is no file name") for p in no_name
    ]:
        code, output, _ = parse_flags(parser, ["--chart", bad])
        lines = output.strip().splitlines()
        assert code == 2 and "argument --chart" in lines[-1] and why in lines[-1], (bad, output)
    code, _, args = parse_flags(parser, ["--chart", tmp_path / "new" / "c.md"])
    assert code == 0 and args.chart == str(tmp_path / "new" / "c.md")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


# ---- each lesson's chart against what it printed ----


BENCHMARK = "primitives/benchmark_collectives.py"
# 3 ranks: busbw is algbw x 4/3 for all_reduce, x 2/3 for all_gather (at 2 ranks all_reduce's are
# equal); sizes from 64 KiB, so that the GB/s of a loaded CPU show in the chart's 3 decimals (at
# 1 to 16 KiB both columns read 0.000 and a chart of either passed)
BENCHMARK_ARGS = ["--ops", "all_reduce,all_gather", "--min-bytes", "64K", "--max-bytes", "1M"]
BENCHMARK_ARGS += ["--iters", "1", "--warmup", "0"]


def busbw_chart_problems(result, folder):
    """What is wrong with the chart of a run: its title says busbw, so its lines must be the busbw
    the run printed (and saved in --json), not another column."""
    rows = json.loads((folder / "rows.json").read_text())
    (chart,) = one_chart(folder / "c.md")
    printed = re.findall(
        r"^ +(\w+) +(\d+) +\d+ +[\d.]+ +([\d.]+) +([\d.]+) +ok$", result.stdout, re.M
    )
    problems = []
    if chart["title"].split(",")[0] != "busbw" or chart["y_title"] != "busbw (GB/s)":
        problems.append(f"titles {chart['title']!r}, {chart['y_title']!r}")
    ops = ("all_reduce", "all_gather")
    sizes = sorted({r["bytes"] for r in rows})
    if chart["x"] != [charts.size_label(b) for b in sizes]:
        problems.append(f"sizes {chart['x']}")
    want = {op: [float(f"{r['busbw_GBps']:.3f}") for r in rows if r["op"] == op] for op in ops}
    if {name: values for _, name, values in chart["lines"]} != want:
        problems.append(f"lines {chart['lines']}, busbw {want}")
    if [float(bus) for *_, bus in printed] != [v for op in ops for v in want[op]]:
        problems.append(f"printed busbw {printed}, saved {want}")
    for op in ops:  # the run can tell the two columns apart, or this check proves nothing
        pairs = [
            (f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}") for r in rows if r["op"] == op
        ]
        assert any(a != b for a, b in pairs), f"{op}: algbw and busbw alike at 3 decimals: {pairs}"
    return problems


def run_benchmark(lesson, folder):
    out = ["--json", folder / "rows.json", "--chart", folder / "c.md"]
    result = run_lesson(lesson, *BENCHMARK_ARGS, *out, nproc=3, launcher="warm", timeout=T)
    assert_ok(result)
    return result


def test_benchmark_collectives_chart(tmp_path):
    result = run_benchmark(BENCHMARK, tmp_path)
    assert busbw_chart_problems(result, tmp_path) == []


def test_a_chart_of_another_column_than_its_title_fails(tmp_path):
    """algbw drawn under busbw's title, in a copy of the lesson: the check above sees it."""
    change = ('r["op"]: [q["busbw_GBps"] for q', 'r["op"]: [q["algbw_GBps"] for q')
    result = run_benchmark(mutant(tmp_path, BENCHMARK, change), tmp_path)
    problems = busbw_chart_problems(result, tmp_path)
    assert [p.split()[0] for p in problems] == ["lines"], problems


def test_fsdp_memory_plan_chart(tmp_path):
    from test_fsdp_memory_plan import check_output

    args = ["--max-ranks", "16", "--chart", tmp_path / "c.md"]
    result = run_lesson("fsdp_basics/fsdp_memory_plan.py", *args, launcher="warm", timeout=T)
    assert_ok(result)
    printed = check_output(result, 2, max_ranks=16)  # GiB per rank by strategy, as printed
    (chart,) = one_chart(tmp_path / "c.md")
    assert chart["x"] == ["8", "16"]
    names = [name for _, name, _ in chart["lines"]]
    assert names == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "HSDP(8)"]
    for i, (_, _, values) in enumerate(chart["lines"]):
        assert values == [printed[8][i], printed[16][i]], (names[i], values, printed)


def spans_ms(chart):
    """{section: [(label, start ms, end ms)]} of a gantt whose times are microseconds."""
    return {name: [(t, a / 1e3, b / 1e3) for t, a, b in tasks] for name, tasks in chart["sections"]}


def close(chart_ms, printed_ms):
    """The chart holds microseconds rounded, the text milliseconds to 2 decimals."""
    return abs(chart_ms - printed_ms) <= 0.0051


def test_ddp_overlap_chart(tmp_path):
    from test_ddp_overlap import blocks as timelines

    result = run_lesson(
        "ddp_basics/ddp_overlap.py", "--steps", "2", "--chart", tmp_path / "c.md",
        launcher="warm", timeout=T,
    )  # fmt: skip
    assert_ok(result)
    printed = timelines(result.stdout)  # {(cap, view): (buckets, {rank: rows})}
    gantts = one_chart(tmp_path / "c.md")
    assert len(gantts) == len(printed) == 4
    for ((cap, view), (buckets, rows)), gantt in zip(printed.items(), gantts):
        assert (
            gantt["title"]
            == f"rank 0, last step, bucket_cap_mb={cap}, gradient_as_bucket_view={view}"
        )
        spans = spans_ms(gantt)
        computed, sent = spans["backward (autograd)"], spans["all_reduce (comm hook)"]
        mine = rows[0]  # rank 0's rows, by start
        assert [t for t, *_ in computed] == [w for w, *_ in mine if w.startswith("backward")]
        assert [t for t, *_ in sent] == [
            f"{w.removeprefix('all_reduce ')} ({note})"
            for w, _, _, note in mine
            if w.startswith("all_reduce")
        ]
        assert len(sent) == buckets
        by_name = {t: (a, b) for t, a, b in computed + sent}
        for what, a, b, note in mine:
            label = (
                what
                if what.startswith("backward")
                else f"{what.removeprefix('all_reduce ')} ({note})"
            )
            assert close(by_name[label][0], a) and close(by_name[label][1], max(b, a + 0.001)), (
                label,
                a,
                b,
            )


def test_fsdp_overlap_chart(tmp_path):
    from test_fsdp_overlap import ROW

    args = ["--steps", "1", "--width", "32", "--depth", "2", "--prefetch", "1"]
    result = run_lesson(
        "fsdp_basics/fsdp_overlap.py", *args, "--chart", tmp_path / "c.md",
        launcher="warm", timeout=T,
    )  # fmt: skip
    assert_ok(result)
    parts = re.split(r"^(?=.+: \d+ all_gathers)", result.stdout, flags=re.M)[1:]
    gantts = one_chart(tmp_path / "c.md")
    assert len(gantts) == len(parts) == 3
    for part, gantt in zip(parts, gantts):
        assert gantt["title"] == f"rank 0, last step, {part.split(':')[0]}"
        spans = spans_ms(gantt)
        mine = [r for r in ROW.findall(part) if r[0] == "0"]  # rank 0's collectives, by start
        issued = spans["collectives"]
        assert [t for t, *_ in issued] == [f"{kind} {module}" for _, kind, module, *_ in mine]
        for (_, a, b), (*_, pa, pb, _) in zip(issued, mine):
            assert close(a, float(pa)) and close(b, max(float(pb), float(pa) + 0.001)), part
        computed = spans["compute"]  # each block's forward and backward, inside the step
        blocks = [f"{what} blocks.{i}" for what in ("backward", "forward") for i in range(2)]
        assert sorted(t for t, *_ in computed) == blocks, computed
        assert all(0 <= a <= b for _, a, b in computed), computed


def test_merged_loss_charts_hold_each_runs_numbers(tmp_path):
    """tools/merge_charts.py (the README's three-run chart): each run's lines, unchanged, on one
    chart per position; the largest difference it prints is the one between the files' values."""
    import runpy

    merge = runpy.run_path(str(ROOT / "tools" / "merge_charts.py"))["merge"]
    steps = ["0", "10", "19"]
    for name, losses in (("none x1", [5.5, 3.25, 2.5]), ("ddp x2", [5.5, 3.251, 2.498])):
        lines = {f"train loss, {name}": losses}
        chart = charts.xychart(f"train loss, {name}", "step", steps, "loss (nats)", lines)
        charts.write(tmp_path / f"{name[:4]}.md", chart)
    parts, gaps = merge([tmp_path / "none.md", tmp_path / "ddp .md"])
    (merged,) = [parse(b) for part in parts for b in blocks(part)]
    assert merged["x"] == steps and [n for _, n, _ in merged["lines"]] == [
        "train loss, none x1",
        "train loss, ddp x2",
    ]
    assert merged["lines"][1][2] == [5.5, 3.251, 2.498]
    assert [(gap, digits) for _, gap, digits in gaps] == [(pytest.approx(0.002), 3)]
    charts.write(tmp_path / "other.md", charts.xychart("t", "step", ["0", "5", "19"], "y", lines))
    with pytest.raises(SystemExit, match="x categories differ"):
        merge([tmp_path / "none.md", tmp_path / "other.md"])


def merge_files(tmp_path):
    """Two runs' chart files, as --chart writes them."""
    steps = ["0", "10", "19"]
    for name, losses in (("none", [5.5, 3.25, 2.5]), ("ddp", [5.5, 3.251, 2.498])):
        line = charts.xychart(f"loss, {name}", "step", steps, "loss", {f"loss, {name}": losses})
        charts.write(tmp_path / f"{name}.md", line)
    return tmp_path / "none.md", tmp_path / "ddp.md"


BAD_FILES = {
    "missing": (None, "No such file or directory"),
    "random-bytes": (bytes(range(128, 256)), "not text (UTF-8)"),
    "no-chart": (b"# notes\n", "no line chart (xychart-beta) in it"),
    "value-edited": (("2.498", "2.4g8"), "'2.4g8' is not a number"),
    "value-removed": (("5.500, 3.251, 2.498", "5.500, 3.251"), "a line's values are not one per x"),
    "quote-removed": (('line "loss, ddp"', 'line "loss, ddp'), "cannot read 'line"),
    "title-with-a-colon": (('title "loss, ddp"', 'title "loss: ddp"'), "a chart text must be"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_merge_charts_refuses_a_file_it_cannot_read_in_one_line(case, tmp_path):
    first, second = merge_files(tmp_path)
    content, message = BAD_FILES[case]
    if content is None:
        second.unlink()
    elif isinstance(content, bytes):
        second.write_bytes(content)
    else:
        old, new = content
        assert old in second.read_text(), second.read_text()
        second.write_text(second.read_text().replace(old, new))
    out = tmp_path / "merged" / "out.md"
    command = [sys.executable, ROOT / "tools" / "merge_charts.py", first, second, "--out", out]
    result = run_command(command, timeout=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and message in lines[0], str(result)
    assert lines[0].startswith("error: ") and "Traceback" not in result.stderr, str(result)
    assert not out.parent.exists(), "nothing written"
