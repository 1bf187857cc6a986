"""launch/fault_tolerant_ddp.py (issue 43): replicas that keep training when one is SIGKILLed.

Run as a reader runs it, `python launch/fault_tolerant_ddp.py --nproc N` (its own launcher: the
replicas cannot be one torchrun job), at 2, 3 and 4 replicas, the last one or replica 0 dying: the
OK line, every survivor's failed step, a recovery within the collective timeout (the death was seen
at once, not at --timeout). A replacement that does not receive the weights (or the momentum) from a
survivor fails the lesson's own check (source mutations of a copy); a replacement never admitted
ends the run within the lesson's own --timeout, not at the test's limit. What it cannot do is
refused in one line: one replica, a kill step that leaves the replacement no step, under torchrun.
"""

import re

import pytest

from harness import assert_fails, assert_ok, mutant, run_lesson

LESSON = "launch/fault_tolerant_ddp.py"
# The lesson ends itself first: its launcher kills the replicas 30 s + 4 x --timeout (10 s) + 0.1 s
# a step after they start (71.2 s), so a stuck run fails with the lesson's message, not here.
T = 150
SYNC = "    for t in [*model.parameters(), *momenta]:\n        dist.broadcast"


@pytest.mark.parametrize(
    "nproc, killed, step",
    [(2, 1, 6), (3, 0, 3), (4, 3, 6)],  # replica 0 dies too: the store is the launcher's
)
def test_a_replica_dies_and_the_others_go_on(nproc, killed, step):
    args = ("--kill-rank", str(killed), "--kill-step", str(step))
    result = run_lesson(LESSON, *args, nproc=nproc, launcher="python", timeout=T)
    line = assert_ok(result)
    assert f"OK: 12 steps, replica {killed} SIGKILLed and replaced" in line, line
    assert f"the {nproc} live replicas are identical" in line, line
    failed = re.findall(rf"^\[replica (\d+)\] step {step} failed: ", result.stdout, re.M)
    survivors = sorted(str(r) for r in range(nproc) if r != killed)
    assert sorted(failed) == survivors, f"each survivor reports the failed step\n{result}"
    joined = f"steps {step + 2}-11 on replicas {[r for r in range(nproc) if r != killed] + [nproc]}"
    assert joined in result.stdout, f"the replacement {nproc} did not train\n{result}"
    recovery = float(re.search(r"^recovery: ([\d.]+) s", result.stdout, re.M).group(1))
    assert recovery < 10, f"recovered after {recovery} s: at the collective timeout?\n{result}"


@pytest.mark.parametrize(
    "mistake",
    [
        pytest.param("    for t in momenta:\n        dist.broadcast", id="weights-not-sent"),
        pytest.param(
            "    for t in model.parameters():\n        dist.broadcast", id="momentum-not-sent"
        ),
    ],
)
def test_a_replacement_without_the_state_fails_the_check(mistake, tmp_path):
    copy = mutant(tmp_path, LESSON, (SYNC, mistake))
    result = run_lesson(copy, nproc=2, launcher="python", timeout=T)
    assert_fails(result, "replica 2's weights or momentum differ from replica 0's", within=1)


def test_a_replacement_never_admitted_ends_the_run_by_itself(tmp_path):
    """Every wait is bounded: the replacement's wait for admission, the survivors' new group."""
    copy = mutant(
        tmp_path,
        LESSON,
        ('            store.set(f"admitted/{joined}", str(g))', "            pass"),
    )
    result = run_lesson(copy, "--timeout", "3", nproc=2, launcher="python", timeout=T)
    assert_fails(result, "expected {0: 0, 1: -9, 2: 0}", within=1)  # 0 and 2 exited with 1
    assert re.search(r"replica exit codes \{1: -9, (0: 1, 2: 1|2: 1, 0: 1)\}", result.stderr), (
        result
    )
    assert "wait timeout after 3000ms, keys: /admitted/2" in result.stderr, str(result)


@pytest.mark.parametrize(
    "args, message",
    [
        (("--nproc", "1"), "--nproc 1: needs 2 replicas or more"),
        (
            ("--nproc", "2", "--kill-step", "10"),
            "--kill-step + --rejoin-after leave no step of --steps 12",
        ),
    ],
)
def test_what_it_cannot_do_is_refused_in_one_line(args, message):
    result = run_lesson(LESSON, *args[2:], nproc=int(args[1]), launcher="python", timeout=T)
    assert_fails(result, message, within=1)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one line\n{result}"


def test_under_torchrun_it_refuses_on_every_rank():
    result = run_lesson(LESSON, nproc=2, launcher="warm", timeout=T)
    assert_fails(result, "the replicas cannot be one torchrun job", within=2)
