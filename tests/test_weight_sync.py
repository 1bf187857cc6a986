"""weight_sync.py (one job, a sync subgroup) and weight_sync_two_jobs.py (a trainer job and an
inference job, launched separately, that meet through a TCPStore). `python lesson.py` and the warm
launcher only: nothing here depends on torchrun itself (each job's launcher gives it its own default
group and MASTER_PORT either way)."""

import re
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
from harness import assert_fails, assert_ok, free_port, mutant, run_lesson

T = 240  # seconds: generous, the CI machine is shared
TWO = "primitives/weight_sync_two_jobs.py"


# weight_sync.py: trainer ranks 0..T-1, only rank 0 of them in the sync group, bit for bit after
# every step.
@pytest.mark.parametrize(
    "nproc,trainers,launcher",
    [(2, 1, "python"), (3, 1, "warm"), pytest.param(4, 2, "warm", marks=pytest.mark.quick)],
)
def test_weight_sync(nproc, trainers, launcher):
    result = run_lesson(
        "primitives/weight_sync.py",
        "--steps",
        "2",
        "--trainers",
        str(trainers),
        nproc=nproc,
        launcher=launcher,
        timeout=T,
    )
    line = assert_ok(result)
    assert "bit for bit" in line
    assert (
        f"-> {nproc - trainers} worker(s) (ranks {trainers}..{nproc - 1}); {trainers - 1} trainer "
        "rank(s) outside the group" in result.stdout
    )
    outside = re.findall(r"\[rank (\d+)\] trainer rank outside the sync group", result.stdout)
    assert sorted(map(int, outside)) == list(range(1, trainers)), result.stdout
    per = re.search(
        r"per-parameter broadcast:\s+([\d.]+) ms per sync \((\d+) calls\)", result.stdout
    )
    buck = re.search(r"bucketed broadcast:\s+([\d.]+) ms per sync \((\d+) calls\)", result.stdout)
    speedup = re.search(r"speed-up of bucketed over per-parameter: ([\d.]+)x", result.stdout)
    assert per and buck and speedup, result.stdout
    assert int(buck.group(2)) < int(per.group(2))  # fewer calls: that is the point of buckets
    assert float(speedup.group(1)) == pytest.approx(
        float(per.group(1)) / float(buck.group(1)), rel=0.02
    )


def test_weight_sync_needs_a_worker():
    assert_fails(
        run_lesson("primitives/weight_sync.py", nproc=1, launcher="warm", timeout=T),
        "needs at least 2 ranks (a trainer and a worker)",
        within=1,
    )
    assert_fails(
        run_lesson(
            "primitives/weight_sync.py", "--trainers", "3", nproc=3, launcher="warm", timeout=T
        ),
        "--trainers must be from 1 to 2: at least one rank must be a worker",
        within=3,
    )


def two_jobs(
    trainers,
    inference,
    launchers=("python", "python"),
    trainer_args=(),
    inference_args=(),
    envs=(None, None),
    timeout=T,
    trainer_lesson=TWO,
):
    """Start the trainer job and the inference job at the same time, as two users would in two
    terminals; return both results. Each job has its own launcher and MASTER_PORT; they share only
    --sync-port. At most one of the two may be "warm": the warm launcher runs one job at a time (a
    second would wait for the first, which waits for it)."""
    assert list(launchers).count("warm") <= 1
    common = ("--sync-port", str(free_port()), "--timeout", "60")
    lessons = {"trainer": trainer_lesson, "inference": TWO}
    with ThreadPoolExecutor(2) as pool:
        jobs = [
            pool.submit(
                run_lesson,
                lessons[role],
                "--role",
                role,
                *common,
                *extra,
                nproc=nproc,
                launcher=launcher,
                env=env,
                timeout=timeout,
            )
            for role, nproc, launcher, extra, env in [
                ("trainer", trainers, launchers[0], trainer_args, envs[0]),
                ("inference", inference, launchers[1], inference_args, envs[1]),
            ]
        ]
        return [job.result() for job in jobs]


# The sizes: 1 trainer + 2 and + 3 inference ranks; then an FSDP trainer of 2 ranks (the
# sharded case). Each role runs as python --nproc and under the warm launcher (at most one warm job
# at a time).
@pytest.mark.parametrize(
    "trainers,inference,launchers",
    [
        pytest.param(1, 2, ("python", "warm"), marks=pytest.mark.quick),
        (1, 3, ("python", "python")),
        (2, 2, ("warm", "python")),
    ],
)
def test_two_jobs_stream_weights_bit_for_bit(trainers, inference, launchers):
    trainer, engine = two_jobs(trainers, inference, launchers, ("--layers", "3"), ("--layers", "3"))
    line = assert_ok(trainer)
    assert f"from {trainers} FSDP rank(s); all {inference} inference rank(s) confirmed" in line, (
        trainer.stdout
    )
    assert f"-> {inference} inference rank(s)" in trainer.stdout
    assert f"inference job, {inference} rank(s)" in assert_ok(engine)
    checked = re.findall(
        r"\[rank (\d+)\] weights after step 2: equal to the replica, bit for bit", engine.stdout
    )
    assert sorted(map(int, checked)) == list(range(inference)), engine.stdout


def test_two_jobs_check_fails_when_the_trainer_syncs_before_its_step(tmp_path):
    """A mutation, as in tests/test_mutations.py, here because it takes two jobs: the trainer
    streams its weights before its optimizer step instead of after (the inference engine serves the
    previous step's weights). Each inference rank catches it at step 0, and the trainer learns it
    through the store."""
    wrong = mutant(
        tmp_path,
        TWO,
        ("if trainer:\n            train_step(model, step)\n        check.before", "check.before"),
        (
            "        check.after_sync(model, step)\n",
            "        check.after_sync(model, step)\n"
            "        if trainer:\n            train_step(model, step)\n",
        ),
    )
    trainer, engine = two_jobs(1, 2, ("warm", "python"), trainer_lesson=wrong)
    assert_fails(engine, "after the two-job sync at step 0 a parameter of shape")
    assert_fails(trainer, "2 inference rank(s) report a mismatch")


def test_two_jobs_refuse_different_models_on_every_rank():
    trainer, engine = two_jobs(
        2,
        2,
        trainer_args=("--layers", "2"),
        inference_args=("--width", "32"),
        launchers=("python", "warm"),
    )
    assert_fails(
        trainer,
        "the two jobs differ: trainer has 8 tensors of 8576 elements (float32), 1 MiB, gloo",
        within=2,
    )
    assert_fails(engine, "the two jobs differ: inference has 32 tensors", within=2)


def test_two_jobs_give_up_in_one_line_when_the_other_never_comes():
    port = str(free_port())
    trainer = run_lesson(
        TWO,
        "--role",
        "trainer",
        "--sync-port",
        port,
        "--timeout",
        "3",
        nproc=2,
        launcher="warm",
        timeout=T,
    )
    assert_fails(trainer, "no inference job joined on 127.0.0.1:", within=2)
    engine = run_lesson(
        TWO,
        "--role",
        "inference",
        "--sync-port",
        port,
        "--timeout",
        "3",
        nproc=2,
        launcher="warm",
        timeout=T,
    )
    assert_fails(engine, "no trainer listened on 127.0.0.1:", within=2)


def test_two_jobs_trainer_refuses_a_taken_port():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        result = run_lesson(
            TWO,
            "--role",
            "trainer",
            "--sync-port",
            port,
            "--timeout",
            "5",
            nproc=1,
            launcher="warm",
            timeout=T,
        )
    assert_fails(result, f"cannot listen on 127.0.0.1:{port}", within=1)
    # --sync-port 0 or 70000: refused by argparse (tests/test_flags.py)
