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


def read(path):
    """The line charts of a file that launch/charts.py wrote: [dict(title, x_title, x, y_title,
    lines={name: [values]}, decimals)]."""
    found = []
    for block in BLOCK.findall(Path(path).read_text()):
        chart = dict(lines={}, decimals=0)
        for row in block.splitlines():
            keyword, texts = row.split(maxsplit=1)[0], QUOTED.findall(row)
            if keyword in ("title", "y-axis"):
                chart[keyword.replace("-axis", "_title")] = texts[0]
            elif keyword == "x-axis":
                chart["x_title"], chart["x"] = texts[0], texts[1:]
            elif keyword == "line":
                values = row[row.index("[") + 1 : row.rindex("]")].split(",")
                chart["lines"][texts[0]] = [float(v) for v in values]
                decimals = max(len(v.strip().partition(".")[2]) for v in values)
                chart["decimals"] = max(chart["decimals"], decimals)
        found.append(chart)
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
    parts, gaps = merge(args.files)
    charts.write(args.out, *parts)
    for title, gap, decimals in gaps:
        print(f"{title}: largest difference between two lines at one x {gap:.{decimals}f}")
    print(f"wrote {len(parts)} chart(s) to {args.out}")


if __name__ == "__main__":
    main()
