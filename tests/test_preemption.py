"""launch/preemption.py (issue 53): a real signal mid-step ends in a checkpoint and exit code 75,
the resumed run ends bit for bit where an uninterrupted one ends (the weights' sha256 the lesson
prints; the lesson itself checks them against a one-process replay, within 1e-9).

The signals are real and come from outside, as a scheduler sends them: SIGTERM to torchrun (which
forwards it to its workers), SIGUSR1 to one worker of torchrun only, SIGUSR1 to torchrun with and
without --signals-to-handle, SIGTERM to each rank of `python --nproc 3` two steps apart (the ranks
get it in different steps); and the lesson's own --preempt-at lever. A signal during a save, and a
SIGKILL in the middle of one, are made by tests/save_interrupter.py around torch.save. Slurm's
`scancel --signal=USR1` and the requeue are in tests/test_launch_cluster.py. Each mistake a reader
could make is a copy of the lesson with it written in: the stop decided by each rank alone, the
momentum not restored, a handler that exits at once, a save without its rename (and the stop
decided by a MIN: tests/test_mutations.py).
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

import warm_launcher
from harness import (
    RUN_MARK,
    ROOT,
    Result,
    assert_fails,
    assert_ok,
    end_run,
    lesson_env,
    mutant,
    run_lesson,
    torchrun_command,
)

LESSON = "launch/preemption.py"
INTERRUPTER = Path(__file__).resolve().with_name("save_interrupter.py")
# A run takes seconds on an idle machine; a hang is ended here with every process it started. At
# load 15 on the 2-core machine a 3-rank torchrun took 115 s to its [setup] line (2026-11-28).
T = 300
STEPS = ("--steps", "40")  # 40 steps of 0.05 s (the lesson's --step-time): time to land a signal
STOPPED = re.compile(
    r"^(SIG\w+): stopped after step (\d+), saved .*; exit code 75: resume me$", re.M
)
DIGEST = re.compile(r"weights sha256 ([0-9a-f]{16})$")


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """The weights' digest of a run never interrupted, per world size (the warm launcher)."""
    digests = {}

    def digest(nproc):
        if nproc not in digests:
            out = tmp_path_factory.mktemp(f"uninterrupted{nproc}")
            result = run_lesson(LESSON, *STEPS, "--out", out, nproc=nproc, launcher="warm",
                                timeout=T)  # fmt: skip
            digests[nproc] = DIGEST.search(assert_ok(result)).group(1)
        return digests[nproc]

    return digest


def stopped(result, name=None):
    """The step the run stopped after (its line says it), checked against the checkpoint."""
    found = STOPPED.findall(result.stdout)
    assert len(found) == 1, f"no single stop line\n{result}"
    signal_name, step = found[0]
    assert name is None or signal_name == name, f"stopped for {signal_name}, not {name}\n{result}"
    return int(step)


def saved_step(out):
    return torch.load(Path(out) / "checkpoint.pt", map_location="cpu", weights_only=True)["step"]


def assert_resumes_to_the_uninterrupted_end(out, step, nproc, uninterrupted):
    result = run_lesson(LESSON, *STEPS, "--out", out, "--resume", nproc=nproc, launcher="warm",
                        timeout=T)  # fmt: skip
    line = assert_ok(result)
    assert f"resumed at step {step} of 40" in result.stdout, str(result)
    assert DIGEST.search(line).group(1) == uninterrupted(nproc), (
        f"the resumed run's weights are not bit-identical to the uninterrupted run's\n{result}"
    )


class Job:
    """A launch in a session of its own, its stdout read as it comes; every process it started
    (found by harness.RUN_MARK, as harness.run_command does) is ended when it is done or late."""

    def __init__(self, command, env=None):
        self.mark = f"{os.getpid()}-preemption-{uuid.uuid4().hex}"
        self.proc = subprocess.Popen(
            [str(c) for c in command],
            cwd=ROOT,
            env={**lesson_env(env), RUN_MARK: self.mark},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.command, self.out, self.err = [str(c) for c in command], [], []
        self.readers = [
            threading.Thread(target=lambda: self.out.extend(self.proc.stdout), daemon=True),
            threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True),
        ]
        for reader in self.readers:
            reader.start()
        self.deadline = time.monotonic() + T

    def wait_for(self, text):
        while not any(text in line for line in self.out):
            assert self.proc.poll() is None and time.monotonic() < self.deadline, (
                f"no {text!r}\n{self.finish()}"
            )
            time.sleep(0.05)

    def processes(self, **env):
        """Live pids of this run whose start-up environment holds each KEY=value of env."""
        want = {f"{RUN_MARK}={self.mark}".encode()} | {f"{k}={v}".encode() for k, v in env.items()}
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if want <= set(f.read().split(b"\0")):
                        found.append(int(pid))
            except OSError:
                pass
        return found

    def children(self, pid):
        found = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except OSError:
                pass
        return found

    def finish(self):
        """Waits for the launcher and for every process that holds its output (a worker that
        outlived its torchrun too), then ends whatever is left."""
        timed_out = False
        try:
            self.proc.wait(timeout=max(1, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        for reader in self.readers:  # a reader ends when every writer of its pipe has exited
            reader.join(timeout=max(0, self.deadline - time.monotonic()))
            timed_out |= reader.is_alive()
        end_run(self.proc.pid, f"{RUN_MARK}={self.mark}".encode())
        self.proc.wait()
        for reader in self.readers:
            reader.join(timeout=10)
        return Result(
            self.command, self.proc.returncode, "".join(self.out), "".join(self.err), timed_out
        )


def mid_run(job, started="starting at step 0"):
    job.wait_for(started)
    time.sleep(0.3)  # about 6 steps in: mid-run, and most likely mid-step (its 50 ms sleep)


# ------------------------------------------------------------------------- real signals, launchers


def test_sigterm_to_torchrun_stops_every_worker_after_one_step(tmp_path, uninterrupted):
    """torchrun forwards SIGTERM to its workers and waits for them; it then raises and exits 1."""
    job = Job(torchrun_command(LESSON, 2, [*STEPS, "--out", tmp_path]))
    mid_run(job)
    job.proc.send_signal(signal.SIGTERM)
    result = job.finish()
    step = stopped(result, "SIGTERM")
    assert not result.timed_out and result.returncode == 1, str(result)
    assert "SignalException: Process" in result.stderr and "got signal: 15" in result.stderr
    assert 0 < step < 40 and saved_step(tmp_path) == step, str(result)
    assert_resumes_to_the_uninterrupted_end(tmp_path, step, 2, uninterrupted)


def test_sigusr1_to_one_worker_only_stops_them_all(tmp_path, uninterrupted):
    """Only rank 1 is signalled: ranks 0 and 2 learn it from the all_reduce, and every worker
    exits 75 after the same step (torchrun's summary lists each rank's code)."""
    job = Job(torchrun_command(LESSON, 3, [*STEPS, "--out", tmp_path]))
    mid_run(job)
    (worker,) = job.processes(RANK="1")
    os.kill(worker, signal.SIGUSR1)
    result = job.finish()
    step = stopped(result, "SIGUSR1")
    assert result.returncode == 1 and "ChildFailedError" in result.stderr, str(result)
    codes = re.findall(r"^  exitcode  : (-?\d+)", result.stderr, re.M)
    assert codes == ["75", "75", "75"], f"every worker's code, from torchrun's summary\n{result}"
    assert saved_step(tmp_path) == step
    assert_resumes_to_the_uninterrupted_end(tmp_path, step, 3, uninterrupted)


@pytest.mark.parametrize("handled", [True, False], ids=["signals-to-handle", "default"])
def test_sigusr1_to_torchrun(tmp_path, uninterrupted, handled):
    """With --signals-to-handle=...,SIGUSR1 torchrun forwards it as it does SIGTERM. Without, the
    signal's default action ends torchrun at once (code -10) and its workers, each in a session of
    its own, run on unsupervised to the end: under Slurm the step would then be killed."""
    flags = ["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"] if handled else []
    command = torchrun_command(LESSON, 2, [*STEPS, "--out", tmp_path])
    command[3:3] = flags  # torchrun's own flags, before the script
    job = Job(command)
    mid_run(job)
    job.proc.send_signal(signal.SIGUSR1)
    result = job.finish()
    if handled:
        step = stopped(result, "SIGUSR1")
        assert result.returncode == 1 and "got signal: 10" in result.stderr, str(result)
        assert_resumes_to_the_uninterrupted_end(tmp_path, step, 2, uninterrupted)
    else:
        assert result.returncode == -signal.SIGUSR1, str(result)
        assert not STOPPED.search(result.stdout), str(result)
        assert "OK: 40 steps on 2 rank(s)" in result.stdout, f"the workers ran on\n{result}"


def test_sigterm_reaches_the_ranks_in_different_steps(tmp_path, uninterrupted):
    """python --nproc 3: each rank is signalled 0.12 s (about two steps) after the one before;
    they stop together after the first agreement that sees the first signal; the launcher passes
    the 75 on. The later signals land while the ranks save or exit, or find a rank already gone
    (CI, 2026-11-28: ProcessLookupError for the third): only the first must find its rank."""
    job = Job([sys.executable, LESSON, "--nproc", "3", *STEPS, "--out", tmp_path])
    mid_run(job)
    servers = job.children(job.proc.pid)  # the forkserver and the resource tracker
    ranks = [pid for server in servers for pid in job.children(server)]
    assert len(ranks) == 3, (servers, ranks)
    os.kill(ranks[0], signal.SIGTERM)
    for pid in ranks[1:]:
        time.sleep(0.12)
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass  # this rank has stopped already: the agreement told it
    result = job.finish()
    step = stopped(result, "SIGTERM")
    assert result.returncode == 75, f"python --nproc passes the ranks' code on\n{result}"
    assert saved_step(tmp_path) == step
    assert_resumes_to_the_uninterrupted_end(tmp_path, step, 3, uninterrupted)


@pytest.mark.quick
def test_the_lesson_s_own_lever_one_rank_signalled(tmp_path, uninterrupted):
    """--preempt-at 7: rank 2 sends itself SIGUSR1 in step 7 (index), before that step's
    agreement: all three stop after step 8."""
    result = run_lesson(LESSON, *STEPS, "--preempt-at", "7", "--out", tmp_path, nproc=3,
                        launcher="python", timeout=T)  # fmt: skip
    assert stopped(result, "SIGUSR1") == 8 and result.returncode == 75, str(result)
    assert_resumes_to_the_uninterrupted_end(tmp_path, 8, 3, uninterrupted)


# ------------------------------------------------------------------------------ during a save


def interrupted(lesson, out, mode, nth, nproc=2, args=()):
    """The lesson (or a copy) under tests/save_interrupter.py, through the warm launcher."""
    argv = [str(lesson), mode, str(nth), *STEPS, "--out", str(out), *args]
    command, code, stdout, stderr, timed_out, codes = warm_launcher.run(
        str(INTERRUPTER), argv, nproc, lesson_env(), str(ROOT), T
    )
    return Result(command, code, stdout, stderr, timed_out, codes)


def test_a_signal_during_a_save_loses_nothing(tmp_path, uninterrupted):
    """SIGTERM reaches rank 0 inside the save of step 10: the save completes, the ranks stop after
    that step, and the checkpoint holds it."""
    result = interrupted(ROOT / LESSON, tmp_path, "signal", 1)
    assert stopped(result, "SIGTERM") == 10 and result.rank_codes == [75, 75], str(result)
    assert saved_step(tmp_path) == 10
    assert_resumes_to_the_uninterrupted_end(tmp_path, 10, 2, uninterrupted)


def test_a_handler_that_exits_at_once_loses_the_save(tmp_path):
    """The handler a reader writes first, sys.exit in the handler: the exit lands inside the save,
    which never completes. The ranks may well exit 75 ("resume me"), with nothing to resume from."""
    copy = mutant(tmp_path, LESSON, ("self.received = self.received or number", "sys.exit(75)"))
    result = interrupted(copy, tmp_path / "out", "signal", 1, args=("--timeout", "10"))
    assert not result.timed_out and result.returncode != 0, str(result)
    assert not STOPPED.search(result.stdout), str(result)
    assert not (tmp_path / "out" / "checkpoint.pt").exists(), f"the save completed\n{result}"


def test_a_kill_mid_save_leaves_the_previous_checkpoint(tmp_path, uninterrupted):
    """Rank 0 is SIGKILLed with the save of step 20 half written: the checkpoint of step 10 is
    intact, and the resume from it still ends where an uninterrupted run ends."""
    result = interrupted(ROOT / LESSON, tmp_path, "kill", 2)
    assert result.rank_codes[0] == -signal.SIGKILL and not result.timed_out, str(result)
    assert saved_step(tmp_path) == 10
    assert_resumes_to_the_uninterrupted_end(tmp_path, 10, 2, uninterrupted)


def test_without_the_rename_a_kill_mid_save_loses_the_checkpoint(tmp_path):
    """torch.save straight to checkpoint.pt: the kill leaves it torn, and the resume refuses it in
    one line per rank that names it."""
    save = 'torch.save({**state, "step": step, "world_size": ctx.world_size}, f"{path}.tmp")'
    copy = mutant(
        tmp_path,
        LESSON,
        (save, save.replace('f"{path}.tmp"', "path")),
        ('        os.replace(f"{path}.tmp", path)\n', ""),
    )
    out = tmp_path / "out"
    assert interrupted(copy, out, "kill", 2).rank_codes[0] == -signal.SIGKILL
    result = run_lesson(copy, *STEPS, "--out", out, "--resume", nproc=2, launcher="warm",
                        timeout=T)  # fmt: skip
    assert_fails(result, f"error: --resume: {out}/checkpoint.pt is not a checkpoint", within=2)
    assert "Traceback" not in result.output, str(result)


# ----------------------------------------------------------------------- resumes it must refuse


@pytest.mark.parametrize("how", ["empty", "truncated"])
def test_a_damaged_checkpoint_is_refused_in_one_line(tmp_path, how):
    result = run_lesson(LESSON, "--steps", "2", "--step-time", "0", "--out", tmp_path, nproc=2,
                        launcher="warm", timeout=T)  # fmt: skip
    assert_ok(result)
    path = tmp_path / "checkpoint.pt"
    data = path.read_bytes()
    path.write_bytes(b"" if how == "empty" else data[: len(data) // 2])
    before = path.read_bytes()
    result = run_lesson(LESSON, "--steps", "4", "--out", tmp_path, "--resume", nproc=2,
                        launcher="warm", timeout=T)  # fmt: skip
    assert_fails(result, f"error: --resume: {path} is not a checkpoint of this lesson", within=2)
    assert "Traceback" not in result.output and path.read_bytes() == before, str(result)


def test_a_resume_at_another_world_size_is_refused(tmp_path):
    result = run_lesson(LESSON, "--steps", "2", "--step-time", "0", "--out", tmp_path, nproc=2,
                        launcher="warm", timeout=T)  # fmt: skip
    assert_ok(result)
    result = run_lesson(LESSON, "--steps", "4", "--out", tmp_path, "--resume", nproc=3,
                        launcher="warm", timeout=T)  # fmt: skip
    assert_fails(result, "was written by 2 ranks: resume at 2", within=3)


# ------------------------------------------------------ the checks fail when the lesson is wrong


def test_a_stop_not_agreed_leaves_the_others_in_a_collective(tmp_path):
    """Each rank stops on its own signal: rank 1 goes to save (its barrier) while rank 0 goes on
    to the next step's all_reduce. No check can catch it, since the ranks no longer run the same
    collectives: both wait until the collective timeout (--timeout 10 here, 60 s by default;
    NCCL's watchdog likewise), then fail; no rank exits 75, nothing after the last save is kept."""
    copy = mutant(
        tmp_path, LESSON, ("received = stop.agreed(ctx.device)", "received = stop.received")
    )
    result = run_lesson(copy, *STEPS, "--preempt-at", "5", "--out", tmp_path / "out",
                        "--timeout", "10", nproc=2, launcher="warm", timeout=T)  # fmt: skip
    assert not result.timed_out and 75 not in result.rank_codes, str(result)
    assert "Timed out waiting 10000ms" in result.stderr, str(result)
    assert not STOPPED.search(result.stdout), str(result)  # rank 0 never saw a signal


def test_a_resume_without_the_momentum_fails_the_check(tmp_path):
    result = run_lesson(LESSON, *STEPS, "--preempt-at", "9", "--out", tmp_path, nproc=2,
                        launcher="warm", timeout=T)  # fmt: skip
    assert stopped(result) == 10
    copy = mutant(tmp_path, LESSON, ("        optimizer.load_state_dict(state", "        (state"))
    result = run_lesson(copy, *STEPS, "--out", tmp_path, "--resume", nproc=2, launcher="warm",
                        timeout=T)  # fmt: skip
    assert_fails(result, "the weights differ from the one-process replay")
