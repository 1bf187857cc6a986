"""Put the lines of several runs' charts into one chart each, and say how far apart they are.

    python transformer_basics/train.py --nproc 1 --parallel none --batch-size 32 --chart none.md
    python transformer_basics/train.py --nproc 2 --parallel ddp --batch-size 16 --chart ddp.md
    python transformer_basics/train.py --nproc 2 --parallel fsdp --batch-size 16 --chart fsdp.md
    python tools/merge_charts.py none.md ddp.md fsdp.md --out three.md

Each FILE is a Markdown file that a lesson's --chart wrote (launch/charts.py): its k-th line chart
(xychart-beta) goes into the k-th chart of --out, every line renamed after the run's line name, on
the same x categories (refused where they differ). It prints, per chart, the largest difference
between two runs' values at one x: the figure that says whether the lines coincide. The numbers
are copied from the files, never retyped; the decimals are the files' own.
"""

import argparse
import re
import sys
from itertools import combinations
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/, from a checkout
from launch import charts  # noqa: E402

BLOCK = re.compile(r"^```mermaid\nxychart-beta\n(.*?)^```", re.M | re.S)
QUOTED = re.compile(r'"([^"]*)"')
# The rows launch/charts.py writes in a line chart, each in full (categories on the x axis)
ROWS = {
    "title": re.compile(r'title "([^"]*)"'),
    "x-axis": re.compile(r'x-axis "([^"]*)" \[("[^"]*"(?:, "[^"]*")*)\]'),
    "y-axis": re.compile(r'y-axis "([^"]*)"'),
    "line": re.compile(r'line "([^"]*)" \[(.*)\]'),
}
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")  # fixed-point, as charts.number writes them


def text_of(path):
    try:
        return Path(path).read_text()
    except OSError as error:
        raise SystemExit(f"error: {path}: {error.strerror}; pass a file that --chart wrote")
    except UnicodeDecodeError:
        raise SystemExit(f"error: {path}: not text (UTF-8); pass a file that --chart wrote")


def read(path):
    """The line charts of a file that launch/charts.py wrote: [dict(title, x_title, x, y_title,
    lines={name: [values]}, decimals)]. Anything else is refused in one line naming the file."""
    found = []
    for k, block in enumerate(BLOCK.findall(text_of(path)), 1):
        chart = dict(lines={}, decimals=0)
        for row in block.strip().splitlines():
            keyword = row.split(maxsplit=1)[0]
            if keyword not in ROWS or not (match := ROWS[keyword].fullmatch(row.strip())):
                raise SystemExit(f"error: {path}, chart {k}: cannot read {row.strip()!r}")
            if keyword in ("title", "y-axis"):
                chart[keyword.replace("-axis", "_title")] = match[1]
            elif keyword == "x-axis":
                chart["x_title"], chart["x"] = match[1], QUOTED.findall(match[2])
            else:
                values = [v.strip() for v in match[2].split(",")]
                if bad := [v for v in values if not NUMBER.fullmatch(v)]:
                    raise SystemExit(f"error: {path}, chart {k}: {bad[0]!r} is not a number")
                chart["lines"][match[1]] = [float(v) for v in values]
                decimals = max(len(v.partition(".")[2]) for v in values)
                chart["decimals"] = max(chart["decimals"], decimals)
        missing = {"title", "x", "y_title"} - set(chart)
        if missing or not chart["lines"]:
            raise SystemExit(f"error: {path}, chart {k}: no {sorted(missing) or 'line'} in it")
        if any(len(ys) != len(chart["x"]) for ys in chart["lines"].values()):
            raise SystemExit(f"error: {path}, chart {k}: a line's values are not one per x")
        found.append(chart)
    if not found:
        raise SystemExit(f"error: {path}: no line chart (xychart-beta) in it; pass a --chart file")
    return found


def merge(paths):
    """The merged charts (Markdown) and, per chart, (title, the largest difference between two
    runs' values at one x, decimals)."""
    runs = [read(p) for p in paths]
    if len({len(r) for r in runs}) != 1 or not runs[0]:
        raise SystemExit(f"error: the files hold different numbers of line charts: {paths}")
    parts, gaps = [], []
    for k, same in enumerate(zip(*runs)):
        if len({tuple(chart["x"]) for chart in same}) != 1:
            raise SystemExit(f"error: chart {k + 1}'s x categories differ between the files")
        lines = {name: ys for chart in same for name, ys in chart["lines"].items()}
        if len(lines) != sum(len(chart["lines"]) for chart in same):
            raise SystemExit(f"error: chart {k + 1}: two runs name a line alike: {list(lines)}")
        pairs = combinations(lines.values(), 2)
        gap = max((abs(a - b) for ys, zs in pairs for a, b in zip(ys, zs)), default=0.0)
        title, first, digits = " vs ".join(c["title"] for c in same), same[0], same[0]["decimals"]
        note = f" Largest difference between two lines at one x: {gap:.{digits}f}."
        parts.append(
            charts.xychart(
                title, first["x_title"], first["x"], first["y_title"], lines, digits, note
            )
        )
        gaps.append((title, gap, digits))
    return parts, gaps


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("files", nargs="+", help="chart files written by --chart, one per run")
    parser.add_argument("--out", type=charts.path, required=True, help="the merged charts (.md)")
    args = parser.parse_args()
    try:
        parts, gaps = merge(args.files)
    except ValueError as error:  # a title or a name that a chart cannot hold (launch/charts.py)
        raise SystemExit(f"error: {error}") from None
    charts.write(args.out, *parts)
    for title, gap, decimals in gaps:
        print(f"{title}: largest difference between two lines at one x {gap:.{decimals}f}")
    print(f"wrote {len(parts)} chart(s) to {args.out}")


if __name__ == "__main__":
    main()
