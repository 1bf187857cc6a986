"""launch/fault_tolerant_ddp.py (issues 43, 51): replicas that keep training when one is SIGKILLed.

Run as a reader runs it, `python launch/fault_tolerant_ddp.py --nproc N` (its own launcher: the
replicas cannot be one torchrun job), at 2, 3 and 4 replicas, the last one or replica 0 dying: the
OK line, every survivor's failed step, a recovery under half the collective timeout (the lesson's
own check: the death was seen at once, not at --timeout). The mistakes its check must catch, each a
source mutation of a copy: a replacement that does not receive the weights (or the momentum); the
old group "aborted" (a no-op on Gloo) instead of freed, or the launcher's death reports ignored, so
that a survivor waits out its timeout; a replacement never admitted ends the run within the
lesson's own --timeout, not at the test's limit. What it cannot do is refused in one line naming
the flag: one replica, a kill step that leaves the replacement no step, a --timeout too short for
its check, NCCL or CUDA, under torchrun. And what the lesson says of torch: ProcessGroupGloo's
abort() and shutdown() leave a peer waiting until its timeout, freeing the group fails it at once.
"""

import re
import sys
import textwrap

import pytest

from harness import assert_fails, assert_ok, mutant, run_command, run_lesson

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
    assert recovery < 5, f"recovered after {recovery} s: at the collective timeout?\n{result}"


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
        ("            store.set(ADMITTED.format(rid=joined), str(gen))", "            pass"),
    )
    result = run_lesson(copy, "--timeout", "3", nproc=2, launcher="python", timeout=T)
    assert_fails(result, "expected {0: 0, 1: -9, 2: 0}", within=1)  # 0 and 2 exited with 1
    assert re.search(r"replica exit codes \{1: -9, (0: 1, 2: 1|2: 1, 0: 1)\}", result.stderr), (
        result
    )
    assert "wait timeout after 3000ms, keys: /admitted/2" in result.stderr, str(result)


# A recovery that waits out a timeout (4 s here) instead of seeing the death at once must fail the
# lesson's check, which wants it under half of --timeout. At 4 replicas (the last one dying) one
# survivor waits in the all_reduce for another survivor, not for the dead one: only the other's
# freeing of the old group ends that wait at once.
WAITS_OUT_ITS_TIMEOUT = {
    # the audit's mistake: abort() is a no-op on ProcessGroupGloo (torch 2.13, 2.14)
    "group-aborted-not-freed": (("        del pg\n", "        pg.abort()\n"), 4),
    # survivors() waits for every member of the old generation, the dead one too
    "death-reports-ignored": (
        (
            "        dead = [m for m in members if store.check([DEAD.format(rid=m)])]",
            "        dead = []",
        ),
        2,
    ),
}


@pytest.mark.parametrize("mistake", WAITS_OUT_ITS_TIMEOUT)
def test_a_recovery_that_waits_out_its_timeout_fails_the_check(mistake, tmp_path):
    change, nproc = WAITS_OUT_ITS_TIMEOUT[mistake]
    copy = mutant(tmp_path, LESSON, change)
    result = run_lesson(copy, "--timeout", "4", nproc=nproc, launcher="python", timeout=T)
    assert_fails(result, "not under half of --timeout 4: a wait ran out its timeout", within=1)


@pytest.mark.parametrize(
    "args, message",
    [
        (("--nproc", "1"), "--nproc 1: needs 2 replicas or more"),
        (
            ("--nproc", "2", "--kill-step", "10"),
            "--kill-step + --rejoin-after leave no step of --steps 12",
        ),
        (("--nproc", "2", "--timeout", "0.5"), "--timeout 0.5: use 2 s or more"),
        (("--nproc", "2", "--backend", "nccl"), "--backend nccl: Gloo groups only"),
        (("--nproc", "2", "--device", "cuda"), "--device cuda: CPU tensors only"),
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


# What the lesson's comment and launch/README.md say of torch: a peer waits in recv() on a group
# that the other rank aborts, shuts down or frees. Two forked processes, a 4 s group timeout.
GLOO_PEER_WAITS = """
    import datetime, time
    import multiprocessing as mp
    import torch, torch.distributed as dist

    def rank(r, port, how):
        store = dist.TCPStore("127.0.0.1", port, is_master=False)
        timeout = datetime.timedelta(seconds=4)
        pg = dist.ProcessGroupGloo(dist.PrefixStore(how, store), r, 2, timeout)
        store.set(f"{how}/up{r}", ""), store.wait([f"{how}/up0", f"{how}/up1"])
        start = time.monotonic()
        if r == 1:
            try:
                pg.recv([torch.zeros(1)], 0, 0).wait()
            except RuntimeError:
                print(f"{how}: the peer failed after {time.monotonic() - start:.1f} s", flush=True)
            return
        time.sleep(0.5)
        if how == "freed":
            del pg
        else:
            getattr(pg, how)()
        time.sleep(5)

    if __name__ == "__main__":
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        for how in ("abort", "shutdown", "freed"):
            procs = [mp.Process(target=rank, args=(r, store.port, how)) for r in (0, 1)]
            [p.start() for p in procs]
            procs[1].join(30)
            procs[0].kill()
"""


def test_gloo_abort_leaves_the_peer_waiting_and_freeing_fails_it_at_once(tmp_path):
    script = tmp_path / "gloo_peer_waits.py"
    script.write_text(textwrap.dedent(GLOO_PEER_WAITS))
    result = run_command([sys.executable, str(script)], timeout=90, cwd=tmp_path)
    assert result.returncode == 0, str(result)
    after = dict(re.findall(r"^(\w+): the peer failed after ([\d.]+) s$", result.stdout, re.M))
    assert set(after) == {"abort", "shutdown", "freed"}, str(result)
    assert float(after["abort"]) >= 3 and float(after["shutdown"]) >= 3, after  # its timeout: 4 s
    assert float(after["freed"]) < 2, after  # at once: 0.5 s, when rank 0 freed it
