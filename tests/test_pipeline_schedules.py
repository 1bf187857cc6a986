"""Issue 34, items 1 and 3: transformer_basics/pipeline_schedules.py. GPipe, 1F1B, Interleaved1F1B,
ZB1P, ZBV and DualPipeV equal one process at 1, 2 and 4 ranks; the bubble, replayed in ticks from
the order each rank ran, is (p-1)/(m+p-1) for GPipe and 1F1B and below it for the others (ticks are
deterministic: nothing here depends on the machine's load); activations held and sends per step as
the schedules' structure says. Source mutations show each check failing."""

import re
from fractions import Fraction

import pytest
from harness import assert_fails, assert_ok, mutant, run_lesson

LESSON = "transformer_basics/pipeline_schedules.py"
T = 300  # seconds: six schedules on a small shared machine; a hang is caught, not waited out
NAMES = ["gpipe", "1f1b", "interleaved", "zb1p", "zbv", "dualpipev"]


def table(stdout):
    """{schedule: (idle/all ticks per rank, claimed, held per rank, sends)} from the table, whose
    columns are two spaces apart."""
    lines = stdout.split("sends/step\n", 1)[1].split("\nOK:")[0].splitlines()
    rows = {}
    for name, ticks, claim, _seconds, held, sends in (re.split(r"\s{2,}", s) for s in lines):
        ticks = [Fraction(*map(int, t.split("/"))) for t in ticks.split()]
        rows[name] = (ticks, claim, [float(h) for h in held.split()], int(sends))
    return rows


@pytest.mark.parametrize(
    "nproc,launcher", [(1, "warm"), pytest.param(2, "python", marks=pytest.mark.quick), (4, "warm")]
)
def test_every_schedule_equals_one_process_and_its_bubble(nproc, launcher):
    result = run_lesson(LESSON, nproc=nproc, launcher=launcher, timeout=T)
    ok = assert_ok(result)
    m = 2 * nproc  # the default: 2 micro-batches per rank
    assert f"{', '.join(NAMES)} on {nproc} rank(s) x {m} micro-batches equal" in ok, ok
    rows = table(result.stdout)
    assert list(rows) == NAMES, result.stdout
    formula = Fraction(nproc - 1, m + nproc - 1)
    for name, (ticks, claim, held, sends) in rows.items():
        assert len(ticks) == len(held) == nproc, (name, result.stdout)
        if name in ("gpipe", "1f1b"):
            assert ticks == [formula] * nproc, (name, ticks)
        else:  # interleaving and the split backward: a smaller bubble
            assert max(ticks) < formula or nproc == 1, (name, ticks)
        # every rank's timeline printed, one line each
        assert len(re.findall(rf"^{name}: {nproc} rank\(s\)", result.stdout, re.M)) == 1
    assert rows["interleaved"][0] == [Fraction(nproc - 1, 2 * m + nproc - 1)] * nproc
    # activations: GPipe holds every micro-batch, 1F1B at most p - rank
    assert rows["gpipe"][2] == [m] * nproc
    assert rows["1f1b"][2] == [min(m, nproc - r) for r in range(nproc)]
    # sends: one activation forward and one gradient back per micro-batch and stage boundary;
    # in the V layout the boundary in the middle of the V stays on one rank
    # (on 1 rank every boundary stays on the rank: no send at all)
    loop = (2 * nproc - 1) * (nproc > 1)
    boundaries = {"gpipe": nproc - 1, "1f1b": nproc - 1, "interleaved": loop, "zb1p": loop}
    boundaries.update(zbv=2 * nproc - 2, dualpipev=2 * nproc - 2)
    assert {name: row[3] for name, row in rows.items()} == {
        name: 2 * m * b for name, b in boundaries.items()
    }, result.stdout


@pytest.mark.parametrize(
    "schedule,change,message,file",
    [
        # the losses of the micro-batches summed, not averaged: gradients m times too large
        (
            "1f1b",
            (
                "n_microbatches=m, loss_fn=loss_fn)",
                "n_microbatches=m, loss_fn=loss_fn, scale_grads=False)",
            ),
            "differs from single-process training's",
            None,
        ),
        # the optimizer given the first of the rank's two stages only
        (
            "interleaved",
            ("[q for mod in models for q in mod.parameters()]", "models[0].parameters()"),
            "differs from single-process training's",
            None,
        ),
        # the tied embedding's copies on rank 0 and rank p-1 not summed
        (
            "interleaved",
            ("dist.all_reduce(total, group=tie_group)", "pass"),
            "differs from single-process training's",
            None,
        ),
        # the bubble read as if no stage ever waited for its neighbour: 0, not (p-1)/(m+p-1)
        (
            "gpipe",
            ("start = max([free[r]] + [done[d] for d in needs])", "start = free[r]"),
            "gpipe: bubble of",
            None,  # the replay in ticks
        ),
    ],
    ids=["loss-scale", "stage-not-updated", "tie-not-summed", "bubble-ignores-waits"],
)
def test_a_mistake_fails_its_check(tmp_path, schedule, change, message, file):
    lesson = mutant(tmp_path, LESSON, change, file=file)
    result = run_lesson(
        lesson, "--schedule", schedule, "--steps", "1", nproc=2, launcher="warm", timeout=T
    )
    assert_fails(result, message)


def test_microbatches_that_do_not_fit_are_refused():
    # DualPipeV needs a micro-batch per stage, 2 per rank (ScheduleDualPipeV.__init__)
    result = run_lesson(
        LESSON,
        "--schedule",
        "dualpipev",
        "--microbatches",
        "3",
        nproc=2,
        launcher="warm",
        timeout=T,
    )
    assert_fails(result, "--microbatches 3 does not fit dualpipev on 2 ranks", within=2)
