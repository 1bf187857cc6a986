"""Issue 4 lessons: ring/tree all-reduce, backend matrix, benchmark, hangs, GIL (weight sync:
test_weight_sync.py; the pipelined ring: test_ring_all_reduce_pipelined.py)."""

import csv
import json
import math
import re

import pytest
from harness import assert_fails, assert_ok, run_lesson
from lesson_cli import lesson_parser, parse

T = 240  # seconds: generous, the CI machine is shared


# ring_all_reduce.py: lengths that do not divide by N, and lengths smaller than N.
# `python lesson.py` at 3 ranks; the harness's warm launcher (torchrun's environment, forked ranks)
# at the other sizes.
@pytest.mark.parametrize(
    "nproc,launcher",
    [pytest.param(2, "warm", marks=pytest.mark.quick), (3, "python"), (4, "warm"), (5, "warm")],
)
def test_ring_all_reduce(nproc, launcher):
    sizes = [1, 3, 7, 1001]  # 1 and 3 are smaller than some N; 7 and 1001 divide by none of 2..5
    result = run_lesson(
        "primitives/ring_all_reduce.py",
        "--sizes",
        ",".join(map(str, sizes)),
        "--iters",
        "1",
        nproc=nproc,
        launcher=launcher,
        timeout=T,
    )
    line = assert_ok(result)
    assert f"on {nproc} ranks" in line
    rows = [
        line.split() for line in result.stdout.splitlines() if re.match(r"\s*\d+\s+\d+\s", line)
    ]
    assert [int(r[0]) for r in rows] == sizes, result.stdout
    for r in rows:  # steps counted by the lesson's own loops
        assert int(r[1]) == 2 * (nproc - 1), r
        assert int(r[4]) == 2 * math.ceil(math.log2(nproc)), r


@pytest.mark.quick
@pytest.mark.parametrize(
    "lesson,flag",
    [
        ("primitives/ring_all_reduce.py", "--sizes"),
        ("primitives/ring_all_reduce_pipelined.py", "--sizes"),
        ("primitives/ring_all_reduce_pipelined.py", "--chunks"),
    ],
)
def test_a_list_with_a_zero_is_refused_where_it_is_parsed(lesson, flag):
    """tests/test_flags.py tries 0 alone; a 0 inside a list is refused by argparse too."""
    code, output, _ = parse(lesson_parser(lesson), [flag, "4,0"])
    assert code == 2 and f"argument {flag}: 0 is not an integer in [1," in output, output


# backend_matrix.py: only what runs here is filled in.
@pytest.mark.quick
def test_backend_matrix():
    result = run_lesson("primitives/backend_matrix.py", nproc=2, launcher="python", timeout=T)
    assert_ok(result)
    rows = {
        line.split("|")[1].strip().strip("`"): [c.strip() for c in line.split("|")[2:-1]]
        for line in result.stdout.splitlines()
        if line.startswith("| `")
    }
    assert len(rows) >= 30
    for call in [
        "broadcast",
        "all_reduce",
        "all_gather",
        "send / recv",
        "ReduceOp.MAX",
        "monitored_barrier",
        "all_gather_object",
    ]:
        assert rows[call][0] == "yes", (call, rows[call])
    premul = next(v for k, v in rows.items() if k.startswith("ReduceOp.PREMUL_SUM"))
    assert premul[0].startswith("no (")  # NCCL-only; the reason is printed below the table
    assert "PREMUL_SUM with Gloo" in result.stdout
    if "0 GPU(s)" in result.stdout:
        assert all(v[1] == v[2] == "not available here" for v in rows.values())
    assert "Made with torch" in result.stdout


# benchmark_collectives.py: nccl-tests busbw factors, machine-readable output, a check that bites.
FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1,
    "reduce": lambda n: 1,
    "sendrecv": lambda n: 1,
}


# bfloat16 at 3 ranks: the closed-form check must hold bit for bit there too (the sums stay below
# 256). `python lesson.py` at 2 ranks, the warm launcher at 3 and 4; the check failing on a wrong
# value: tests/test_mutations.py.
@pytest.mark.parametrize(
    "nproc,extra",
    [
        (2, []),
        (4, ["--max-bytes", "16K", "--iters", "2"]),
        pytest.param(
            3, ["--max-bytes", "4K", "--iters", "1", "--dtype", "bfloat16"], marks=pytest.mark.quick
        ),
    ],
)
def test_benchmark_collectives(nproc, extra, tmp_path):
    out_json, out_csv = tmp_path / "b.json", tmp_path / "b.csv"
    result = run_lesson(
        "primitives/benchmark_collectives.py",
        *extra,
        "--json",
        out_json,
        "--csv",
        out_csv,
        nproc=nproc,
        launcher="python" if nproc == 2 else "warm",
        timeout=T,
    )
    assert_ok(result)
    records = json.loads(out_json.read_text())
    assert {r["op"] for r in records} == set(FACTORS)
    with open(out_csv) as f:
        assert len(list(csv.DictReader(f))) == len(records)
    for r in records:
        esize = {"float32": 4, "bfloat16": 2}[r["dtype"]]
        assert r["ranks"] == nproc and r["bytes"] % (esize * nproc) == 0
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * FACTORS[r["op"]](nproc), rel=1e-9)
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9, rel=1e-9)
    printed = [
        row
        for row in (line.split() for line in result.stdout.splitlines())
        if row[:1] and row[0] in FACTORS
    ]
    assert len(printed) == len(records) and all(row[-1] == "ok" for row in printed)


# debug_hangs.py: every part ends, and the missing rank is named. `python lesson.py` at 2 ranks,
# the warm launcher at 3 (nothing here depends on torchrun: the signal is the lesson's own).
@pytest.mark.parametrize("nproc", [2, pytest.param(3, marks=pytest.mark.quick)])
def test_debug_hangs(nproc):
    result = run_lesson(
        "primitives/debug_hangs.py",
        nproc=nproc,
        launcher="python" if nproc == 2 else "warm",
        timeout=T,
    )
    line = assert_ok(result)
    missing = nproc - 1
    assert f"monitored_barrier named missing rank {missing}" in line
    assert f"Ranks {missing} failed to pass monitoredBarrier" in result.stdout
    assert f"DETAIL raised {2 * nproc} mismatch errors" in line
    assert f"ended {nproc - 1} hung rank(s)" in line
    assert "in part_d" in result.stdout and "py-spy dump --pid" in result.stdout


def test_debug_hangs_other_missing_rank_and_bad_rank():
    result = run_lesson(
        "primitives/debug_hangs.py",
        "--parts",
        "a,c",
        "--missing-rank",
        "1",
        nproc=3,
        launcher="warm",
        timeout=T,
    )
    assert "named missing rank 1" in assert_ok(result)
    assert "Ranks 1 failed to pass monitoredBarrier" in result.stdout
    # --missing-rank 0 is refused by argparse (tests/test_flags.py); one past the last rank here
    assert_fails(
        run_lesson(
            "primitives/debug_hangs.py", "--missing-rank", "2", nproc=2, launcher="warm", timeout=T
        ),
        "--missing-rank must be between 1 and 1",
        within=2,
    )


# gil_threads_vs_processes.py: runs, checks its work, prints the three timings.
@pytest.mark.quick
def test_gil_threads_vs_processes():
    result = run_lesson(
        "primitives/gil_threads_vs_processes.py",
        "--work",
        "200000",
        nproc=2,
        launcher="python",
        timeout=T,
    )
    assert_ok(result)
    for label in ["serial, 1 thread:", "2 threads, 1 process:", "2 processes:"]:
        assert re.search(re.escape(label) + r"\s+[\d.]+s", result.stdout), label
