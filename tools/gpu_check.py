"""Check a GPU node in one command: install, versions, train.py's single-GPU throughput and one
profiled step, the node check; one summary file. With one GPU or eight; each step bounded.

    python3 tools/gpu_check.py                        # summary in gpu_check_summary.txt
    python3 tools/gpu_check.py --quick                # at most 5 minutes
    python3 tools/gpu_check.py --summary /tmp/s.txt --budget 500 --skip-install
    python3 tools/gpu_check.py --dry-run              # on a CPU machine: as far as it goes

Steps, in this order, each under a time limit (a step past it is ended with every process it
started, found by a variable that every one of them inherits):
1. install: pip install -r requirements.txt pytest pytest-xdist (this interpreter's pip); not
   tried where no package index answers (then a torch with CUDA already installed is used as it
   is, said in one line)
2. versions: torch, CUDA, NCCL, the driver and the GPUs (nvidia-smi); a torch below the minimum of
   requirements.txt is named in one line with what will fail on it
3. train: transformer_basics/train.py on GPU 0 alone, GPT-2 small's shape (--gpt2-small), bf16,
   --compile, --parallel none, with --profile 1: its summary line gives tokens/s and MFU (the
   profiled step is not among the timed ones), its profile's summary.txt is copied into the
   summary, its trace.json into the logs
4. node check: pytest --gpu tests/test_gpu.py with the time left: every run if its plan fits
   (tests/test_gpu.py, plan), else the Gloo-with-CUDA crash's stages and the shortest runs that
   fit; each run's id, status, seconds and last line (--gpu-runs) go into the summary
--quick: at most 5 minutes (300 s): train.py for 20 steps, then the node check or its part that
fits. A step that needs a GPU is skipped with one line where there is none. --dry-run installs
nothing and, without a GPU, trains a tiny model on the CPU for a few steps and lists the node
check's plan for one GPU instead. The exit code is 0 when nothing failed.
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
from importlib import metadata, util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "GPU_CHECK_STEP"
TRAIN_GPU = ["--gpt2-small", "--dtype", "bfloat16", "--compile", "--eval-every", "0"]
TRAIN_CPU = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--block-size", "64"]
TRAIN_CPU += ["--batch-size", "4", "--warmup", "2", "--log-every", "2", "--dtype", "float32"]
PROFILE = ["--profile", "1"]  # one step under torch.profiler, after the first (compiled) one
QUICK_S, QUICK_STEPS = 300, 20
# pytest's start before the first run: each xdist worker imports torch (4.0 s on the H200 machine
# of 2026-11-28) and collects; reasoned, not measured alone
PYTEST_START_S = 15
SUMMARY = re.compile(
    r"summary: .*?, (\d+) steps, ([\d,]+) tokens/s, ([\d.]+) ms/step, MFU (.*?), train loss"
)
VERSIONS = """
import json, torch, torch.distributed as dist
cuda = torch.cuda.is_available()
nccl = torch.cuda.nccl.version() if cuda and dist.is_nccl_available() else None
names = ("all_gather_single", "reduce_scatter_single")
alias = {n: ("missing" if not hasattr(dist, n) else "aliased" if getattr(dist, n) is getattr(
    dist, n.replace("_single", "_into_tensor" if "gather" in n else "_tensor")) else "torch's")
    for n in names}
print(json.dumps(dict(torch=torch.__version__, cuda=torch.version.cuda,
    nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
    gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
    bf16=cuda and torch.cuda.is_bf16_supported(), collectives=alias)))
"""
# What failed on a torch below the minimum, by release, as measured (with the two renamed
# collectives aliased): torch 2.11.0+cu130 on one H200, 2026-11-28, commit d01dd3b, and a
# `pytest -m quick` on a CPU with torch 2.11.0 (545 passed, 6 failed)
BELOW_MINIMUM = {
    (2, 11): "Gloo has no all_to_all (all_to_all.py on Gloo); torch.jit's deprecation warnings "
    "fail composition.py's and train_local_sgd.py's runs; torchfrtrace differs "
    "(flight_recorder.py); pipelining checks strides (pipeline lessons on CPU); hsdp.py's count "
    "of the renamed collectives; every DeviceMesh or DTensor lesson crashes on Gloo with CUDA "
    "tensors (pytorch#152645: tests/gloo_cuda_crash.py)"
}


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
    shown = shown if len(shown) < 300 else shown[:300] + " ..."
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


def installed_torch():
    """(version, has CUDA) of the torch this Python would import, without importing it; None."""
    spec = util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return metadata.version("torch"), any((folder / "lib").glob("libtorch_cuda*.so"))


def index_answers(py, logs):
    """(whether pip's package index answers, the reason): `pip index versions torch`."""
    probe = [py, "-m", "pip", "index", "versions", "torch", "--retries", "0", "--timeout", "5"]
    code, _, out = run_step("index_probe", probe, 40, logs)
    last = (out.strip().splitlines() or ["no output"])[-1][:160]
    return code == 0, last


def minimum_torch():
    """The minimum of requirements.txt's torch line, as a tuple (2, 13)."""
    line = re.search(r"^torch>=([\d.]+)", (ROOT / "requirements.txt").read_text(), re.M)
    return tuple(int(x) for x in line.group(1).split(".")) if line else (0,)


def below_minimum(version):
    """One line naming what fails on a torch below requirements.txt's minimum, or None."""
    have, need = (
        tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:2]),
        minimum_torch(),
    )
    if have >= need:
        return None
    folders = ("primitives", "launch", "ddp_basics", "fsdp_basics", "transformer_basics")
    users = sorted(
        path.stem
        for folder in folders
        for path in (ROOT / folder).glob("*.py")
        if re.search(r"dist\.(all_gather_single|reduce_scatter_single)\(", path.read_text())
    )
    known = BELOW_MINIMUM.get(have, "not run here: more may fail")
    return (
        f"torch {version} is below the minimum {'.'.join(map(str, need))} (requirements.txt): "
        f"dist.all_gather_single and dist.reduce_scatter_single (new in 2.13) are missing, so "
        f"{len(users)} files fail at those calls ({', '.join(users)}) unless they are aliased to "
        f"all_gather_into_tensor and reduce_scatter_tensor; also on {have[0]}.{have[1]}: {known}"
    )


def node_check_runs(gpus, seconds):
    """(node ids to run or [] for all of them, a note): tests/test_gpu.py's runs that fit."""
    sys.path.insert(0, str(ROOT / "tests"))
    import test_gpu

    cases = test_gpu.node_check(gpus)
    workers = test_gpu.workers_for(gpus)
    chosen = test_gpu.fitting(cases, workers, seconds - PYTEST_START_S)
    planned = test_gpu.plan_seconds(chosen, workers)
    note = (
        f"{len(chosen)} of {len(cases)} runs, planned {planned / 60:.1f} min on {workers} worker(s)"
    )
    if len(chosen) == len(cases):
        return [], note
    ids = [f"tests/test_gpu.py::test_gpu[{case.id}]" for case in chosen]
    return ids, note + f" (the time left, {seconds:.0f} s, does not hold them all)"


def train_profiles():
    """Whether this checkout's train.py has --profile (issue 49: added beside this tool)."""
    return '"--profile"' in (ROOT / "transformer_basics/train.py").read_text()


def install(py, logs, limit):
    """(the summary's line, whether it failed): pip install of requirements.txt, pytest and
    pytest-xdist, or not tried where no package index answers."""
    answers, why = index_answers(py, logs)
    if not answers:
        found = installed_torch()
        if found and found[1]:
            return (f"install: not tried: no package index answers ({why}); this Python has "
                    f"torch {found[0]} with CUDA: used as it is"), False  # fmt: skip
        what = "a torch without CUDA" if found else "no torch"
        return f"install: FAILED: no package index answers ({why}) and this Python has {what}", True
    packages = ["-r", "requirements.txt", "pytest", "pytest-xdist"]
    code, took, out = run_step(
        "install", [py, "-m", "pip", "install", "-q", *packages], limit, logs
    )
    if code != 0:
        return f"install: FAILED ({took:.0f} s)\n{tail(out)}", True
    return f"install: ok ({took:.0f} s)", False


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--summary", default="gpu_check_summary.txt", help="the summary file")
    parser.add_argument("--budget", type=float, help="seconds for all the steps (520; --quick 300)")
    parser.add_argument("--train-steps", type=int, help="train.py's --steps (150; --quick 20)")
    parser.add_argument("--quick", action="store_true", help="at most 5 minutes in all")
    parser.add_argument("--skip-install", action="store_true", help="use what is installed")
    parser.add_argument("--skip-train", action="store_true", help="no train.py run")
    parser.add_argument("--dry-run", action="store_true", help="no install; CPU stand-ins")
    args = parser.parse_args()
    budget = args.budget or (QUICK_S if args.quick else 520)
    if args.quick and budget > QUICK_S:
        parser.error(f"--quick: --budget {budget:g} is over its {QUICK_S} s")
    steps = args.train_steps or (QUICK_STEPS if args.quick else 150)
    if not 3 <= steps <= 100_000:
        parser.error(f"--train-steps {steps}: from 3 (one warms up, one profiled, one timed)")
    deadline = time.monotonic() + budget
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
        line, bad = install(py, logs, left(240))
        failed |= bad
        record(line)

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
        names = ", ".join(f"{n}: {how}" for n, how in info["collectives"].items())
        record(
            f"versions: torch {info['torch']}, CUDA {info['cuda']}, NCCL {info['nccl']}, "
            f"{gpus} GPU(s) {sorted(set(info['gpus']))}, bf16 {info['bf16']}; {names}; "
            "nvidia-smi: " + "; ".join(smi)
        )
        if old := below_minimum(info["torch"]):
            record(f"versions: {old}")

    # 3. throughput and one profiled step, GPU 0 alone
    train = [py, "transformer_basics/train.py", "--nproc", "1", "--parallel", "none"]
    out_dir = tempfile.TemporaryDirectory(prefix="gpu_check_train_")  # its checkpoint: 0.5 GB
    train += ["--sample-tokens", "0", "--out", out_dir.name]
    profiles = train_profiles()
    if gpus:
        warmup = ["--warmup", "10"] if steps <= 100 else []  # fewer steps than its 100 of warm-up
        train += [*TRAIN_GPU, *warmup, "--steps", str(steps)]
        what, env = f"GPT-2 small, bf16, --compile, {steps} steps, GPU 0", None
    elif args.dry_run:
        train += [*TRAIN_CPU, "--steps", "6", "--eval-batches", "1"]
        what, env = "dry run: a 2-layer model on the CPU, 6 steps", {"CUDA_VISIBLE_DEVICES": ""}
    if args.skip_train:
        record("train: skipped (--skip-train)")
    elif gpus or args.dry_run:
        train += PROFILE if profiles else []
        code, took, out = run_step(
            "train", train, left(200), logs, {"CUDA_VISIBLE_DEVICES": "0", **(env or {})}
        )
        found = SUMMARY.search(out)
        ok = code == 0 and found is not None
        failed |= not ok
        if found:
            steps_run, tok_s, ms, mfu = found.groups()
            record(f"train: {'PASS' if ok else 'FAILED'}, {tok_s} tokens/s, {ms} ms/step, "
                   f"MFU {mfu} ({what}; {took:.0f} s)")  # fmt: skip
        else:
            state = "timed out" if code is None else f"exit code {code}"
            record(f"train: FAILED, {state}, no summary line ({what}; {took:.0f} s)\n{tail(out)}")
        profile = Path(out_dir.name) / "profile"
        if not profiles:
            record("profile: skipped (this checkout's train.py has no --profile)")
        elif (profile / "summary.txt").exists():
            shutil.copy(profile / "summary.txt", logs / "profile_summary.txt")
            if (profile / "trace.json").exists():
                shutil.copy(profile / "trace.json", logs / "profile_trace.json")
            record(f"profile: one step, trace in {logs / 'profile_trace.json'} (Perfetto opens it)")
            record(tail((profile / "summary.txt").read_text(), 40))
        else:
            failed = True
            record("profile: FAILED, train.py wrote no profile/summary.txt")
    else:
        record("train: skipped (no CUDA GPU: the throughput run needs one)")
    out_dir.cleanup()

    # 4. the node check, with the time left
    pytest = [py, "-m", "pytest", "-p", "no:cacheprovider", "--gpu"]
    runs = logs / "node_check_runs.tsv"
    if gpus:
        ids, note = node_check_runs(gpus, left(budget))
        command = [*pytest, "-v", "--gpu-runs", runs, *(ids or ["tests/test_gpu.py"])]
        code, took, out = run_step("node_check", command, left(budget), logs)
        rows = [r.split("\t") for r in runs.read_text().splitlines()[1:]] if runs.exists() else []
        tally = {
            s: sum(r[1] == s for r in rows) for s in ("passed", "failed", "xfailed", "skipped")
        }
        ok = code == 0
        failed |= not ok
        state = "timed out" if code is None else f"exit code {code}"
        record(f"node check: {'PASS' if ok else 'FAILED'} ({state}, {took:.0f} s): {tally}; {note}")
        if rows:
            record("    " + runs.read_text().replace("\n", "\n    ").rstrip())
    elif args.dry_run:
        listing = [*pytest, "tests/test_gpu.py", "--collect-only", "-q"]
        code, took, out = run_step(
            "node_check", listing, left(120), logs, {"GPU_TEST_DEVICES": "1"}
        )
        plan = [line for line in out.splitlines() if line.startswith(("GPU tier", "GPU plan"))]
        failed |= code != 0 or not plan
        _, note = node_check_runs(1, left(budget))
        record("node check: skipped (no CUDA GPU); its runs at 1 GPU: " + " | ".join(plan)
               + f"; in the time left here: {note}")  # fmt: skip
    else:
        record("node check: skipped (no CUDA GPU: pytest --gpu needs one)")

    record(f"result: {'FAILED' if failed else 'PASS'}")
    summary.write_text("\n".join(lines) + "\n")
    print(f"[gpu_check] summary: {summary}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
