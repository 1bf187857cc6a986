"""Check a GPU node in one command: install, versions, train.py's single-GPU throughput, the node
check; one summary file. With one GPU or eight; about 9 minutes in all, each step bounded.

    python3 tools/gpu_check.py                        # summary in gpu_check_summary.txt
    python3 tools/gpu_check.py --summary /tmp/s.txt --budget 500 --skip-install
    python3 tools/gpu_check.py --dry-run              # on a CPU machine: as far as it goes

Steps, in this order, each under a time limit (a step past it is ended with every process it
started, found by a variable that every one of them inherits):
1. install: pip install -r requirements.txt pytest pytest-xdist (this interpreter's pip)
2. versions: torch, CUDA, NCCL, the driver and the GPUs (nvidia-smi)
3. throughput: transformer_basics/train.py on GPU 0 alone, GPT-2 small (--gpt2-small: 12 layers,
   768 wide, 1024 context), bf16, --compile, --parallel none; its summary line gives tokens/s and
   MFU against the GPU's dense bf16 peak (training.py's PEAK_BF16)
4. node check: pytest --gpu tests/test_gpu.py, with the time left (on one GPU it picks its own
   workers to take about 3 minutes: tests/test_gpu.py, plan)
A step that needs a GPU is skipped with one line where there is none. --dry-run installs nothing
and, without a GPU, trains a tiny model on the CPU for a few steps and lists the node check's plan
for one GPU instead. The exit code is 0 when nothing failed.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "GPU_CHECK_STEP"
TRAIN_GPU = ["--gpt2-small", "--dtype", "bfloat16", "--compile", "--eval-every", "0"]
TRAIN_CPU = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--block-size", "64"]
TRAIN_CPU += ["--batch-size", "4", "--warmup", "2", "--log-every", "2", "--dtype", "float32"]
SUMMARY = re.compile(
    r"summary: .*?, (\d+) steps, ([\d,]+) tokens/s, ([\d.]+) ms/step, MFU (.*?), train loss"
)
VERSIONS = """
import json, torch
cuda = torch.cuda.is_available()
nccl = torch.cuda.nccl.version() if cuda and torch.distributed.is_nccl_available() else None
print(json.dumps(dict(torch=torch.__version__, cuda=torch.version.cuda,
    nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
    gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
    bf16=cuda and torch.cuda.is_bf16_supported())))
"""


def marked(mark):
    """Every process whose environment holds MARK=mark (a step's processes, wherever they went)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"{MARK}={mark}".encode() in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                pass
    return found


def end_step(mark):
    for _ in range(20):  # stop them all first (none forks meanwhile), then kill
        pids = marked(mark)
        if not pids:
            return
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        time.sleep(0.2)


def run_step(name, command, limit, logs, env=None):
    """Run command with its output in logs/name.log; returns (exit code or None if it timed out,
    seconds, output). Every process it started is ended when it returns."""
    mark, log = uuid.uuid4().hex, logs / f"{name}.log"
    shown = " ".join("<script>" if "\n" in str(c) else str(c) for c in command)
    print(f"[gpu_check] {name}: {shown} (limit {limit:.0f} s, log {log})", flush=True)
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(c) for c in command],
            cwd=ROOT,
            env={**os.environ, **(env or {}), MARK: mark},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=max(1, limit))
        except subprocess.TimeoutExpired:
            code = None
        end_step(mark)
        proc.wait()
    return code, time.monotonic() - start, log.read_text(errors="replace")


def tail(text, n=15):
    return "\n".join("    " + line for line in text.splitlines()[-n:])


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--summary", default="gpu_check_summary.txt", help="the summary file")
    parser.add_argument("--budget", type=float, default=520, help="seconds for all the steps")
    parser.add_argument("--train-steps", type=int, default=150, help="train.py's --steps on a GPU")
    parser.add_argument("--skip-install", action="store_true", help="use what is installed")
    parser.add_argument("--dry-run", action="store_true", help="no install; CPU stand-ins")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget
    summary = Path(args.summary).resolve()
    logs = summary.with_name(summary.stem + "_logs")
    logs.mkdir(parents=True, exist_ok=True)
    lines, failed = [f"gpu_check {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, logs in {logs}"], False

    def left(cap):
        return min(cap, deadline - time.monotonic())

    def record(line):
        print(f"[gpu_check] {line}", flush=True)
        lines.append(line)

    py = sys.executable
    if args.dry_run or args.skip_install:
        record("install: skipped (" + ("--dry-run" if args.dry_run else "--skip-install") + ")")
    else:
        packages = ["-r", "requirements.txt", "pytest", "pytest-xdist"]
        code, took, out = run_step("install", [py, "-m", "pip", "install", "-q", *packages],
                                   left(240), logs)  # fmt: skip
        failed |= code != 0
        record(f"install: {'ok' if code == 0 else 'FAILED'} ({took:.0f} s)")
        if code != 0:
            record(tail(out))

    code, took, out = run_step("versions", [py, "-c", VERSIONS], left(90), logs)
    info = json.loads(out.strip().splitlines()[-1]) if code == 0 else {}
    if shutil.which("nvidia-smi"):
        query = [
            "nvidia-smi",
            "--query-gpu=name,driver_version,memory.total",
            "--format=csv,noheader",
        ]
        smi = run_step("nvidia-smi", query, left(30), logs)[2].strip().splitlines()
    else:
        smi = ["no nvidia-smi on PATH"]
    gpus = len(info.get("gpus", []))
    if code != 0:
        failed = True
        record(f"versions: FAILED (torch does not import)\n{tail(out)}")
    else:
        record(
            f"versions: torch {info['torch']}, CUDA {info['cuda']}, NCCL {info['nccl']}, "
            f"{gpus} GPU(s) {sorted(set(info['gpus']))}, bf16 {info['bf16']}; nvidia-smi: "
            + "; ".join(smi)
        )

    # 3. throughput, GPU 0 alone
    train = [py, "transformer_basics/train.py", "--nproc", "1", "--parallel", "none"]
    out_dir = tempfile.TemporaryDirectory(prefix="gpu_check_train_")  # its checkpoint: 0.5 GB
    train += ["--sample-tokens", "0", "--out", out_dir.name]
    if gpus:
        train += [*TRAIN_GPU, "--steps", str(args.train_steps)]
        what, env = f"GPT-2 small, bf16, --compile, {args.train_steps} steps, GPU 0", None
    elif args.dry_run:
        train += [*TRAIN_CPU, "--steps", "6", "--eval-batches", "1"]
        what, env = "dry run: a 2-layer model on the CPU, 6 steps", {"CUDA_VISIBLE_DEVICES": ""}
    if gpus or args.dry_run:
        code, took, out = run_step(
            "train", train, left(200), logs, {"CUDA_VISIBLE_DEVICES": "0", **(env or {})}
        )
        found = SUMMARY.search(out)
        ok = code == 0 and found is not None
        failed |= not ok
        if found:
            steps, tok_s, ms, mfu = found.groups()
            record(f"train: {'PASS' if ok else 'FAILED'}, {tok_s} tokens/s, {ms} ms/step, "
                   f"MFU {mfu} ({what}; {took:.0f} s)")  # fmt: skip
        else:
            state = "timed out" if code is None else f"exit code {code}"
            record(f"train: FAILED, {state}, no summary line ({what}; {took:.0f} s)\n{tail(out)}")
    else:
        record("train: skipped (no CUDA GPU: the throughput run needs one)")
    out_dir.cleanup()

    # 4. the node check, with the time left
    pytest = [py, "-m", "pytest", "-p", "no:cacheprovider", "--gpu", "tests/test_gpu.py"]
    if gpus:
        code, took, out = run_step("node_check", [*pytest, "-v"], left(args.budget), logs)
        counts = re.findall(r"(?:\[gw\d+\] )?(PASSED|FAILED|SKIPPED|ERROR) tests/", out)
        tally = {k: counts.count(k) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
        plan = next((line for line in out.splitlines() if line.startswith("GPU plan")), "")
        ok = code == 0
        failed |= not ok
        state = "timed out" if code is None else f"exit code {code}"
        record(f"node check: {'PASS' if ok else 'FAILED'} ({state}, {took:.0f} s): {tally}; {plan}")
        failures = [line for line in out.splitlines() if re.match(r"(FAILED|ERROR) tests/", line)]
        if failures:
            record("\n".join("    " + line[:200] for line in failures))
    elif args.dry_run:
        listing = [*pytest, "--collect-only", "-q"]
        code, took, out = run_step(
            "node_check", listing, left(120), logs, {"GPU_TEST_DEVICES": "1"}
        )
        plan = [line for line in out.splitlines() if line.startswith(("GPU tier", "GPU plan"))]
        failed |= code != 0 or not plan
        record("node check: skipped (no CUDA GPU); its runs at 1 GPU: " + " | ".join(plan))
    else:
        record("node check: skipped (no CUDA GPU: pytest --gpu needs one)")

    record(f"result: {'FAILED' if failed else 'PASS'}")
    summary.write_text("\n".join(lines) + "\n")
    print(f"[gpu_check] summary: {summary}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
