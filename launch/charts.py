"""Charts from measured numbers, as Mermaid blocks in a Markdown file (GitHub draws them).

    from launch import charts
    line = charts.xychart("busbw", "size", ["1 KiB", "4 KiB"], "GB/s", {"all_reduce": [0.5, 1.5]})
    charts.write(args.chart, line)  # rank 0; parser.add_argument("--chart", type=charts.path)

Two of Mermaid's diagrams: `xychart-beta` (line charts) and `gantt` (timelines). xychart-beta has
no log axis, and draws a legend only when its config sets xyChart.showLegend (mermaid-js/mermaid
PR #7724, merged 2026-05-07); GitHub renders with a Mermaid of its own, whose release we have not
checked (a mermaid block holding `info` shows it). So these charts ask for no legend and list their
lines under the chart, in the order Mermaid colours them, and sizes that grow by a factor are
categories, one per size, labelled by size, equally spaced. A gantt's times are integers in its
date format: here microseconds, given to Mermaid as milliseconds (dateFormat x) and shown as such
on the axis (%Q), so a span shorter than a millisecond still has a length. Standard library only:
copy it beside launch/dist_setup.py.
Grammar: mermaid-js/mermaid, packages/mermaid/src/diagrams/{xychart,gantt}/parser/*.jison.
"""

import argparse
import math
import os
import tempfile

FORBIDDEN = set('"%:;#`\n\r')  # a quote ends a string; %% starts a comment; : ; # end gantt text


def text(value):
    """A title or a name, refused if it would end the string or the statement it stands in."""
    value = str(value)
    if not value.strip() or FORBIDDEN & set(value):
        raise ValueError(f"{value!r}: a chart text must be non-empty, without {sorted(FORBIDDEN)}")
    return value


def number(value, digits):
    """Fixed-point, `digits` decimals: a number of xychart has no exponent (1e-05 is none)."""
    if not math.isfinite(value):
        raise ValueError(f"{value} cannot be drawn")
    return f"{value:.{digits}f}"


def size_label(nbytes):
    """1024 -> "1 KiB", 3 -> "3 B": the category of one message size."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def xychart(title, x_title, x, y_title, lines, digits=3, note=""):
    """A line per entry of lines {name: [y, ...]}; x: the categories (strings, one per y), or two
    numbers (first, last) for y values equally spaced between them."""
    if not lines or any(len(ys) != len(next(iter(lines.values()))) for ys in lines.values()):
        raise ValueError("every line needs as many values as the first")
    n = len(next(iter(lines.values())))
    if isinstance(x[0], str):
        if len(x) != n:
            raise ValueError(f"{len(x)} categories for {n} values")
        axis = "[" + ", ".join(f'"{text(c)}"' for c in x) + "]"
    else:
        axis = f"{number(x[0], digits)} --> {number(x[1], digits)}"
    rows = ["xychart-beta", f'    title "{text(title)}"', f'    x-axis "{text(x_title)}" {axis}']
    rows.append(f'    y-axis "{text(y_title)}"')
    for name, ys in lines.items():
        rows.append(f'    line "{text(name)}" [{", ".join(number(y, digits) for y in ys)}]')
    names = "; ".join(f"{i}. {name}" for i, name in enumerate(lines, 1))
    return fence(rows) + f"\nLines, in Mermaid's colour order (no legend): {names}.{note}\n"


def gantt(title, sections, note=""):
    """sections {name: [(label, start_us, end_us), ...]}: a bar per span, times in microseconds."""
    rows = ["gantt", f"    title {text(title)}", "    dateFormat x", "    axisFormat %Q"]
    for section, spans in sections.items():
        rows.append(f"    section {text(section)}")
        for label, start, end in spans:
            start = round(start)  # a bar of at least 1 us, so that it shows
            rows.append(f"    {text(label)} :{start}, {max(start + 1, round(end))}")
    return fence(rows) + f"\nTimes in microseconds (Mermaid reads them as ms).{note}\n"


def fence(rows):
    return "```mermaid\n" + "\n".join(rows) + "\n```\n"


def write(path, *parts):
    """The Markdown file: the charts and what is written between them (rank 0 calls it)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as file:
        file.write("\n".join(parts))


def path(value):
    """An argparse type: a file to write, in a folder that takes a new file, or under one where
    its folder can be made. Tried, not asked: os.access says yes to root even on /proc."""
    if not value.strip() or value.endswith(("/", os.sep)) or os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value!r} is no file name: pass a path such as chart.md")
    where = os.path.dirname(os.path.abspath(value))
    while not os.path.exists(where):
        where = os.path.dirname(where)
    try:
        with tempfile.TemporaryFile(dir=where):  # made, then gone: nothing is left behind
            pass
    except OSError as error:
        why = f"{value}: cannot write a chart there ({error.strerror}); pass another path"
        raise argparse.ArgumentTypeError(why) from None
    return value


path.__name__ = "a path to write a Markdown file"
