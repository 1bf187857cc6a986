"""primitives/flight_recorder.py: each fault's culprit and collective are found in the ranks' flight
records, by the lesson's own reading and by torch's analyzer, at 2, 3 and 4 ranks.

The mistakes that the check must catch (the wrong rank singled out, the fault made on another rank
than the lesson thinks, --culprit ignored) are rows of tests/test_mutations.py. What cannot work is
refused in one line on every rank: a culprit outside the world, --steps 1 for the skip fault (its
culprit records no collective), a hang longer than half the default group's timeout (the barrier
between two jobs waits it out).
"""

import textwrap

import pytest

from harness import ROOT, assert_fails, assert_ok, run_lesson

LESSON = "primitives/flight_recorder.py"
T = 240  # three 3 s hangs, one analyzer run, under the suite's load


@pytest.mark.parametrize(
    "nproc, launcher, args",
    [
        pytest.param(2, "python", [], marks=pytest.mark.quick),
        (3, "warm", []),
        (4, "warm", ["--culprit", "1"]),
    ],
)
def test_every_fault_names_its_culprit(nproc, launcher, args):
    result = run_lesson(LESSON, *args, nproc=nproc, launcher=launcher, timeout=T)
    culprit = args[1] if args else str(nproc - 1)
    assert assert_ok(result).startswith(f"OK: the flight record names the culprit, rank {culprit}")
    for fault in ("skip", "order", "size"):
        assert f"[{fault}] last collective per rank" in result.stdout, result
    assert "Not all ranks joining collective, sequence number: 5" in result.stdout, result


def test_a_culprit_outside_the_world_is_one_line():
    result = run_lesson(LESSON, "--culprit", "3", nproc=2, launcher="warm", timeout=60)
    assert_fails(result, "--culprit must be a rank below 2", within=2)


@pytest.mark.parametrize(
    "args, message",
    [
        (("--steps", "1"), "--steps 1 with --fault all: skip needs --steps 2 or more"),
        (("--hang-timeout", "40"), "--hang-timeout 40: at most half of --timeout 60"),
    ],
)
def test_what_cannot_work_is_refused_in_one_line(args, message):
    result = run_lesson(LESSON, *args, nproc=2, launcher="warm", timeout=60)
    assert_fails(result, message, within=2)
    assert "Traceback" not in result.output, result


# The lesson under a default group that says it is NCCL (as on a GPU node, where dist_setup picks
# NCCL when every rank has a GPU; no NCCL on a CPU machine, so the context says it): it must not
# refuse, and every job group it makes must be a Gloo group.
AS_ON_A_GPU_NODE = """
    import dataclasses, runpy, sys
    import torch.distributed as dist
    import launch.dist_setup as setup

    real_new_group, real_run = dist.new_group, setup.run

    def new_group(*args, **kwargs):
        if kwargs.get("backend") != "gloo":
            sys.exit(f"a job group on the default group's backend: new_group({kwargs})")
        return real_new_group(*args, **kwargs)

    def run(main, args):
        return real_run(lambda a, ctx: main(a, dataclasses.replace(ctx, backend="nccl")), args)

    dist.new_group, setup.run = new_group, run
    sys.argv = [LESSON, *sys.argv[1:]]
    runpy.run_path(LESSON, run_name="__main__")
"""


def test_job_groups_are_gloo_whatever_the_default_group(tmp_path):
    """`torchrun --nproc_per_node=3 primitives/flight_recorder.py`, the README's first answer to
    "my job hangs", picks NCCL on a node with a GPU per rank: the lesson runs all the same."""
    wrapper = tmp_path / "as_on_a_gpu_node.py"
    wrapper.write_text(
        textwrap.dedent(AS_ON_A_GPU_NODE).replace("LESSON", repr(str(ROOT / LESSON)))
    )
    result = run_lesson(wrapper, "--fault", "order", nproc=3, launcher="warm", timeout=T)
    assert assert_ok(result).startswith("OK: the flight record names the culprit, rank 2")
    assert "[order] odd rank(s) out [2]" in result.stdout, result
