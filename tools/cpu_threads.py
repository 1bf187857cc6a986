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

On a machine that other jobs share, --nice -20 (as root) runs train.py, nanoGPT and the busy
process ahead of every job at niceness 0 (Linux's scheduler weighs -20 against 0 about 88 to 1;
each run and the busy process are sessions of their own, whose autogroup gets the niceness): "idle"
then means no other process of their priority, and "busy" one, beside them.
"""

import argparse
import contextlib
import os
import pickle
import re
import shutil
import signal
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
    "(cores-1)/ranks": (f"max(1, ({CORES} - 1) // local_world_size)", {}),
    "1": ("1", {}),
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


def set_session_nice(root, nice):
    """Linux with autogroups (/proc/sys/kernel/sched_autogroup_enabled) shares the CPU between
    sessions first, so a process's own niceness counts only inside its session, and torchrun starts
    each rank in a session of its own: set the session's (/proc/PID/autogroup, sched(7)) for
    `root` and every process under it."""
    parents = {}
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{entry}/stat") as stat:
                parents[int(entry)] = int(stat.read().rpartition(")")[2].split()[1])
    tree = [root]
    for pid in tree:
        tree += [child for child, parent in parents.items() if parent == pid]
    for pid in tree:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/autogroup", "w") as autogroup:
            autogroup.write(str(nice))


def one_run(command, env, cwd, busy, nice):
    """(ms/step or what went wrong, load average before the run). Each process it starts is in a
    session of its own, ended with what is left in it when the run ends, however it ends."""
    started = []
    try:
        if busy:
            hog = ["nice", "-n", str(nice), sys.executable, "-c", "while True: pass"]
            started.append(subprocess.Popen(hog, start_new_session=True))
            set_session_nice(started[-1].pid, nice)
            time.sleep(1)  # let it take its core
        load = os.getloadavg()[0]
        command = ["nice", "-n", str(nice), *map(str, command)]
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            run = subprocess.Popen(
                command, env=env, cwd=cwd, start_new_session=True, stdout=out, stderr=err
            )
            started.append(run)
            end = time.monotonic() + 900
            while run.poll() is None and time.monotonic() < end:
                if nice:
                    set_session_nice(run.pid, nice)  # the ranks that torchrun starts later too
                time.sleep(0.25)
            if run.returncode is None:
                return "timeout", load
            out.seek(0), err.seek(0)
            stdout, stderr = out.read(), err.read()
    finally:  # SIGTERM first: torchrun then ends its ranks, which it puts in sessions of their own
        for proc in started:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
    ms = step_ms(stdout)
    if run.returncode or ms is None:
        print(stdout[-2000:], stderr[-2000:], file=sys.stderr)
        return f"exit {run.returncode}", load
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
    parser.add_argument(
        "--nice", type=int, default=0, help="niceness of the runs and of the busy process (0)"
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill ends the runs too (finally)
    pythons = args.python or [sys.executable]
    variants = args.variant or [
        v for v in VARIANTS if v != "1" or len(os.sched_getaffinity(0)) > 2
    ]  # on 2 cores (cores-1)/ranks is 1
    launchers = args.launcher or ["torchrun", "python"]
    ours = THREADS_LINE.search((REPO / "launch" / "dist_setup.py").read_text()).group(2)
    versions = {python: torch_version(python) for python in pythons}
    cores = f"{os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable"
    print(f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {cores}; torch {', '.join(versions.values())}")
    print(f"train.py {NANOGPT} --steps {args.steps}; runs and busy process at nice {args.nice}")
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
                    ms, load = one_run(command, env, cwd, busy, args.nice)
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
