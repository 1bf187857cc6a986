"""The DDP feature lessons of ddp_basics/ (issue 5, second half): each once as
`python lesson.py --nproc 2` and at 3 ranks through the warm launcher (torchrun's environment,
ranks forked: issue 33); figures from the output checked, and bad starts that must fail cleanly.
The checks failing when a lesson is wrong: tests/test_mutations.py (DDP_BASICS)."""

import re

import pytest

from harness import assert_fails, assert_ok, run_lesson

TIMEOUT = 240  # the CI machine is small and shared: a launch takes seconds, a hang is caught

LESSONS = [
    "ddp_grad_accumulation.py",
    "ddp_unused_parameters.py",
    "ddp_uneven_inputs.py",
    "syncbatchnorm.py",
    "ddp_mixed_precision.py",
    "ddp_comm_hooks.py",
    "dataparallel_vs_ddp.py",
    "benchmark_ddp.py",
]


def check_output(name, nproc, result):
    out = result.stdout
    if name == "ddp_grad_accumulation.py":
        calls = re.search(r"all_reduce calls per step: (\S+) with no_sync, (\S+) without", out)
        assert calls, out
        assert float(calls.group(2)) == 4 * float(calls.group(1)) > 0, out  # default --accum 4
    if name == "ddp_unused_parameters.py":
        assert "Expected to have finished reduction" in out, out
    if name == "ddp_uneven_inputs.py":  # every rank but 0 has more batches: each one timed out
        assert out.count("stuck in backward's all_reduce") == nproc - 1, out
        assert out.count("finished its") == 1, out
        # rank r reads batches + r batches, rank after rank: together every batch exactly once (at 3
        # ranks the old offset r * (batches + r) had rank 2 read 10..14 of 0..11 and skip 3, 8, 9)
        ran = re.findall(
            r"^\[rank (\d+)\] with Join: ran its (\d+) batches \((\d+)\.\.(\d+) of 0\.\.(\d+)\)",
            out,
            re.M,
        )
        assert [int(r[0]) for r in ran] == list(range(nproc)), out
        read = [b for _, n, lo, hi, _ in ran for b in range(int(lo), int(hi) + 1)]
        assert read == list(range(int(ran[0][4]) + 1)), out
        assert [int(n) for _, n, *_ in ran] == [3 + r for r in range(nproc)], out
    if name == "syncbatchnorm.py":
        rows = re.findall(r"\] (\d+) rows;", out)
        assert len(rows) == nproc, out
    if name == "ddp_mixed_precision.py":  # both 16-bit modes run and are checked on every device
        for mode in ("bf16 autocast", r"fp16 autocast \+ GradScaler"):
            diff = re.search(
                rf"{mode}: held-out loss \S+ \(\|diff\| to fp32 (\S+), tolerance (\S+)\)", out
            )
            assert diff and float(diff.group(1)) <= float(diff.group(2)), out
        assert re.search(r"GradScaler scale 65536 -> \d+", out), out
    if name == "ddp_comm_hooks.py":
        sent = {
            m.group(1): int(m.group(2))
            for m in re.finditer(r"^(\S+).*bytes sent per step\s+(\d+)", out, re.M)
        }
        assert sent["fp16_compress_hook"] * 2 == sent["allreduce_hook"] > sent["PowerSGD"] > 0, out
    if name == "dataparallel_vs_ddp.py":
        assert re.search(rf"DDP, {nproc} processes on \w+: [\d.]+ ms/step", out), out
    if name == "benchmark_ddp.py":
        rows = re.findall(r"^\((\w)\) .*?\s([\d.]+)\s+([\d.]+)x\s+(\d+)%$", out, re.M)
        assert [r[0] for r in rows] == ["a", "b", "c", "d"], out
        assert all(float(ms) > 0 for _, ms, _, _ in rows), out


@pytest.mark.parametrize("name", LESSONS)
def test_python_launcher(name):
    result = run_lesson(f"ddp_basics/{name}", nproc=2, launcher="python", timeout=TIMEOUT)
    assert_ok(result)
    check_output(name, 2, result)


@pytest.mark.quick
@pytest.mark.parametrize("name", LESSONS)
def test_warm_3_ranks(name):
    result = run_lesson(f"ddp_basics/{name}", nproc=3, launcher="warm", timeout=TIMEOUT)
    assert_ok(result)
    check_output(name, 3, result)


def test_uneven_inputs_needs_two_ranks():
    assert_fails(
        run_lesson("ddp_basics/ddp_uneven_inputs.py", nproc=1, launcher="warm", timeout=TIMEOUT),
        "needs at least 2 ranks",
        within=1,
    )


def test_benchmark_batch_must_divide():
    assert_fails(
        run_lesson(
            "ddp_basics/benchmark_ddp.py",
            "--batch",
            "100",
            nproc=3,
            launcher="warm",
            timeout=TIMEOUT,
        ),
        "must divide by 3 ranks",
        within=3,
    )


def test_powersgd_rank_that_would_compress_nothing_is_refused():
    """PowerSGD sends a width x width matrix whole unless 4 r < width (_should_compress): refused
    in one line on every rank, not failed later by the bytes check."""
    result = run_lesson(
        "ddp_basics/ddp_comm_hooks.py",
        "--powersgd-rank",
        "16",
        nproc=2,
        launcher="warm",
        timeout=TIMEOUT,
    )
    assert_fails(result, "needs --powersgd-rank < --width / 4", within=2)
    assert "Traceback" not in result.output, result


def test_unused_parameters_batch_must_divide():
    assert_fails(
        run_lesson(
            "ddp_basics/ddp_unused_parameters.py",
            "--batch",
            "10",
            nproc=3,
            launcher="warm",
            timeout=TIMEOUT,
        ),
        "must divide by 3 ranks",
        within=3,
    )


def test_grad_accumulation_needs_whole_micro_batches():
    # 1536 examples on 5 ranks: 308 each, so the last micro-batch held 4 and the lesson, weighting
    # every micro-batch 1/accum, trained on a different loss than the large batch (it said so with a
    # RuntimeError and a traceback, not a usage line)
    assert_fails(
        run_lesson(
            "ddp_basics/ddp_grad_accumulation.py", nproc=5, launcher="warm", timeout=TIMEOUT
        ),
        "make --train a multiple of 64 x ranks",
        within=5,
    )
