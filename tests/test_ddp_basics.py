"""The data-parallel lessons of ddp_basics/ (issue 5, first half): manual_data_parallel, ddp_minimal
and ddp_checkpoint at 1 to 3 ranks, with their figures checked; fault tolerance: a rank that dies is
restarted by torchrun and the job ends with the parameters of a run that never failed, while without
restarts the job ends within seconds; a checkpoint that does not fit the job is one line.

Launchers (issue 33): ddp_minimal, the folder's first lesson on the core path, under real torchrun
at 2 and 3 ranks; every other lesson once as `python lesson.py --nproc N` and at its other world
sizes through the warm launcher. Real torchrun also for the two fault-tolerance tests: what they
assert (restarts with --max-restarts, the agent stopping the other ranks) is torchrun's own.
The checks failing when a lesson is wrong: tests/test_mutations.py (DDP_BASICS)."""

import re
import sys
import time

import pytest
import torch

from harness import ROOT, assert_fails, assert_ok, run_command, run_lesson

TIMEOUT = 240  # the CI machine is small and shared: a launch takes seconds, a hang is caught
CHECKPOINT = "ddp_basics/ddp_checkpoint.py"
FINAL = re.compile(
    r"final params: float64 sum (\S+), sha256 (\w+); max \|resumed - uninterrupted\| (\S+)"
)


def check_manual(out, nproc):
    diffs = re.findall(
        r"^\[rank (\d)\] (.+?): sum of params (\S+), max \|param - single process\| (\S+)$",
        out,
        re.M,
    )
    assert len(diffs) == nproc and len({d[1] for d in diffs}) == 1, out  # one op (--op), every rank
    assert all(float(d[3]) <= 1e-5 for d in diffs), out
    assert len({d[2] for d in diffs}) == 1, out  # the same params on every rank
    spreads = re.findall(
        r"spread across ranks before broadcast (\S+), after \d+ epochs (\S+)$", out, re.M
    )
    assert len(spreads) == 1 and all(float(after) == 0.0 for _, after in spreads), out
    # the ranks started apart
    assert all((float(before) > 0) == (nproc > 1) for before, _ in spreads), out


def check_minimal(out, nproc):
    sampler = re.search(
        r"without set_epoch epoch 1 repeats epoch 0's order: (\w+); "
        r"with set_epoch\(1\) (\d+)% of positions change",
        out,
    )
    assert sampler and sampler.group(1) == "True" and int(sampler.group(2)) >= 90, out
    metrics = re.findall(
        r"^\[rank \d\] held-out accuracy ([\d.]+) \((\d+)/(\d+), all_reduced\), "
        r"loss (\S+); sum of params (\S+)$",
        out,
        re.M,
    )
    assert len(metrics) == nproc and len(set(metrics)) == 1, out  # the same metric and params
    assert float(metrics[0][0]) > 0.35 and int(metrics[0][2]) == 1000, out  # chance is 0.25
    match = re.search(
        r"max \|param - single process\| (\S+) \(tolerance (\S+)\); "
        r"spread across ranks: params (\S+), metric (\S+);",
        out,
    )
    assert match and float(match.group(1)) <= float(match.group(2)), out
    assert float(match.group(3)) == 0.0 and float(match.group(4)) == 0.0, out


def check_checkpoint(out, nproc):
    assert "loaded model, optimizer, scheduler, epoch, step, sampler_seed, world_size, rng" in out
    final = FINAL.search(out)
    assert final and float(final.group(3)) == 0.0, out


CHECKS = {
    "manual_data_parallel.py": check_manual,
    "ddp_minimal.py": check_minimal,
    "ddp_checkpoint.py": check_checkpoint,
}
QUICK = [pytest.mark.quick]
RUNS = [  # (name, ranks, launcher); ddp_checkpoint's python run is the fixture below
    ("ddp_minimal.py", 2, "torchrun"),
    pytest.param("ddp_minimal.py", 3, "torchrun", marks=QUICK),
    ("manual_data_parallel.py", 2, "python"),
    pytest.param("manual_data_parallel.py", 3, "warm", marks=QUICK),
    ("manual_data_parallel.py", 1, "warm"),
    pytest.param("ddp_checkpoint.py", 3, "warm", marks=QUICK),
]


@pytest.mark.parametrize("name,nproc,launcher", RUNS)
def test_lesson(name, nproc, launcher, tmp_path):
    args = {
        "ddp_checkpoint.py": ("--out", tmp_path),
        "ddp_minimal.py": ("--show-eval-hang", "--hang-timeout", "1") * (nproc == 2),
        "manual_data_parallel.py": ("--op", "avg") * (nproc == 3),
    }  # SUM then /N at 1 and 2 ranks, AVG at 3
    result = run_lesson(
        f"ddp_basics/{name}", *args.get(name, ()), nproc=nproc, launcher=launcher, timeout=TIMEOUT
    )
    assert_ok(result)
    CHECKS[name](result.stdout, nproc)
    if name == "manual_data_parallel.py":
        assert ("AVG:" if nproc == 3 else "SUM then /N:") in result.stdout, result
    if name == "ddp_minimal.py" and nproc == 2:  # the reader's pitfall, --show-eval-hang
        assert (
            "evaluation on rank 0 only: its all_reduce waited for ranks that never came"
            in result.stdout
        ), result


@pytest.fixture(scope="session")  # session, not module: kept while the worker runs other modules
def checkpoint_2_ranks(tmp_path_factory):
    """ddp_checkpoint's default demonstration at 2 ranks, its `python lesson.py` run, made once for
    the tests that compare with it or resume from its checkpoint."""
    out = tmp_path_factory.mktemp("ddp_checkpoint")
    return run_lesson(CHECKPOINT, "--out", out, nproc=2, launcher="python", timeout=TIMEOUT), out


def test_checkpoint_resume_is_exact(checkpoint_2_ranks):
    result, out = checkpoint_2_ranks
    assert_ok(result)
    check_checkpoint(result.stdout, 2)
    assert [p.name for p in out.iterdir()] == ["ddp_checkpoint.pt"], (
        "the temporary file must be renamed away"
    )
    ckpt = torch.load(out / "ddp_checkpoint.pt", weights_only=True)  # plain tensors and data only
    # the resumed run saves too: last after epoch 3
    assert (ckpt["epoch"], ckpt["step"], ckpt["world_size"]) == (3, 0, 2)
    assert ckpt["rng"]["cpu"].shape == (2, torch.get_rng_state().numel())  # one RNG state per rank
    assert not torch.equal(ckpt["rng"]["cpu"][0], ckpt["rng"]["cpu"][1])


MISFITS = {  # how the checkpoint in --out misfits: (what is there, flags, ranks, the one line)
    "not-a-checkpoint": (b"not a checkpoint\n", (), 2, "is not a checkpoint: torch.load fails"),
    "another-width": (None, ("--width", "16"), 2, "holds another model than --width 16"),
    "another-world-size": (None, (), 1, "was written by 2 ranks, not 1"),
}


@pytest.mark.parametrize("case", MISFITS)
def test_a_checkpoint_that_does_not_fit_is_one_line(case, checkpoint_2_ranks, tmp_path):
    """Job mode resumes from what --out holds: a file that is not a checkpoint, or one of a model
    of another width or of another world size (the demonstration's, 2 ranks, width 32), stops
    every rank with one line naming the file and what differs, before any training."""
    content, flags, nproc, message = MISFITS[case]
    path = tmp_path / "ddp_checkpoint.pt"
    path.write_bytes(content or (checkpoint_2_ranks[1] / "ddp_checkpoint.pt").read_bytes())
    result = run_lesson(
        CHECKPOINT,
        *("--out", tmp_path, "--save-every", "4", *flags),
        nproc=nproc,
        launcher="warm",
        timeout=TIMEOUT,
    )
    assert_fails(result, f"error: {path} {message}", within=nproc)
    assert "Traceback" not in result.output, result


def fault_command(out, *torchrun_args):
    """--standalone: the c10d rendezvous on a free port, which restarts need (see the lesson)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        *torchrun_args,
        ROOT / CHECKPOINT,
        "--out",
        out,
        "--save-every",
        "4",
        "--fail-at-step",
        "10",
    ]


def test_restart_resumes_and_matches_uninterrupted_run(tmp_path, checkpoint_2_ranks):
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # pytorch#135712
    result = run_command(fault_command(tmp_path, "--max-restarts=1"), timeout=TIMEOUT, env=env)
    assert_ok(result)
    out = result.stdout
    # the last rank, once
    assert out.count("dying at step 10") == 1 and "[rank 1] dying" in out, result
    assert "attempt 0: no checkpoint" in out, result
    # from the last save
    assert re.search(r"attempt 1: resumed from \S+ at epoch 0 step 8$", out, re.M), result
    restarted, never_failed = FINAL.search(out), FINAL.search(checkpoint_2_ranks[0].stdout)
    assert restarted and never_failed, result
    assert restarted.group(1, 2) == never_failed.group(1, 2), (
        restarted.group(0),
        never_failed.group(0),
    )


def test_without_restarts_the_job_ends_within_seconds(tmp_path):
    result = run_command(fault_command(tmp_path), timeout=TIMEOUT)
    ended = time.time()
    assert_fails(result, "dying at step 10")
    died = re.search(r"dying at step 10 \(--fail-at-step\) at unix time ([\d.]+)", result.stdout)
    assert died, result
    assert ended - float(died.group(1)) < 30, (
        f"rank 0 outlived the dead rank by {ended - float(died.group(1)):.0f} s"
    )
