"""tools/gpu_check.py, the one command that checks a GPU node, dry-run on this CPU machine: every
step reports one line in the summary file, the steps that need a GPU are skipped with their reason
or stood in for (a tiny train.py run on the CPU, the node check's plan at one GPU), and a step past
its time limit is ended with every process it started. Its decisions for a machine like the first
GPU machine (a CUDA torch 2.11 and no package index) are tried with that machine stood in for."""

import re
import subprocess
import sys
import time

import pytest
import torch

from harness import ROOT, lesson_env

TOOL = ROOT / "tools" / "gpu_check.py"
sys.path.insert(0, str(TOOL.parent))
import gpu_check  # noqa: E402
import test_gpu  # noqa: E402


def test_dry_run_on_cpu_reports_every_step(tmp_path):
    if torch.cuda.is_available():  # with a GPU the dry run trains GPT-2 small: minutes, not here
        pytest.skip("a GPU is visible: the dry run would run the GPU steps")
    summary = tmp_path / "summary.txt"
    done = subprocess.run(
        [sys.executable, TOOL, "--dry-run", "--quick", "--summary", summary],
        cwd=ROOT,
        env=lesson_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = summary.read_text().splitlines()
    steps = {line.split(":")[0]: line for line in lines if not line.startswith(("gpu_check", " "))}
    assert list(steps) == ["install", "versions", "train", "profile", "node check", "result"], lines
    assert steps["install"] == "install: skipped (--dry-run)"
    assert steps["versions"].startswith(f"versions: torch {torch.__version__}, CUDA")
    assert "0 GPU(s)" in steps["versions"], lines
    # the CPU stand-in: train.py's own summary line read back (tokens/s, MFU)
    assert steps["train"].startswith("train: PASS, "), lines
    assert " tokens/s, " in steps["train"] and " MFU " in steps["train"], lines
    # one profiled step: its summary copied in (or said missing where train.py has no --profile)
    if gpu_check.train_profiles():
        assert steps["profile"].startswith("profile: one step, trace in "), lines
        assert (tmp_path / "summary_logs" / "profile_summary.txt").exists()
    else:
        assert steps["profile"] == "profile: skipped (this checkout's train.py has no --profile)"
    assert "GPU tier --gpu: " in steps["node check"] and "GPU plan: " in steps["node check"]
    # --quick: what fits in the time left of its 300 s (on this 2-core machine, one worker)
    assert f" of {len(test_gpu.node_check(1))} runs, planned " in steps["node check"], lines
    assert steps["result"] == "result: PASS"
    assert (tmp_path / "summary_logs" / "train.log").exists()


SLEEPER = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
time.sleep(600)
"""


def test_a_step_past_its_limit_is_ended_with_its_processes(tmp_path):
    """A step's process and a child in a session of its own are both gone within seconds."""
    from test_harness import wait_until_gone

    pids = tmp_path / "pids"
    start = time.monotonic()
    code, took, _ = gpu_check.run_step(
        "hang", [sys.executable, "-c", SLEEPER, pids], limit=5, logs=tmp_path
    )
    assert code is None and time.monotonic() - start < 15, took
    started = list(map(int, pids.read_text().split()))
    assert len(started) == 2 and wait_until_gone(started, seconds=5) == [], started


def test_the_gpu_steps_flags_parse():
    """What the tool gives train.py on a GPU (and on the CPU) parses with train.py's own parser: a
    renamed flag fails here, not on a rented GPU."""
    from lesson_cli import lesson_parser, parse

    parser = lesson_parser("transformer_basics/train.py")
    common = ["--nproc", "1", "--parallel", "none", "--sample-tokens", "0", "--out", "/tmp/x"]
    profile = gpu_check.PROFILE if gpu_check.train_profiles() else []
    quick = ["--warmup", "10", "--steps", str(gpu_check.QUICK_STEPS)]
    for flags in (
        gpu_check.TRAIN_GPU + ["--steps", "150"] + profile,
        gpu_check.TRAIN_GPU + quick + profile,
        gpu_check.TRAIN_CPU + ["--steps", "6"] + profile,
    ):
        code, output, _ = parse(parser, common + flags)
        assert code == 0, f"train.py {' '.join(flags)}: {output}"


def test_no_install_where_no_index_answers(tmp_path, monkeypatch):
    """A machine like the first GPU machine: pip's index does not answer (tried for real here, with
    pip's configuration pointed at nothing) and torch with CUDA is installed: no pip install is
    started, one line says so; without a CUDA torch that is a failure, said in one line."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    answers, why = gpu_check.index_answers(sys.executable, tmp_path)
    assert not answers and why, why
    started = []
    real_step = gpu_check.run_step

    def step(name, *args, **kwargs):
        started.append(name)
        return real_step(name, *args, **kwargs)

    monkeypatch.setattr(gpu_check, "run_step", step)
    monkeypatch.setattr(gpu_check, "installed_torch", lambda: ("2.11.0+cu130", True))
    line, failed = gpu_check.install(sys.executable, tmp_path, 60)
    assert started == ["index_probe"] and not failed, (started, line)
    assert line.startswith("install: not tried: no package index answers (") and "\n" not in line
    assert "this Python has torch 2.11.0+cu130 with CUDA: used as it is" in line, line
    monkeypatch.setattr(gpu_check, "installed_torch", lambda: ("2.13.0+cpu", False))
    line, failed = gpu_check.install(sys.executable, tmp_path, 60)
    assert failed and line.endswith("and this Python has a torch without CUDA"), line


def test_a_torch_below_the_minimum_is_named_with_what_fails():
    """torch 2.11 (the first GPU machine's): one line naming the minimum, the files that call the
    two collectives 2.13 added, and what else failed on 2.11; nothing at 2.13 or later."""
    line = gpu_check.below_minimum("2.11.0+cu130")
    folders = ("primitives", "launch", "ddp_basics", "fsdp_basics", "transformer_basics")
    calls = re.compile(r"dist\.(all_gather_single|reduce_scatter_single)\(")
    users = [
        p.stem for f in folders for p in (ROOT / f).glob("*.py") if calls.search(p.read_text())
    ]
    assert len(users) >= 9 and f"so {len(users)} files fail" in line, (users, line)
    assert line.startswith("torch 2.11.0+cu130 is below the minimum 2.13 (requirements.txt)")
    assert "\n" not in line and all(name in line for name in users), line
    assert "Gloo has no all_to_all" in line and "pytorch#152645" in line, line
    assert "not run here" in gpu_check.below_minimum("2.12.1")
    assert gpu_check.below_minimum("2.13.0+cpu") is None
    assert gpu_check.below_minimum("2.15.0") is None


@pytest.mark.parametrize("budget", [400, 299.5])
def test_quick_stays_within_5_minutes(tmp_path, budget):
    """--quick refuses a budget over its 300 s, and any run too few train steps for a profiled
    and a timed one, in one line, before anything runs."""
    done = subprocess.run(
        [sys.executable, TOOL, "--quick", "--dry-run", "--budget", str(budget), "--summary",
         tmp_path / "s.txt", "--train-steps", "2"],
        cwd=ROOT, env=lesson_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    error = done.stderr.strip().splitlines()[-1]  # after argparse's usage
    assert done.returncode == 2 and error.startswith("gpu_check.py: error: "), done.stderr
    assert ("--budget 400 is over" if budget == 400 else "--train-steps 2: from 3") in error, error


def test_the_node_check_part_that_fits():
    """With the time left short, the runs are the crash's stages and the shortest that fit; with
    enough time, all of them (no node ids: the whole file)."""
    ids, note = gpu_check.node_check_runs(1, 60)
    assert ids and "tests/test_gpu.py::test_gpu[other-gloo_cuda_crash]" in ids, note
    total = len(test_gpu.node_check(1))  # every run at 1 GPU, counted from the plan itself
    assert f"{len(ids)} of {total} runs" in note and "does not hold them all" in note, note
    ids, note = gpu_check.node_check_runs(1, 3600)
    assert ids == [] and note.startswith(f"{total} of {total} runs"), note
