"""ddp_basics/local_sgd.py (issue 42): local SGD and DiLoCo by hand, torch's PeriodicModelAverager,
against syncing every gradient every step. The OK line at 2 ranks (`python lesson.py --nproc 2`),
3 and 4 (warm launcher), the bytes per step read back from its table; the mistakes a reader could
make in DiLoCo's outer step, each caught by the lesson's own check (a source mutation of a copy,
tests/harness.mutant); an H the run never reaches, and a data set the machine cannot build (sizes
in range whose product is hundreds of GB), each refused in one line on every rank."""

import re

import pytest

from harness import assert_fails, assert_ok, mutant, run_lesson

LESSON = "ddp_basics/local_sgd.py"
T = 240  # seconds: the CI machine is small and shared; a hang is still caught
ROW = re.compile(
    r"^(sync SGD|sync AdamW|local SGD|DiLoCo|torch averager)\s+(\d+)\s+([\d.]+)\s", re.M
)


def bytes_per_step(out):
    """{(method, H): bytes per step} from the lesson's table, and the parameters' bytes."""
    full = int(re.search(r"^\d+ parameters \((\d+) bytes\)", out, re.M).group(1))
    return {(m, int(h)): float(b) for m, h, b in ROW.findall(out)}, full


@pytest.mark.parametrize("nproc,launcher", [(2, "python"), (3, "warm"), (4, "warm")])
def test_ok_and_bytes_per_step(nproc, launcher):
    result = run_lesson(LESSON, nproc=nproc, launcher=launcher, timeout=T)
    line = assert_ok(result)
    assert f"OK: {nproc} replica(s), 96 steps" in line, line
    sent, full = bytes_per_step(result.stdout)
    # each run of the default plan (H = 1, 8, 32) sends 1/H of the bytes of syncing every step
    assert len(sent) == 10, result.stdout
    for (method, h), b in sent.items():
        assert b == round(full / h, 1), f"{method} H={h}: {b} bytes per step, not {full}/{h}"
    for name in ("torch averager = local SGD at H=8", "local SGD = sync SGD at H=1"):
        diff = re.search(rf"{re.escape(name)}: max \|difference\| (\S+)", result.stdout)
        assert diff and float(diff.group(1)) <= 1e-5, result.stdout


# DiLoCo's outer step, got wrong: each must fail the comparison with the one-process simulation
# (with the check's message, not a crash). Short runs: 16 steps, a sync every 4.
OUTER_STEP_MISTAKES = {
    # the weights averaged, as local SGD does, and no outer optimizer: outer lr 1, no momentum
    "weights-synced-not-pseudo-gradient": (
        "                g.grad = g.detach() - p.detach()  # pseudo-gradient: where this replica "
        "went\n                dist.all_reduce(g.grad, op=dist.ReduceOp.AVG)\n"
        "            outer_opt.step()",
        "                dist.all_reduce(p.data, op=dist.ReduceOp.AVG)\n"
        "                g.data.copy_(p.data)",
    ),
    "outer-momentum-forgotten": ("momentum=outer_momentum, nesterov=True", "momentum=0.0"),
    "heavy-ball-not-nesterov": ("nesterov=True", "nesterov=False"),
}


@pytest.mark.parametrize("mistake", OUTER_STEP_MISTAKES)
def test_diloco_mistakes_fail_the_check(mistake, tmp_path):
    copy = mutant(tmp_path, LESSON, OUTER_STEP_MISTAKES[mistake])
    result = run_lesson(
        copy, "--sync-every", "4", "--steps", "16", nproc=2, launcher="warm", timeout=T
    )
    assert_fails(result, "DiLoCo H=4: weights differ from the one-process simulation by")
    assert "local SGD H=4: weights differ" not in result.output, result.output  # DiLoCo's alone


def test_a_data_set_this_machine_cannot_build_is_refused_in_one_line():
    """2 x 10**10 examples, every rank building them all (800 GB at make_data's peak): refused."""
    args = ("--steps", "100000", "--batch", "100000", "--sync-every", "1")
    result = run_lesson(LESSON, *args, nproc=2, launcher="warm", timeout=T)
    assert_fails(result, "--steps x --batch x ranks: 800.0 GB to build the data", within=2)
    assert 2 in result.rank_codes and "Traceback" not in result.output, result


def test_an_h_the_run_never_reaches_is_refused_in_one_line():
    result = run_lesson(
        LESSON, "--sync-every", "8,128", "--steps", "96", nproc=2, launcher="warm", timeout=T
    )
    assert_fails(result, "--sync-every [128] must divide --steps 96", within=2)
    assert 2 in result.rank_codes and "Traceback" not in result.output, result
