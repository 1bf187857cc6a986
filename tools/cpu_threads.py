"""How a CPU rank's threads fare on a shared machine: train.py at nanoGPT's CPU size (issue 48).

    python tools/cpu_threads.py                           # this interpreter's torch, about 15 min
    python tools/cpu_threads.py --python /tmp/v214/bin/python --python python3 --nanogpt ~/nanoGPT

For each interpreter (--python, one torch each), each way of setting a rank's threads (VARIANTS)
and each launcher (torchrun, python --nproc 1), it runs transformer_basics/train.py at nanoGPT's
CPU configuration (4 layers, 128 wide, 4 heads, context 64, batch 12, one rank, --parallel none)
twice in a row: on the machine as it is ("idle") and beside one busy process (`python3 -c "while
True: pass"`, started a second before the run and ended after it). Each run prints its ms/step
(train.py's summary line: the mean over the steps after the first) and the load average before
it; then one table: the median idle and busy step, busy / idle, and idle against nanoGPT's.

--nanogpt DIR (a checkout of karpathy/nanoGPT; nothing of it is in this repository) runs nanoGPT's
train.py the same way, with the command of its README's CPU section (--dtype=float32, --max_iters
as --steps) on this folder's corpus as bytes (vocab 256, as train.py's), its ms/iter the mean over
the iterations after the first. Without it, idle is set against nanoGPT's 60.5 to 62.9 ms/iter
quoted in issue 48 (the 2-core machine, 2026-11-28), which this run did not measure.

A variant is a copy of transformer_basics/ and launch/ in a temporary folder, with dist_setup.run's
`torch.set_num_threads(...)` line set its way, and environment variables added to the run's:
OpenMP reads OMP_WAIT_POLICY when torch loads it, so it must be set before the process starts.
The row marked * is this checkout's own line.
"""

import argparse
import os
import pickle
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORES = "len(os.sched_getaffinity(0))"
VARIANTS = {  # name: (the argument of torch.set_num_threads in run(), environment)
    "cores/ranks": (f"max(1, {CORES} // local_world_size)", {}),
    "cores/ranks, PASSIVE": (
        f"max(1, {CORES} // local_world_size)",
        {"OMP_WAIT_POLICY": "PASSIVE"},
    ),
    "1": ("1", {}),
    "1, PASSIVE": ("1", {"OMP_WAIT_POLICY": "PASSIVE"}),
    "(cores-1)/ranks": (f"max(1, ({CORES} - 1) // local_world_size)", {}),
}
NANOGPT = "--n-layer 4 --n-embd 128 --n-head 4 --block-size 64 --batch-size 12 --parallel none"
THREADS_LINE = re.compile(r"^(\s*)torch\.set_num_threads\((.*)\)\s*$", re.M)


def copy_with_threads(expression, into):
    """transformer_basics/ and launch/ copied into `into`, run() setting `expression` threads."""
    for folder in ("transformer_basics", "launch"):
        shutil.copytree(REPO / folder, into / folder, ignore=shutil.ignore_patterns("*.md"))
    setup = into / "launch" / "dist_setup.py"
    text, n = THREADS_LINE.subn(rf"\1torch.set_num_threads({expression})", setup.read_text())
    assert n == 1, f"launch/dist_setup.py: {n} torch.set_num_threads lines, expected 1"
    setup.write_text(text)
    return into / "transformer_basics" / "train.py"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def our_command(python, train, launcher, steps, out):
    args = [*NANOGPT.split(), "--steps", str(steps), "--eval-every", "0", "--eval-batches", "1"]
    args += ["--warmup", "2", "--sample-tokens", "0", "--out", str(out)]
    if launcher == "python":
        return [python, train, "--nproc", "1", *args]
    torchrun = [python, "-m", "torch.distributed.run", "--nproc_per_node=1"]
    return [*torchrun, "--master_addr=127.0.0.1", f"--master_port={free_port()}", train, *args]


def nanogpt_copy(source, into):
    """nanoGPT's train.py, model.py, configurator.py and config/, with this repository's corpus as
    data/shakespeare_char (bytes, vocab 256): nothing is downloaded."""
    import numpy as np

    sys.path.insert(0, str(REPO / "transformer_basics"))
    from data import generate_corpus

    into.mkdir(parents=True)
    for name in ("train.py", "model.py", "configurator.py"):
        shutil.copy(source / name, into / name)
    shutil.copytree(source / "config", into / "config")
    folder = into / "data" / "shakespeare_char"
    folder.mkdir(parents=True)
    ids = np.frombuffer(generate_corpus().encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    ids[: len(ids) * 9 // 10].tofile(folder / "train.bin")
    ids[len(ids) * 9 // 10 :].tofile(folder / "val.bin")
    with open(folder / "meta.pkl", "wb") as meta:
        pickle.dump({"vocab_size": 256}, meta)
    return into / "train.py"


def nanogpt_command(python, train, steps, out):
    """Its README's CPU command, float32 (its CPU default, float16, means a GradScaler)."""
    command = [python, train, "config/train_shakespeare_char.py", "--device=cpu", "--compile=False"]
    command += ["--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12"]
    command += ["--n_layer=4", "--n_head=4", "--n_embd=128", f"--max_iters={steps}"]
    return command + [
        "--lr_decay_iters=2000",
        "--dropout=0.0",
        "--dtype=float32",
        f"--out_dir={out}",
    ]


def step_ms(stdout):
    """train.py's summary, or the mean of nanoGPT's iterations after the first; None if absent."""
    found = re.search(r"([\d.]+) ms/step", stdout)
    if found:
        return float(found.group(1))
    iters = re.findall(r"^iter (\d+): .*time ([\d.]+)ms", stdout, re.M)
    after_first = [float(ms) for n, ms in iters if int(n) > 0]
    return statistics.mean(after_first) if after_first else None


def one_run(command, env, cwd, busy):
    """(ms/step or what went wrong, load average before the run)."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        if hog:
            time.sleep(1)  # let it take its core
        load = os.getloadavg()[0]
        command = [str(c) for c in command]
        proc = subprocess.run(
            command, env=env, cwd=cwd, capture_output=True, text=True, timeout=900
        )
    except subprocess.TimeoutExpired:
        return "timeout", load
    finally:
        if hog:
            hog.kill()
            hog.wait()
    ms = step_ms(proc.stdout)
    if proc.returncode or ms is None:
        print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
        return f"exit {proc.returncode}", load
    return ms, load


def torch_version(python):
    code = "import torch; print(torch.__version__)"
    return subprocess.check_output([python, "-c", code], text=True).strip()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python", action="append", help="an interpreter with torch (repeatable)")
    parser.add_argument("--variant", action="append", choices=VARIANTS, help="(default: all)")
    parser.add_argument("--launcher", action="append", choices=["torchrun", "python"])
    parser.add_argument("--nanogpt", type=Path, help="a checkout of karpathy/nanoGPT: run it too")
    parser.add_argument("--repeat", type=int, default=2, help="idle/busy pairs per row (2)")
    parser.add_argument("--steps", type=int, default=30, help="train.py --steps (30)")
    args = parser.parse_args()
    pythons = args.python or [sys.executable]
    variants = args.variant or [
        v for v in VARIANTS if v != "(cores-1)/ranks" or len(os.sched_getaffinity(0)) > 2
    ]  # on 2 cores (cores-1)/ranks is 1
    launchers = args.launcher or ["torchrun", "python"]
    ours = THREADS_LINE.search((REPO / "launch" / "dist_setup.py").read_text()).group(2)
    versions = {python: torch_version(python) for python in pythons}
    cores = f"{os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable"
    print(f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {cores}; torch {', '.join(versions.values())}")
    print(f"train.py {NANOGPT} --steps {args.steps}")
    tmp = Path(tempfile.mkdtemp(prefix="cpu_threads_"))
    out = tmp / "out" / "run"
    nanogpt = nanogpt_copy(args.nanogpt, tmp / "nanogpt") if args.nanogpt else None
    trains = {v: copy_with_threads(VARIANTS[v][0], tmp / f"v{i}") for i, v in enumerate(variants)}
    rows = []  # (python, label, launcher, command, env, cwd)
    for python in pythons:
        if nanogpt:
            command = nanogpt_command(python, nanogpt, args.steps, out)
            rows.append(
                (python, "nanoGPT (torch's)", "python", command, os.environ, nanogpt.parent)
            )
        for variant in variants:
            expression, extra = VARIANTS[variant]
            env = dict(os.environ, **extra, PYTHONPATH=str(trains[variant].parents[1]))
            mark = "*" if expression == ours and not extra else " "
            for launcher in launchers:
                command = our_command(python, trains[variant], launcher, args.steps, out)
                rows.append((python, mark + variant, launcher, command, env, out.parent))
    results = {}  # (python, label, launcher, busy): [ms/step]
    try:
        for repeat in range(args.repeat):
            for python, label, launcher, command, env, cwd in rows:
                for busy in (False, True):
                    shutil.rmtree(out, ignore_errors=True)
                    out.parent.mkdir(exist_ok=True)
                    ms, load = one_run(command, env, cwd, busy)
                    results.setdefault((python, label, launcher, busy), []).append(ms)
                    where = "busy" if busy else "idle"
                    cell = f"{versions[python]:14} {label:22} {launcher:9} {where}"
                    shown = f"{ms:.1f} ms/step" if isinstance(ms, float) else ms
                    print(f"  {cell}: {shown} (load {load:.2f})", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nmedians of {args.repeat}; * this checkout's default")
    head = f"{'torch':14} {'threads':22} {'launcher':9} {'idle':>7} {'busy':>7} {'busy/idle':>9}"
    print(f"{head} {'idle/nanoGPT':>12}")
    for python in pythons:
        medians = {}
        for _, label, launcher, *_ in [r for r in rows if r[0] == python]:
            idle, busy = (
                [m for m in results[(python, label, launcher, b)] if isinstance(m, float)]
                for b in (False, True)
            )
            if idle and busy:
                medians[(label, launcher)] = statistics.median(idle), statistics.median(busy)
        nano = medians.get(("nanoGPT (torch's)", "python"))
        for _, label, launcher, *_ in [r for r in rows if r[0] == python]:
            row = f"{versions[python]:14} {label:22} {launcher:9}"
            if (label, launcher) not in medians:
                print(f"{row} failed")
                continue
            i, b = medians[(label, launcher)]
            vs = f"{i / nano[0]:12.2f}" if nano else f"{i / 62.9:7.2f}-{i / 60.5:4.2f}"
            print(f"{row} {i:7.1f} {b:7.1f} {b / i:9.2f} {vs}")


if __name__ == "__main__":
    main()
