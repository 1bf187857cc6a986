"""Issue 52: transformer_basics/parity.py, one GPT under every layout against one process.

- The correct run, at 4 ranks (`python lesson.py --nproc 4`, the README's command) and at 2
  (through the warm launcher, with --grad-clip 0, the setting two mistakes run with): every layout's
  row within its tolerance, the tolerance printed the formula's, the control beyond its own, the
  clip acting at every step where it is on, the seed checkpoint written.
- Each --mistake at 4 ranks: the check fails with one line naming exactly the rows that diverge,
  the table marks the same rows, and every other row stays within its tolerance. One of them also
  writes --chart: the Mermaid parses, one line per row, holding the losses printed.
- World sizes and flags that a layout cannot take are refused in one line.
The checks of the check (a row compared with the wrong one, a table that repeats one row's losses,
float32's eps in the tolerance, the clip's replicas counted as shards) are source mutations in
tests/test_mutations.py.
"""

import re
from collections import namedtuple

import pytest
from harness import assert_fails, assert_ok, run_lesson
from mermaid_check import blocks, parse

LESSON = "transformer_basics/parity.py"
T = 300  # seconds: 4 ranks on a small shared CPU
REFERENCES = ["one process, gpt", "one process, gpt+dropout", "one process, moe"]
LAYOUTS = ["ddp", "fsdp2", "hsdp", "tp", "pp 1f1b", "cp ring", "ep", "fsdp x tp"]
CONTROL = "control, f32 grads"
STEPS, BATCH, BLOCK, EMBD = 4, 16, 16, 32  # the lesson's defaults
# the rows each mistake must break at 4 ranks, and why (the README says more)
MISTAKES = {
    # the one row with dropout, and the ranks of a TP group hold copies of its activations
    "dropout-rng-per-rank": ["tp"],
    # the rows whose ranks read different shares of the batch (tp, pp and cp read it whole)
    "no-data-sharding": ["ddp", "fsdp2", "hsdp", "ep", "fsdp x tp"],
    # the rows whose gradients are reduced by hand (DDP and FSDP2 average themselves)
    "gradients-summed": ["cp ring", "ep"],
    # the pipeline's schedule divides by m; nobody else's does
    "loss-averaged-twice": ["pp 1f1b"],
    # the rows whose ranks hold different parts of the gradient (ddp and cp hold it whole)
    "clip-local-norm": ["fsdp2", "hsdp", "tp", "pp 1f1b", "ep", "fsdp x tp"],
    "tied-gradients-not-summed": ["pp 1f1b"],
    # every row that reduces gradients across ranks (tp's all_reduces are of activations)
    "bf16-reductions": ["ddp", "fsdp2", "hsdp", "pp 1f1b", "cp ring", "ep", "fsdp x tp"],
}


Row = namedtuple("Row", "layout model losses diff tol verdict")
# what each row says it ran: its mesh at 4 ranks (the README's) and at 2
SHAPES = {
    4: ["dp 4 (replicas)", "dp 4 (shards)", "replicate 2 x shard 2", "tp 4"]
    + ["pp 4 x 4 micro-batches", "cp 4 (a ring)", "dp 2 x ep 2", "dp 2 x tp 2"],
    2: ["dp 2 (replicas)", "dp 2 (shards)", "replicate 2 x shard 1", "tp 2"]
    + ["pp 2 x 2 micro-batches", "cp 2 (a ring)", "dp 1 x ep 2", "dp 1 x tp 2"],
}


def table(stdout):
    """{row name: Row}, in the table's order."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("row "))
    rows = {}
    for line in lines[start + 1 :]:
        if line.startswith("tolerance:"):
            break
        name, layout, model, *cells = re.split(r"\s{2,}", line.strip())
        losses = [float(c) for c in cells[:3]]
        diff, tol, verdict = (
            (float(cells[3]), float(cells[4]), cells[5]) if cells[3:] else [None] * 3
        )
        rows[name] = Row(layout, model, losses, diff, tol, verdict)
    return rows


def tolerance(ranks, loss):
    """parity.py's: 8 x steps x (B*T + 4*C + ranks) x float64's eps x the loss."""
    return 8 * STEPS * (BATCH * BLOCK + 4 * EMBD + ranks) * 2.0**-52 * loss


def check_rows(rows, nproc, diverged=()):
    assert list(rows) == REFERENCES + LAYOUTS + [CONTROL], list(rows)
    assert [rows[name].layout for name in LAYOUTS] == SHAPES[nproc], rows
    assert rows["tp"].model == "gpt+dropout" and rows["ep"].model == "moe", rows
    for name in LAYOUTS + [CONTROL]:
        row = rows[name]
        reference = rows[f"one process, {row.model}"].losses
        ranks = 1 if name == CONTROL else nproc
        # the printed tolerance is the formula's, from its reference's largest loss (step 0)
        assert row.tol == pytest.approx(tolerance(ranks, max(reference)), rel=0.05), (name, rows)
        if name == CONTROL:
            assert row.diff > row.tol and row.verdict == "diverged, as it must", rows
        elif name in diverged:
            assert row.diff > 1e3 * row.tol and row.verdict == "DIVERGED", (name, rows)
        else:
            assert row.diff <= row.tol and row.verdict == "ok", (name, rows)
    # three models, three trainings: the dropout and the experts change the loss
    assert len({tuple(rows[name].losses) for name in REFERENCES}) == 3, rows


@pytest.mark.parametrize(
    "nproc,launcher,args",
    [(4, "python", ()), pytest.param(2, "warm", ("--grad-clip", "0"), marks=pytest.mark.quick)],
)
def test_every_layout_trains_as_one_process_does(nproc, launcher, args, tmp_path):
    result = run_lesson(
        LESSON, "--out", str(tmp_path), *args, nproc=nproc, launcher=launcher, timeout=T
    )
    assert assert_ok(result).startswith(
        f"OK: 8 layouts on {nproc} rank(s) trained {STEPS} steps as one process does"
    ), result
    check_rows(table(result.stdout), nproc)
    clip = re.search(r"acted at (\d+) of (\d+) steps", result.stdout)
    assert clip and clip.groups() == (("0" if args else str(STEPS)), str(STEPS)), result
    assert (tmp_path / "seed.pt").is_file() and not list(tmp_path.glob("*.tmp")), result


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_mistake_fails_the_check_naming_its_rows(mistake, tmp_path):
    chart = tmp_path / "chart.md"
    draws = mistake == "no-data-sharding"  # one run draws its chart too
    args = ("--out", str(tmp_path), "--mistake", mistake) + (
        ("--chart", str(chart)) if draws else ()
    )
    result = run_lesson(LESSON, *args, nproc=4, launcher="warm", timeout=T)
    names = MISTAKES[mistake]
    line = f"FAILED: {len(names)} row(s) beyond their tolerance of one process: {', '.join(names)}"
    assert_fails(result, line)
    assert f"mistake {mistake}: " in result.stdout, result
    rows = table(result.stdout)
    check_rows(rows, 4, diverged=MISTAKES[mistake])
    if draws:
        check_chart(chart, rows)


def check_chart(path, rows):
    """The chart parses as Mermaid, one line per row, each the losses printed (4 decimals)."""
    (chart,) = [parse(block) for block in blocks(path.read_text())]
    assert chart["x"] == [str(step) for step in range(STEPS)], chart
    assert chart["title"] == "parity.py, 4 rank(s), no-data-sharding", chart
    lines = {name: values for _, name, values in chart["lines"]}
    assert list(lines) == list(rows), chart
    shown = sorted({0, STEPS // 2, STEPS - 1})
    for name, row in rows.items():
        assert [lines[name][s] for s in shown] == [round(v, 4) for v in row.losses], (name, chart)


@pytest.mark.parametrize(
    "nproc,args,message",
    [
        (3, (), "--batch 16 must divide into 3 ranks x --microbatches 2: use a multiple of 6"),
        (2, ("--block-size", "6"), "cp: --block-size 6 must be a multiple of 2 x 2 ranks"),
        (2, ("--n-layer", "1"), "pp: --n-layer 1 is fewer than the 2 stages"),
    ],
)
def test_a_size_a_layout_cannot_take_is_refused_in_one_line(nproc, args, message, tmp_path):
    out = str(tmp_path)
    result = run_lesson(LESSON, "--out", out, *args, nproc=nproc, launcher="warm", timeout=T)
    assert_fails(result, message, within=nproc)
    assert "Traceback" not in result.output and not list(tmp_path.iterdir()), result
