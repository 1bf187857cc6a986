"""The lessons of fsdp_basics/ (issue 6): fsdp_minimal (the folder's first lesson) under real
torchrun at 2 and 4 ranks, each other lesson once with `python lesson.py --nproc N` (3, an odd size
with uneven shards, where it matters most) and at its other world sizes on the warm launcher (issue
33), figures from the output checked; the checkpoint chain 2 ranks (a copy that crashes during a
save: the row of tests/test_mutations.py) -> 4 ranks -> 2 ranks against an uninterrupted run at 3;
resuming from a directory that holds no checkpoint, or another model's, is one line; a bad start.
Each launch costs seconds of imports (torch, torch._dynamo via torch.optim) per rank, so the runs
are as few as that allows."""

import re

import pytest

from harness import ROOT, assert_fails, assert_ok, mutant, run_lesson
from test_mutations import FSDP_BASICS

TIMEOUT = 240  # the CI machine is small and shared: a launch takes seconds, a hang is caught
LESSONS = [
    "zero_by_hand.py",
    "fsdp_minimal.py",
    "fsdp_memory.py",
    "fsdp_mixed_precision.py",
    "fsdp_offload.py",
]
PYTHON_NPROC = {
    "zero_by_hand.py": 3,
    "fsdp_minimal.py": 3,
    "fsdp_memory.py": 2,
    "fsdp_mixed_precision.py": 2,
    "fsdp_offload.py": 2,
}
NUM = r"([-+\d.e]+)"


def within_tolerance(out, label):
    """`label ... <diff> (tolerance <tol>)` printed by the lesson, and diff <= tol."""
    found = re.search(re.escape(label) + rf".*?{NUM} \(tolerance {NUM}\)", out)
    assert found, f"{label!r} not in\n{out}"
    diff, tol = float(found.group(1)), float(found.group(2))
    assert diff <= tol, out
    return diff


def check_output(name, nproc, out):
    if name == "zero_by_hand.py":
        within_tolerance(out, "max |param - single-process param|:")
        within_tolerance(out, "reduce_scattered gradient of step 0 - one process's:")
        ratios = [float(r) for r in re.findall(r"\(([\d.]+) of unsharded\)", out)]
        assert len(ratios) == nproc and all(abs(r - 1 / nproc) < 0.02 for r in ratios), out
        peaks = [int(p) for p in re.findall(r"peak gathered at once (\d+) B", out)]
        largest = int(re.search(r"the largest layer is (\d+) B", out).group(1))
        # one layer at a time, padded
        assert all(largest <= p <= largest + 4 * (nproc - 1) for p in peaks), out
    if name == "fsdp_minimal.py":
        within_tolerance(out, "max |param FSDP - param one process|")
        rows = [
            int(r)
            for r in re.findall(r"^\[rank \d\] .*?blocks\.0\.fc\.weight \((\d+), 64\)", out, re.M)
        ]
        # the shards on dim 0 add up to the weight
        assert len(rows) == nproc and sum(rows) == 64, out
        held = re.search(r"(\d+) B with reshard_after_forward=True .*?, (\d+) B with False", out)
        assert held and int(held.group(1)) * nproc <= int(held.group(2)) * 1.1, out
    if name == "fsdp_memory.py":
        total = re.search(
            r"^total state\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)\s+([\d,]+)$", out, re.M
        )
        assert total, out
        ddp, fsdp, bf16 = (int(total.group(i).replace(",", "")) for i in (1, 2, 5))
        assert abs(fsdp / ddp * nproc - 1) <= 0.10 and bf16 == fsdp, out
        assert len(re.findall(r"^\[rank \d\] FSDP: params", out, re.M)) == nproc, out
    if name == "fsdp_mixed_precision.py":
        within_tolerance(out, "max |diff| over")
        for what, dtype in (
            ("gathered param", "bfloat16"),
            ("unsharded grad", "bfloat16"),
            ("sharded param", "float32"),
            ("sharded grad", "float32"),
        ):
            assert re.search(rf"^  {what}\s+torch\.{dtype}", out, re.M), out
    if name == "fsdp_offload.py":
        assert "max |param - normal build| = 0.0e+00" in out, out
        within_tolerance(out, "|param - single process| / |param moved| =")
        assert out.count("shards and Adam state on cpu") == nproc, out


# fsdp_minimal, the folder's first lesson on the core path: real torchrun at 2 and 4 ranks. The
# others on the warm launcher (torchrun's environment, ranks forked) at the sizes `python` does not
# run. The quick tier: each lesson once.
QUICK = [("fsdp_minimal.py", 2, "torchrun")] + [(n, 4, "warm") for n in LESSONS]
RUNS = [("fsdp_minimal.py", 2, "torchrun"), ("fsdp_minimal.py", 4, "torchrun")] + [
    (name, k, "warm")
    for name in LESSONS
    if name != "fsdp_minimal.py"
    for k in (2, 4)
    if k != PYTHON_NPROC[name]
]


@pytest.mark.parametrize(
    "name,nproc,launcher",
    [pytest.param(*run, marks=[pytest.mark.quick] * (run in QUICK)) for run in RUNS],
)
def test_launched(name, nproc, launcher):
    result = run_lesson(f"fsdp_basics/{name}", nproc=nproc, launcher=launcher, timeout=TIMEOUT)
    assert_ok(result)
    check_output(name, nproc, result.stdout)


@pytest.mark.parametrize("name,nproc", sorted(PYTHON_NPROC.items()))
def test_python_launcher(name, nproc):
    result = run_lesson(f"fsdp_basics/{name}", nproc=nproc, launcher="python", timeout=TIMEOUT)
    assert_ok(result)
    check_output(name, nproc, result.stdout)


def checksum(result):
    within_tolerance(result.stdout, "max |param - uninterrupted single process|")
    return float(re.search(r"params checksum ([\d.]+)", result.stdout).group(1))


@pytest.mark.quick  # fsdp_checkpoint's run in the quick tier; the chain below is the thorough one
def test_checkpoint_runs_on_the_warm_launcher(tmp_path):
    ok = assert_ok(
        run_lesson(
            "fsdp_basics/fsdp_checkpoint.py",
            "--dir",
            tmp_path / "ck",
            nproc=2,
            launcher="warm",
            timeout=TIMEOUT,
        )
    )
    assert "on 2 ranks" in ok, ok


def test_checkpoint_reshard_and_crash(tmp_path):
    lesson, ck = "fsdp_basics/fsdp_checkpoint.py", tmp_path / "ck"
    # A copy that crashes inside the save of step 6, after dcp.save wrote step_000006.tmp and
    # before it is published (the mutation row): 2 ranks save steps 2 and 4, then crash.
    crash = next(m for m in FSDP_BASICS if m.id == "fsdp_checkpoint-crash-during-save")
    copy = mutant(tmp_path, lesson, *crash.changes)
    crashed = run_lesson(copy, "--dir", ck, nproc=2, launcher="warm", timeout=TIMEOUT)
    assert_fails(crashed, crash.message)
    assert (ck / "latest").read_text() == "step_000004" and (ck / "step_000006.tmp").is_dir()
    # 4 ranks resume the previous checkpoint (resharded 2 -> 4) and stop after saving step 6.
    resumed = run_lesson(
        lesson, "--dir", ck, "--resume", "--stop-at", "6", nproc=4, launcher="warm", timeout=TIMEOUT
    )
    assert_ok(resumed)
    message = "resumed from step_000004 (written by 2 ranks) at step 4 on 4 ranks"
    assert message in resumed.stdout, resumed
    assert (ck / "latest").read_text() == "step_000006" and not (ck / "step_000006.tmp").exists()
    checksum(resumed)
    # 2 ranks finish it (resharded 4 -> 2); an uninterrupted run (3 ranks, python) ends the same.
    finished = run_lesson(
        lesson, "--dir", ck, "--resume", nproc=2, launcher="warm", timeout=TIMEOUT
    )
    assert_ok(finished)
    message = "resumed from step_000006 (written by 4 ranks) at step 6 on 2 ranks"
    assert message in finished.stdout, finished
    whole = run_lesson(
        lesson, "--dir", tmp_path / "whole", nproc=3, launcher="python", timeout=TIMEOUT
    )
    assert_ok(whole)
    assert abs(checksum(finished) - checksum(whole)) < 1e-3, (finished, whole)
    # The same checkpoint resumed by a narrower model: one line that names it and what differs.
    other = run_lesson(
        lesson, "--dir", ck, "--resume", "--width", "32", nproc=2, launcher="warm", timeout=TIMEOUT
    )
    assert_fails(
        other,
        f"error: --resume: {ck / 'step_000008'} holds another model: blocks.0.fc.bias (64,) "
        "there, (32,) here; blocks.0.fc.weight (64, 64) there, (32, 32) here (and 5 more)",
        within=2,
    )
    assert "Traceback" not in other.output, other
    # A shard cut short (a full disk, a copy stopped half-way): one line that names the file.
    shard = ck / "step_000008" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    cut = run_lesson(lesson, "--dir", ck, "--resume", nproc=2, launcher="warm", timeout=TIMEOUT)
    damaged = f"{ck / 'step_000008'} is damaged: {shard} is shorter than its metadata says"
    assert_fails(cut, f"error: --resume: {damaged}", within=2)
    assert "Traceback" not in cut.output, cut


def test_checkpoint_resume_from_no_checkpoint_is_one_line(tmp_path):
    ck = tmp_path / "ck"
    (ck / "step_000002").mkdir(parents=True)  # what `latest` names holds no .metadata
    (ck / "step_000002" / "notes.txt").write_text("not a checkpoint\n")
    (ck / "latest").write_text("step_000002")
    result = run_lesson(
        "fsdp_basics/fsdp_checkpoint.py", "--dir", ck, "--resume", nproc=2, launcher="warm"
    )
    message = f"error: --resume: {ck / 'step_000002'} is not a DCP checkpoint (FileNotFoundError)"
    assert_fails(result, message, within=2)
    assert "Traceback" not in result.output, result


@pytest.mark.parametrize("name", ["zero_by_hand.py", "fsdp_minimal.py", "fsdp_offload.py"])
def test_batch_must_divide(name):
    assert_fails(
        run_lesson(
            f"fsdp_basics/{name}", "--batch", "49", nproc=2, launcher="warm", timeout=TIMEOUT
        ),
        "must divide by 2 ranks",
        within=2,
    )


def test_readme_commands_agree_with_the_folder_table():
    """Issue 13: the root README ran fsdp_mixed_precision at 4 ranks and this folder's table at 2.
    The reference rows now live in this folder's README ("The lessons by what you need"): each
    command there must stand in this folder's table row for that lesson."""
    here = (ROOT / "fsdp_basics" / "README.md").read_text()
    section = here[here.index("## The lessons by what you need") :]
    table = here[: here.index("## The lessons by what you need")]
    rows = dict(re.findall(r"^\| \[(\w+\.py)\]\(\1\) \|(.*)$", table, re.M))
    commands = [
        (m.group(2), m.group(1))
        for m in re.finditer(r"`(torchrun [^`]*fsdp_basics/(\w+\.py)[^`]*)`", section)
    ]
    assert len(commands) >= 5, commands
    for name, command in commands:
        assert f"`{command}" in rows[name], (name, command, rows[name])
