"""Every primitives/ lesson of issue 3, run the way a user runs it, at world sizes 2, 3 and 4 (odd
sizes break naive code); and the bad starts that must fail cleanly.

Launchers (issue 33): all_reduce.py, the folder's first lesson on the core path, runs under real
torchrun at 2 and 4 ranks, the reader's command, and through the warm launcher at 3; every other
lesson runs once as `python lesson.py --nproc 2` (the lesson spawns its ranks itself) and at 3 and
4 ranks through the warm launcher (tests/warm_launcher.py: torchrun's environment for each rank,
ranks forked from a process that has imported torch). What a lesson does wrong is shown by the
mutations of tests/test_mutations.py, not by flags."""

import re

import pytest

from harness import assert_fails, assert_ok, run_lesson

TIMEOUT = 240  # the CI machine is small and shared: a launch takes seconds, a hang is caught

# lesson -> {world size: extra arguments}; sizes not listed run with the defaults.
LESSONS = {
    "point_to_point.py": {},
    "deadlock.py": {},
    "async_point_to_point.py": {},
    "ring_exchange.py": {4: ["--size", "1"]},
    "broadcast.py": {3: ["--src", "2"]},
    "reduce.py": {4: ["--dst", "3"]},
    "all_reduce.py": {},
    "gather.py": {3: ["--dst", "1"]},
    "all_gather.py": {},
    "scatter.py": {4: ["--src", "3"]},
    "reduce_scatter.py": {},
    "all_to_all.py": {},
    "barrier.py": {},
    "async_collectives.py": {},
    "object_collectives.py": {},
    "process_groups.py": {},
    "device_mesh.py": {4: ["--tp", "4"]},
    "stores.py": {},
    "distributed_softmax.py": {3: ["--size", "7"]},
}
REAL_TORCHRUN = {"all_reduce.py": (2, 4)}  # lesson -> the world sizes it runs under torchrun
PYTHON_NPROC = 2  # the spawn path is the same code at every size: the cheapest one shows it works
# Each lesson at each world size its python run does not cover: real torchrun where REAL_TORCHRUN
# says so, else the warm launcher (quick: the warm run at 3 ranks, every lesson once).
CASES = [
    pytest.param(
        name, n, launcher, id=f"{name}-np{n}-{launcher}", marks=[pytest.mark.quick] * (n == 3)
    )
    for name in LESSONS
    for n in (2, 3, 4)
    for launcher in ["torchrun" if n in REAL_TORCHRUN.get(name, ()) else "warm"]
    if launcher == "torchrun" or n != PYTHON_NPROC
]


def check_output(name, nproc, result, ok):
    """Figures from the output that must hold, beyond the lesson's own checks."""
    out = result.stdout
    if name == "deadlock.py":
        # every rank's send-first attempt ended by the short timeout, not by luck or a hang
        assert f"deadlocked {nproc} of {nproc} ranks" in ok, ok
        waits = [float(w) for w in re.findall(r"first, then recv: after ([\d.]+)s", out)]
        assert len(waits) == nproc and max(waits) < 30, out
    elif name == "all_reduce.py":
        assert all(
            op in ok for op in ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"]
        ), ok
        # the public ReduceOp.PREMUL_SUM(factor) is built and refused by Gloo itself, not skipped
        assert "PREMUL_SUM: gloo refuses it (Cannot use ReduceOp.PREMUL_SUM with Gloo)" in out, out
    elif name == "async_collectives.py":
        # torch 2.13: Gloo's Work keeps the base Work::getFutureResult, which raises (Work.cpp)
        lines = [line for line in out.splitlines() if line.startswith("get_future_result()")]
        assert lines == [
            "get_future_result(): not supported on gloo (Work::getFutureResult not "
            "implemented.); NCCL gives a status code"
        ], out
    elif name == "device_mesh.py":
        dp, tp = map(int, re.search(r"(\d+) x (\d+) mesh", ok).groups())
        assert dp * tp == nproc, ok
    elif name == "object_collectives.py":
        assert float(re.search(r"took ([\d.]+)x the tensor one", ok).group(1)) > 0, ok
    elif name == "stores.py":
        assert re.search(rf"add\(\) counted {nproc} arrivals", ok), ok
    # before/after lines come from every rank, in rank order
    ranks = [int(r) for r in re.findall(r"^\[rank (\d+)\]", out, re.M)]
    assert set(ranks) == set(range(nproc)), out


@pytest.mark.parametrize("name,nproc,launcher", CASES)
def test_lesson_at_each_world_size(name, nproc, launcher):
    extra = LESSONS[name].get(nproc, [])
    result = run_lesson(
        f"primitives/{name}", *extra, nproc=nproc, launcher=launcher, timeout=TIMEOUT
    )
    check_output(name, nproc, result, assert_ok(result))


@pytest.mark.parametrize("name", list(LESSONS))
def test_lesson_with_plain_python(name):
    nproc = PYTHON_NPROC
    extra = LESSONS[name].get(nproc, [])
    result = run_lesson(
        f"primitives/{name}", *extra, nproc=nproc, launcher="python", timeout=TIMEOUT
    )
    check_output(name, nproc, result, assert_ok(result))


def test_one_rank_is_refused_where_a_peer_is_needed():
    result = run_lesson("primitives/point_to_point.py", nproc=1, launcher="warm", timeout=TIMEOUT)
    assert_fails(result, "needs at least 2 ranks", within=1)


def test_mesh_that_does_not_factor_is_a_one_line_error_on_every_rank():
    result = run_lesson(
        "primitives/device_mesh.py", "--tp", "2", nproc=3, launcher="warm", timeout=TIMEOUT
    )
    # (not within=3: the launcher may stop the other ranks before they print their line)
    assert_fails(result, "--tp 2 does not divide the world size 3")
    assert "Traceback" not in result.output, result


def test_broadcast_from_a_rank_that_does_not_exist_fails_cleanly():
    result = run_lesson(
        "primitives/broadcast.py", "--src", "2", nproc=2, launcher="warm", timeout=TIMEOUT
    )
    assert_fails(result, "--src 2 is not a rank of a 2-rank world")
