"""Issue 18, item 1 (FSDP2 part): fsdp_basics/fsdp_overlap.py, the all_gathers and reduce_scatters
of one step per rank, and which hook prefetched which. `python lesson.py --nproc 3` and the warm
launcher at 1, 2 and 4; a bad flag is one line per rank. The mistakes its checks catch (gradient
sync off, reshard_after_forward ignored, the backward prefetch list left out) are rows of
tests/test_mutations.py. No time is asserted (the machine is loaded): only counts, order and the
parameters."""

import re

import pytest

from harness import assert_fails, assert_ok, run_lesson

LESSON, T = "fsdp_basics/fsdp_overlap.py", 240
DEPTH, PREFETCH = 3, 2  # the lesson's defaults: 3 blocks, each its own FSDP group, and the root
HEADER = re.compile(
    r"^(.+): (\d+) all_gathers, (\d+) reduce_scatters; ms from the step's start$", re.M
)
ROW = re.compile(
    r"^\[rank (\d+)\]   (all_gather|reduce_scatter) (\S+) +(\S+) \.\. +(\S+) \|.*\| ?(.*)$", re.M
)


def expected_issuers(name, nproc):
    """{(block, direction): issuing module}, written out for the defaults (depth 3, prefetch 2)."""
    if nproc == 1 or name == "reshard_after_forward=False":
        return {}
    backward = {("blocks.2", "backward"): "root"}
    if "prefetch" in name:  # block 2's backward issues blocks 1 and 0; block 0's forward 1 and 2
        backward |= {("blocks.1", "backward"): "blocks.2", ("blocks.0", "backward"): "blocks.2"}
        return backward | {("blocks.1", "forward"): "blocks.0", ("blocks.2", "forward"): "blocks.0"}
    return backward | {("blocks.1", "backward"): "blocks.2", ("blocks.0", "backward"): "blocks.1"}


def check_output(result, nproc):
    ok = assert_ok(result)
    assert ok.startswith(
        f"OK: FSDP2 with reshard_after_forward True, False and explicit prefetching on {nproc} "
    ), ok
    out = result.stdout
    counts = {name: (int(g), int(r)) for name, g, r in HEADER.findall(out)}
    groups = DEPTH + 1
    # forward: one all_gather per group; backward: one more per block resharded after forward (not
    # the root); at 1 rank FSDP all_gathers nothing. One reduce_scatter per group.
    gathers = (
        (lambda resharded: 0) if nproc == 1 else (lambda resharded: groups + DEPTH * resharded)
    )
    assert counts == {
        "reshard_after_forward=True": (gathers(True), groups),
        "reshard_after_forward=False": (gathers(False), groups),
        f"True, explicit prefetch of {PREFETCH}": (gathers(True), groups),
    }, out
    blocks = re.split(r"^(?=.+: \d+ all_gathers)", out, flags=re.M)[1:]
    for block in blocks:
        rows = ROW.findall(block)
        name = block.split(":")[0]
        assert sorted({int(r[0]) for r in rows}) == list(range(nproc)), block
        assert len(rows) == nproc * sum(counts[name]), block  # one row per collective, every rank
        assert all(float(a) <= float(b) for *_, a, b, _ in rows), block
        for rank in range(nproc):
            issued = {
                (what, d): by
                for r, kind, what, _, _, note in rows
                if int(r) == rank
                for by, d in re.findall(r"prefetched by (\S+) \((\w+)\)", note)
            }
            assert issued == expected_issuers(name, nproc), (rank, block)
    assert out.count("counts as expected: yes") == nproc, out
    diffs = re.findall(r"^.+: max \|parameter - one process\| (\S+) \(bound 1e-4\)$", out, re.M)
    assert len(diffs) == 3 and all(float(d) <= 1e-4 for d in diffs), out


@pytest.mark.parametrize(
    "nproc,launcher",
    [(3, "python"), pytest.param(1, "warm", marks=pytest.mark.quick), (2, "warm"), (4, "warm")],
)
def test_fsdp_overlap(nproc, launcher):
    check_output(run_lesson(LESSON, nproc=nproc, launcher=launcher, timeout=T), nproc)


def test_bad_flag_is_one_line():
    assert_fails(
        run_lesson(LESSON, "--batch", "7", nproc=2, launcher="warm", timeout=T),
        "--batch 7 must divide by 2 ranks",
        within=2,
    )
