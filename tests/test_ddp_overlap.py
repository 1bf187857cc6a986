"""Issue 18, item 1: ddp_basics/ddp_overlap.py, a timeline of DDP's backward per rank, at 2, 1 and
4 ranks through the warm launcher and as `python lesson.py --nproc 3` (issue 33). Nothing here
looks at a time (the machine is loaded): only at the structure of the timeline and at the checks'
figures. The comm hook's division and gradient_as_bucket_view left out, each failing its check:
tests/test_mutations.py (DDP_BASICS); a bad flag: tests/test_flags.py."""

import re

import pytest

from harness import assert_ok, run_lesson

LESSON, T = "ddp_basics/ddp_overlap.py", 240
WIDTH, DEPTH = 256, 3  # the lesson's defaults
LAYERS = [f"net.{2 * i}" for i in range(DEPTH + 2)]  # toy.MLP: Linear, Tanh, Linear, ... Linear
MODEL_BYTES = 4 * ((2 + 1) * WIDTH + DEPTH * (WIDTH + 1) * WIDTH + (WIDTH + 1) * 4)
HEADER = re.compile(
    r"^bucket_cap_mb=(\S+), gradient_as_bucket_view=(True|False): (\d+) bucket\(s\); last step's",
    re.M,
)
ROW = re.compile(
    r"^\[rank (\d+)\]   (backward net\.\d+|all_reduce bucket \d+) +(\S+) \.\. +(\S+)"
    r" \|[ #=]+\| (.*)$"
)


def blocks(out):
    """{(cap, view): (buckets, {rank: [(what, start, end, note), ...]})} from the printed
    timelines."""
    found, heads = {}, list(HEADER.finditer(out))
    for head, nxt in zip(heads, heads[1:] + [None]):
        rows = {}
        for line in out[head.end() : nxt.start() if nxt else len(out)].splitlines():
            if m := ROW.match(line):
                rows.setdefault(int(m[1]), []).append((m[2], float(m[3]), float(m[4]), m[5]))
        found[head[1], head[2] == "True"] = (int(head[3]), rows)
    return found


def check_output(result, nproc):
    ok = assert_ok(result)
    assert ok.startswith(f"OK: 4 DDP variants on {nproc} rank(s)"), ok
    out = result.stdout
    found = blocks(out)
    assert list(found) == [("default", False), ("0.5", False), ("0.25", False), ("0.25", True)], out
    for (cap, view), (buckets, rows) in found.items():
        assert sorted(rows) == list(range(nproc)), (cap, view, out)
        for rank, events in rows.items():
            names = [what for what, *_ in events]
            # one row per Linear layer and per bucket, each ending after it starts, by start time
            assert sorted(names) == sorted(
                [f"backward {n}" for n in LAYERS]
                + [f"all_reduce bucket {i}" for i in range(buckets)]
            ), (rank, names)
            starts = [a for _, a, _, _ in events]
            assert all(a <= b for _, a, b, _ in events), (rank, events)
            assert starts == sorted(starts), (rank, events)
            held = [
                layer
                for what, _, _, note in events
                if what.startswith("all_reduce")
                for layer in note.split(", ")
            ]
            assert set(held) == set(LAYERS), (rank, held)  # every layer travels in some bucket
    # the model fits DDP's 1 MiB first bucket: one bucket by default; smaller caps, more buckets
    assert MODEL_BYTES < 2**20 and found["default", False][0] == 1, out
    assert 1 < found["0.5", False][0] < found["0.25", False][0] == found["0.25", True][0], out
    assert out.count("iff gradient_as_bucket_view: yes") == nproc, out
    diffs = re.findall(
        r"^bucket_cap_mb=.*: max \|parameter - one process\| (\S+) \(bound (\S+)\)$", out, re.M
    )
    assert len(diffs) == 4 and all(float(d) <= float(b) <= 1e-5 for d, b in diffs), out


@pytest.mark.parametrize(
    "nproc,launcher",
    [(2, "warm"), (3, "python"), pytest.param(1, "warm", marks=pytest.mark.quick), (4, "warm")],
)
def test_ddp_overlap(nproc, launcher):
    check_output(run_lesson(LESSON, nproc=nproc, launcher=launcher, timeout=T), nproc)
