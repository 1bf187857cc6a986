"""The fundamentals the source material teaches that issue 31 found missing, each where it lives:

- pg_options and the Backend enum: primitives/process_groups.py (its own tests run it) and the
  `python -c` command of primitives/README.md ("pg_options and the Backend enum"), run here;
- blocking wait against async error handling, what Gloo does on a timeout, a background error at
  wait() and operations in flight: primitives/async_errors.py;
- the mesh in DTensor calls and the mismatched-shape hang: primitives/device_mesh.py.

Each check is shown failing by a source mutation of a copy (harness.mutant).
"""

import re
import shlex
import subprocess
import sys

from harness import ROOT, assert_fails, assert_ok, lesson_env, mutant, run_lesson

TIMEOUT = 240  # a shared 2-core machine: a launch takes seconds, a hang is caught
ASYNC = "primitives/async_errors.py"
MESH = "primitives/device_mesh.py"


# ------------------------------------------------------------------------------ async_errors.py


def test_async_error_surfaces_at_wait_and_in_flight_table_at_2_ranks():
    result = run_lesson(ASYNC, nproc=2, launcher="python", timeout=TIMEOUT)
    line = assert_ok(result)
    assert "failed in wait(), not in the call; 4 batches" in line, line
    assert "summed to 3 everywhere" in line, line  # 1 + 2: each rank sends its rank + 1
    # rank 0 waited for a collective rank 1 never joined: Gloo's timeout, raised by wait()
    failure = re.search(
        r"^\[rank 0\] all_reduce\(async_op=True\) returned a Work in .*$", result.stdout, re.M
    )
    assert failure and "wait() raised" in failure.group(0) and "Timed out" in failure.group(0), (
        result
    )
    assert "[rank 1] stayed away" in result.stdout, result
    for rank in (0, 1):
        rows = re.findall(rf"^\[rank {rank}\] +(\d+) +[\d.]+ MB", result.stdout, re.M)
        assert rows == ["1", "10", "100", "1000"], result
    # tensors held: n * 1024 floats * 4 bytes, printed in MB
    assert re.search(r"^\[rank 0\] +1000 +3\.91 MB", result.stdout, re.M), result


def test_async_error_at_3_ranks_every_waiting_rank_sees_it():
    result = run_lesson(
        ASYNC, "--in-flight", "1,20", "--fail-after", "1", nproc=3, launcher="warm", timeout=TIMEOUT
    )
    assert_ok(result)
    for rank in (0, 1):
        assert re.search(
            rf"^\[rank {rank}\] all_reduce\(async_op=True\) returned", result.stdout, re.M
        )
    assert "[rank 2] stayed away" in result.stdout, result


def test_async_errors_refuses_a_fail_after_the_world_timeout_cannot_wait_for():
    """The last rank waits in a barrier on the world group while the others wait --fail-after: a
    world --timeout under twice that is refused in one line, not a Gloo timeout in the barrier."""
    result = run_lesson(
        ASYNC, "--fail-after", "4", "--timeout", "3", nproc=2, launcher="warm", timeout=TIMEOUT
    )
    assert_fails(result, "needs --fail-after <= --timeout / 2", within=2)
    assert "Traceback" not in result.output, result


def test_async_errors_checks_fail_when_the_lesson_is_wrong(tmp_path):
    """Three mistakes: the try around a blocking call (the error then comes from the call); every
    rank joins (nothing fails, so nothing was shown); all N operations on one tensor."""
    cases = [
        (
            ("dist.all_reduce(t, group=short, async_op=True)", "dist.all_reduce(t, group=short)"),
            "the all_reduce call itself raised, not wait()",
        ),
        (
            ("    if rank != world - 1 and gloo:\n", "    if gloo:\n"),
            "wait() returned without an error, though a rank never joined",
        ),
        (
            (
                "works = [dist.all_reduce(x, async_op=True) for x in tensors]",
                "works = [dist.all_reduce(tensors[0], async_op=True) for x in tensors]",
            ),
            "tensor 0 of 10",
        ),
    ]
    for change, message in cases:
        lesson = mutant(tmp_path, ASYNC, change)
        result = run_lesson(
            lesson,
            "--fail-after",
            "1",
            "--in-flight",
            "10",
            nproc=2,
            launcher="warm",
            timeout=TIMEOUT,
        )
        assert_fails(result, message)


# ------------------------------------------------------------------------------ device_mesh.py


def test_mismatched_mesh_hangs_and_every_rank_says_where_in_one_line():
    result = run_lesson(MESH, "--mismatched-shape", nproc=4, launcher="warm", timeout=TIMEOUT)
    # the launcher may stop the others once one rank exits: at least one line, at most four
    assert_fails(result, "for 5 s: hung", within=4)
    lines = re.findall(r"^\[rank (\d)\] error: stuck in (.*) for 5 s: hung$", result.stderr, re.M)
    where = dict((int(rank), place) for rank, place in lines)
    for rank, place in where.items():
        want = "distribute_tensor on the (4,) mesh" if rank == 3 else "init_device_mesh(2, 2)"
        assert place == want, result
    assert "Traceback" not in result.output, result


def test_mismatched_shape_needs_two_real_dimensions():
    result = run_lesson(MESH, "--mismatched-shape", nproc=2, launcher="warm", timeout=TIMEOUT)
    assert_fails(result, "--mismatched-shape needs dp and tp >= 2")
    assert "Traceback" not in result.output, result


def test_device_mesh_checks_fail_when_the_lesson_is_wrong(tmp_path):
    """Placements in the wrong order (split over dp, not tp); every rank building the same shape
    under --mismatched-shape (then nothing hangs, and the lesson says so instead of passing)."""
    swapped = mutant(
        tmp_path,
        MESH,
        (
            "distribute_tensor(full, mesh, [Replicate(), Shard(0)])",
            "distribute_tensor(full, mesh, [Shard(0), Replicate()])",
        ),
    )
    result = run_lesson(swapped, nproc=4, launcher="warm", timeout=TIMEOUT)
    assert_fails(result, "distribute_tensor given the mesh: local")
    same = mutant(
        tmp_path,
        MESH,
        (
            "shape = (ctx.world_size,) if ctx.rank == ctx.world_size - 1 else (dp, tp)",
            "shape = (dp, tp)",
        ),
    )
    result = run_lesson(same, "--mismatched-shape", nproc=4, launcher="warm", timeout=TIMEOUT)
    assert_fails(result, "the mismatched meshes did not hang")


# -------------------------------------------------------- primitives/README.md: the Backend enum


def test_readme_backend_enum_command_prints_what_it_says():
    readme = (ROOT / "primitives" / "README.md").read_text()
    (command,) = re.findall(r"^    (python -c 'import torch\.distributed as d;.*)$", readme, re.M)
    printed = re.search(r"prints `([^`]*)` on this CPU build", readme).group(1)
    argv = shlex.split(command)
    argv[0] = sys.executable
    out = subprocess.run(
        argv, env=lesson_env(), capture_output=True, text=True, timeout=TIMEOUT, check=True
    ).stdout.strip()
    # the README's run is a CPU build; a build with NCCL prints True last, the rest the same
    import torch.distributed as dist

    assert out == printed.replace("False", str(dist.is_nccl_available())), out
