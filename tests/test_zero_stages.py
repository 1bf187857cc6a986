"""fsdp_basics/zero_stages.py and zero_redundancy_optimizer.py (issue 15): ZeRO-1 and ZeRO-2 by hand
against one process's Adam, their averaged gradient slices against one process's gradient, and the
bytes per rank of DDP and ZeRO-1/2/3 against the formula, at 3 (`python --nproc`, uneven padding),
2 and 4 ranks (warm); ZeroRedundancyOptimizer saved at 2 ranks, resumed at 3, equal to an
uninterrupted run at 4; a resume without the optimizer state (a mutation: it needs a checkpoint);
resuming from a file that is not a checkpoint, or of another model, is one line; bad flags. The
other taught steps removed on purpose are rows of tests/test_mutations.py."""

import re
import shutil

import pytest
import torch

from harness import assert_fails, assert_ok, mutant, run_lesson

STAGES, ZRO = "fsdp_basics/zero_stages.py", "fsdp_basics/zero_redundancy_optimizer.py"
TIMEOUT = 240
NUM = r"([-+\d.e]+)"


def within_tolerance(out, label):
    found = re.search(re.escape(label) + rf".*?{NUM} \(tolerance {NUM}\)", out)
    assert found, f"{label!r} not in\n{out}"
    assert float(found.group(1)) <= float(found.group(2)) <= 1e-4, out


def check_stages(result, nproc):
    out = result.stdout
    within_tolerance(out, "ZeRO-2")
    psi = int(
        re.search(r"Ψ = ([\d,]+) parameters on N = (\d+) ranks", out).group(1).replace(",", "")
    )
    rows = {
        m.group(1): [int(v.replace(",", "")) for v in m.groups()[1:]]
        for m in re.finditer(r"^(DDP|ZeRO-\d) +([\d,]+) +([\d,]+) +([\d,]+) +([\d,]+)  ", out, re.M)
    }
    assert set(rows) == {"DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"}, out
    # (params, grads, Adam state) in units of 4 bytes per parameter; padding adds under N floats
    # per flat buffer (4 per ZeRO-3 layer) and Adam's `step` counters 4 bytes per optimized tensor
    ideal = {
        "DDP": (1, 1, 2),
        "ZeRO-1": (1, 1, 2 / nproc),
        "ZeRO-2": (1, 1 / nproc, 2 / nproc),
        "ZeRO-3": (1 / nproc, 1 / nproc, 2 / nproc),
    }
    for name, (params, grads, state, total) in rows.items():
        assert total == params + grads + state, out
        for measured, share in zip((params, grads, state), ideal[name]):
            assert 0 <= measured - 4 * psi * share <= 4 * 4 * nproc + 4 * 8, (name, out)
    totals = [
        line for line in out.splitlines() if re.match(r"\[rank \d\] DDP [\d,]+ B, ZeRO-1", line)
    ]
    # every rank alike
    assert len(totals) == nproc and len({t.split("] ")[1] for t in totals}) == 1, out
    grads = re.search(r"one process's gradient: max (\S+) \(tolerance 1e-6\)", out)
    assert grads and float(grads.group(1)) <= 1e-6, out


@pytest.mark.parametrize(
    "nproc,launcher", [(2, "warm"), (3, "python"), pytest.param(4, "warm", marks=pytest.mark.quick)]
)
def test_stages(nproc, launcher):  # 3: 2,074 parameters, one flat buffer padded by 2 zeros
    result = run_lesson(STAGES, nproc=nproc, launcher=launcher, timeout=TIMEOUT)
    assert f"ZeRO-1 and ZeRO-2 by hand on {nproc} ranks match" in assert_ok(result)
    check_stages(result, nproc)


def test_stages_batch_must_divide():
    assert_fails(
        run_lesson(STAGES, "--batch", "49", nproc=2, launcher="warm", timeout=TIMEOUT),
        "--batch 49 must divide by 2 ranks",
        within=2,
    )


def check_zro(result, nproc, end):
    out = result.stdout
    within_tolerance(out, f"uninterrupted plain Adam, one process| after {end} steps:")
    owned = re.findall(r"^\[rank \d\] owns (\d+) of 8 tensors \(([\d,]+) parameters\)", out, re.M)
    assert len(owned) == nproc, out
    assert (
        sum(int(t) for t, _ in owned) == 8
        and sum(int(n.replace(",", "")) for _, n in owned) == 2074
    ), out
    assert "saved" in out and f"at step {end} on {nproc} ranks" in out, out


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory):
    """The first 5 of 10 steps at 2 ranks (warm launcher), saved; each test resumes from a copy."""
    path = tmp_path_factory.mktemp("zro") / "step5.pt"
    result = run_lesson(
        ZRO, "--checkpoint", path, "--stop-at", "5", nproc=2, launcher="warm", timeout=TIMEOUT
    )
    return path, result


def resume_copy(saved_at_2, tmp_path):
    path = tmp_path / "resumed.pt"
    shutil.copy(saved_at_2[0], path)
    return path


@pytest.mark.quick
def test_zro_2_saves(saved_at_2):
    result = saved_at_2[1]
    assert "ZeroRedundancyOptimizer on 2 ranks (steps 0..4)" in assert_ok(result)
    check_zro(result, 2, 5)


def test_zro_resumed_at_3_equals_uninterrupted_at_4(saved_at_2, tmp_path):
    resumed = resume_copy(saved_at_2, tmp_path)
    result = run_lesson(
        ZRO, "--checkpoint", resumed, "--resume", nproc=3, launcher="python", timeout=TIMEOUT
    )
    assert "resumed from 5" in assert_ok(result)
    assert "(step 5, written by 2 ranks) on 3 ranks" in result.stdout, result
    check_zro(result, 3, 10)
    whole = tmp_path / "whole.pt"
    uninterrupted = run_lesson(
        ZRO, "--checkpoint", whole, nproc=4, launcher="warm", timeout=TIMEOUT
    )
    assert_ok(uninterrupted)
    check_zro(uninterrupted, 4, 10)
    a, b = (torch.load(p, weights_only=True, map_location="cpu") for p in (resumed, whole))
    assert a["step"] == b["step"] == 10 and (a["world_size"], b["world_size"]) == (3, 4)
    # float32 rounding only (the order of sums differs with N), as the lesson's check
    for name in b["model"]:
        assert (a["model"][name] - b["model"][name]).abs().max() < 1e-4, name
    assert (
        a["optim"]["state"].keys() == b["optim"]["state"].keys() and len(b["optim"]["state"]) == 8
    )
    for index, state in b["optim"]["state"].items():
        for key, value in state.items():
            assert (a["optim"]["state"][index][key] - value).abs().max() < 1e-4, (index, key)


def test_zro_resume_without_optimizer_state_fails(saved_at_2, tmp_path):
    """The mistake of loading the model but not the optimizer state: a mutation of a copy (it needs
    a checkpoint, so it is here rather than in tests/test_mutations.py)."""
    copy = mutant(tmp_path, ZRO, ('opt.load_state_dict(ckpt["optim"])', "pass"))
    checkpoint = resume_copy(saved_at_2, tmp_path)
    result = run_lesson(
        copy, "--checkpoint", checkpoint, "--resume", nproc=3, launcher="warm", timeout=TIMEOUT
    )
    assert_fails(result, "ZeroRedundancyOptimizer differs from plain Adam by")


def test_zro_resume_from_another_model_is_one_line(saved_at_2, tmp_path):
    checkpoint = resume_copy(saved_at_2, tmp_path)
    result = run_lesson(
        ZRO, "--checkpoint", checkpoint, "--resume", "--width", "16", nproc=2, launcher="warm"
    )
    message = (
        f"error: --resume: {checkpoint} holds another model: blocks.0.fc.bias (30,) there, "
        "(16,) here; blocks.0.fc.weight (30, 30) there, (16, 16) here (and 5 more)"
    )
    assert_fails(result, message, within=2)
    assert "Traceback" not in result.output, result.output


def test_zro_resume_from_a_file_that_is_no_checkpoint_is_one_line(tmp_path):
    junk = tmp_path / "notes.pt"
    junk.write_text("not a checkpoint\n")
    result = run_lesson(ZRO, "--checkpoint", junk, "--resume", nproc=2, launcher="warm")
    assert_fails(result, f"error: --resume: {junk} is not a checkpoint (", within=2)
    assert "Traceback" not in result.output, result.output


def test_zro_bad_stop_at():
    assert_fails(
        run_lesson(ZRO, "--stop-at", "11", nproc=2, launcher="warm", timeout=TIMEOUT),
        "--stop-at must be between 0 and --steps (10)",
        within=2,
    )
