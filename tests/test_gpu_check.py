"""tools/gpu_check.py, the one command that checks a GPU node, dry-run on this CPU machine: every
step reports one line in the summary file, the steps that need a GPU are skipped with their reason
or stood in for (a tiny train.py run on the CPU, the node check's plan at one GPU), and a step past
its time limit is ended with every process it started."""

import subprocess
import sys
import time

import torch

from harness import ROOT, lesson_env

TOOL = ROOT / "tools" / "gpu_check.py"


def test_dry_run_on_cpu_reports_every_step(tmp_path):
    if torch.cuda.is_available():  # with a GPU the dry run trains GPT-2 small: minutes, not here
        import pytest

        pytest.skip("a GPU is visible: the dry run would run the GPU steps")
    summary = tmp_path / "summary.txt"
    done = subprocess.run(
        [sys.executable, TOOL, "--dry-run", "--summary", summary],
        cwd=ROOT,
        env=lesson_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = summary.read_text().splitlines()
    steps = {line.split(":")[0]: line for line in lines if not line.startswith(("gpu_check", " "))}
    assert list(steps) == ["install", "versions", "train", "node check", "result"], lines
    assert steps["install"] == "install: skipped (--dry-run)"
    assert steps["versions"].startswith(f"versions: torch {torch.__version__}, CUDA")
    assert "0 GPU(s)" in steps["versions"], lines
    # the CPU stand-in: train.py's own summary line read back (tokens/s, MFU)
    assert steps["train"].startswith("train: PASS, "), lines
    assert " tokens/s, " in steps["train"] and "MFU unknown" in steps["train"], lines
    assert "GPU tier --gpu: " in steps["node check"] and "GPU plan: " in steps["node check"]
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
    sys.path.insert(0, str(TOOL.parent))
    import gpu_check
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
    sys.path.insert(0, str(TOOL.parent))
    import gpu_check
    from lesson_cli import lesson_parser, parse

    parser = lesson_parser("transformer_basics/train.py")
    common = ["--nproc", "1", "--parallel", "none", "--sample-tokens", "0", "--out", "/tmp/x"]
    for flags in (gpu_check.TRAIN_GPU + ["--steps", "150"], gpu_check.TRAIN_CPU + ["--steps", "6"]):
        code, output, _ = parse(parser, common + flags)
        assert code == 0, f"train.py {' '.join(flags)}: {output}"
