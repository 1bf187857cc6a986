"""Issue 18, item 1 (FSDP2 part): fsdp_basics/fsdp_overlap.py, the all_gathers and reduce_scatters of one step per
rank. Real torchrun at 2 ranks, `python lesson.py --nproc 3`, the warm launcher at 1 and 4; gradient sync switched off
and reshard_after_forward ignored on purpose must each fail their check; a bad flag is one line per rank. No time is
asserted (the machine is loaded): only counts, order and the parameters."""

import re

import pytest

from harness import assert_fails, assert_ok, run_lesson

LESSON, T = "fsdp_basics/fsdp_overlap.py", 240
DEPTH = 3  # the lesson's default: 3 blocks, each its own FSDP group, and the root (inp, head)
HEADER = re.compile(
    r"^(.+): (\d+) all_gathers, (\d+) reduce_scatters; ms from the step's start$", re.M
)


def check_output(result, nproc):
    ok = assert_ok(result)
    assert ok.startswith(
        f"OK: FSDP2 with reshard_after_forward True, False and explicit prefetching on {nproc} "
    ), ok
    out = result.stdout
    counts = {name: (int(g), int(r)) for name, g, r in HEADER.findall(out)}
    groups = DEPTH + 1
    # forward: one all_gather per group; backward: one more per block resharded after forward (not the root);
    # at 1 rank FSDP all_gathers nothing. One reduce_scatter per group.
    gathers = (
        (lambda resharded: 0) if nproc == 1 else (lambda resharded: groups + DEPTH * resharded)
    )
    assert counts == {
        "reshard_after_forward=True": (gathers(True), groups),
        "reshard_after_forward=False": (gathers(False), groups),
        "True, explicit prefetch of 2": (gathers(True), groups),
    }, out
    blocks = re.split(r"^(?=.+: \d+ all_gathers)", out, flags=re.M)[1:]
    for block in blocks:
        rows = re.findall(
            r"^\[rank (\d+)\]   (all_gather|reduce_scatter) (\S+) +(\S+) \.\. +(\S+) \|.*\| ?(.*)$",
            block,
            re.M,
        )
        name = block.split(":")[0]
        assert sorted({int(r[0]) for r in rows}) == list(range(nproc)), block
        assert len(rows) == nproc * sum(counts[name]), block  # one row per collective, every rank
        assert all(float(a) <= float(b) for *_, a, b, _ in rows), block
        ahead = sum(by == "issued by forward_prefetch" for *_, by in rows)
        assert ahead == (nproc * (DEPTH - 1) if "prefetch" in name and nproc > 1 else 0), block
    assert out.count("counts as expected: yes") == nproc, out
    diffs = re.findall(r"^.+: max \|parameter - one process\| (\S+) \(bound 1e-4\)$", out, re.M)
    assert len(diffs) == 3 and all(float(d) <= 1e-4 for d in diffs), out


@pytest.mark.parametrize(
    "nproc,launcher",
    [(2, "torchrun"), (3, "python"), pytest.param(1, "warm", marks=pytest.mark.quick), (4, "warm")],
)
def test_fsdp_overlap(nproc, launcher):
    check_output(run_lesson(LESSON, nproc=nproc, launcher=launcher, timeout=T), nproc)


def test_without_gradient_sync_fails():
    result = run_lesson(LESSON, "--no-grad-sync", nproc=2, launcher="warm", timeout=T)
    assert_fails(result, "parameters differ from one process's beyond 1e-4")


def test_ignoring_reshard_after_forward_fails():
    result = run_lesson(LESSON, "--ignore-reshard", nproc=2, launcher="warm", timeout=T)
    assert_fails(
        result,
        "reshard_after_forward=True: 4 all_gathers, 4 reduce_scatters, 0 forward-prefetched; "
        "expected 7, 4, 0",
    )


def test_bad_flag_is_one_line():
    assert_fails(
        run_lesson(LESSON, "--batch", "7", nproc=2, launcher="warm", timeout=T),
        "--batch 7 must divide by 2 ranks",
        within=2,
    )
