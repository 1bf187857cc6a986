"""Run a lesson the way a user does, as a subprocess, with a hard time limit.

    result = run_lesson("primitives/broadcast.py", nproc=3)                      # torchrun
    result = run_lesson("primitives/broadcast.py", nproc=3, launcher="python")   # --nproc path
    result = run_lesson("primitives/broadcast.py", nproc=3, launcher="warm")     # as torchrun
    assert_ok(result)

launcher="warm" (tests/warm_launcher.py) gives each rank exactly the environment torchrun gives it,
but forks the ranks from a server process that has imported torch once (started on first use, one
per pytest process, stopped at exit), which saves about 1.5 s of CPU per rank. Keep real torchrun
for tests about launching itself (restarts, signals, torchrun's own output) and for a lesson's one
reader-facing run; see tests/warm_launcher.py for what differs.

Each run gets a free port on 127.0.0.1, so runs never collide; a run that outlives
its time limit is killed with all its processes and the test fails with its output.
"""

import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from itertools import count
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARM = str(Path(__file__).resolve().with_name("warm_launcher.py"))  # in Result.command of warm runs


@dataclass
class Result:
    command: list
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    rank_codes: list = None  # exit code of each rank (launcher="warm" only)
    seconds: float = None  # wall time of the run

    @property
    def output(self):
        return self.stdout + self.stderr

    def last_lines(self):
        """The last non-empty line of stdout and of stderr: how far a run got."""
        return [
            f"last {name} line: {lines[-1][:300]!r}" if lines else f"nothing on {name}"
            for name, text in (("stdout", self.stdout), ("stderr", self.stderr))
            for lines in [[line for line in text.splitlines() if line.strip()]]
        ]

    def __str__(self):
        state = "TIMED OUT" if self.timed_out else f"exit code {self.returncode}"
        if self.timed_out and self.seconds is not None:  # how far it got, before the output
            state += f" after {self.seconds:.1f} s; " + "; ".join(self.last_lines())
        if self.rank_codes is not None:
            state += f", ranks exited with {self.rank_codes}"
        return (
            f"$ {' '.join(self.command)}\n({state})\n"
            f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"
        )


_runs = count()  # numbers the runs of this process (RUN_MARK)
_held = []  # the sockets that hold the ports handed out, open for the life of this test process


def free_port(hold=True):
    """A free port of 127.0.0.1. hold=True keeps a socket bound to it (not listening, SO_REUSEADDR)
    for the life of this process: the OS then hands the port to no other process (bind to port 0, or
    the local end of a connection), so nothing can take it before the launched job listens on it,
    seconds later (torch's TCPStore sets SO_REUSEADDR too, so it can bind the port all the same).
    hold=False for programs that do not set SO_REUSEADDR."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    if hold:
        _held.append(s)
        return s.getsockname()[1]
    with s:
        return s.getsockname()[1]


def repository_files(name):
    """The repository's files called `name`, in every folder but hidden ones (.git, .venv) and
    venvs of any name (a folder holding pyvenv.cfg, or conda-meta for conda), whose packages bring
    READMEs and Python files of their own."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".")
            and not os.path.exists(os.path.join(folder, d, "pyvenv.cfg"))
            and not os.path.isdir(os.path.join(folder, d, "conda-meta"))
        )
        if name in files:
            found.append(Path(folder) / name)
    return found


def lesson_env(extra=None):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DIST_", "TORCHELASTIC_", "SLURM_"))
    }
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        env.pop(key, None)
    # Deprecations are shown (once per place), the rest of the warnings not: assert_ok fails a run
    # that printed one, so a rename in the next torch is caught the day it lands (see DEPRECATION).
    env.update(
        PYTHONUNBUFFERED="1",
        PYTHONWARNINGS="ignore,default::DeprecationWarning,default::FutureWarning",
    )
    # The CPU suite stays on the CPU on a GPU node too (tests/test_gpu.py hands the GPUs back).
    env.update(CUDA_VISIBLE_DEVICES="")
    # Scripts that start `torchrun` or `python3` by name (launch/*.sh) get this interpreter's: under
    # venv/bin/python -m pytest with the venv not activated, PATH finds another torch's or none.
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", os.defpath)])
    env.update(extra or {})
    return env


def log_launch(kind, command, wall_s, cpu_s):
    """With TEST_LAUNCH_LOG=file, every launch of the suite appends one line there (to count them
    and see where the suite's time goes): kind, wall seconds, CPU seconds of its processes, the
    test that launched it, command."""
    if os.environ.get("TEST_LAUNCH_LOG"):
        test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
        with open(os.environ["TEST_LAUNCH_LOG"], "a") as f:
            f.write(f"{kind} {wall_s:.1f} {cpu_s:.1f} {test} {' '.join(map(str, command))}\n")


def _children_cpu_s():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# Every process a run starts inherits this variable, with a value of its own per run: torchrun
# starts each rank in a session of its own (start_new_session=True in torch's
# distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py, 2.13 and 2.14.1),
# so killing torchrun's process group leaves the ranks running, holding the output pipes open, and
# a rank whose torchrun died is no longer its descendant: the mark still finds it.
RUN_MARK = "HARNESS_RUN_ID"


def _proc_table():
    """pid -> parent pid of every process that has not ended, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                table[int(entry)] = int(fields[1])
    return table


def _marked(pid, mark):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return mark in f.read().split(b"\0")
    except OSError:
        return False


def run_processes(root, mark):
    """The processes of one run: root, its descendants, and every process whose environment holds
    the run's mark."""
    table, found = _proc_table(), set()
    todo = [root] if root in table else []
    todo += [pid for pid in table if pid != os.getpid() and _marked(pid, mark)]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += [child for child, parent in table.items() if parent == pid]
    return found


def end_run(root, mark, rounds=50):
    """SIGKILL every process of a run. Each is stopped first (SIGSTOP) and the search repeated
    until it finds no new one, so that none forks or loses its parent while it is looked for."""
    stopped = set()
    for _ in range(rounds):
        new = run_processes(root, mark) - stopped
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        stopped |= new
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return stopped


def run_command(command, timeout=120, env=None, cwd=ROOT):
    """Run command in its own session; on timeout kill it and every process it started (end_run),
    then keep the output it wrote before."""
    start, cpu = time.monotonic(), _children_cpu_s()
    mark = f"{os.getpid()}-{next(_runs)}-{time.time_ns()}"
    proc = subprocess.Popen(
        [str(c) for c in command],
        cwd=cwd,
        env={**lesson_env(env), RUN_MARK: mark},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        end_run(proc.pid, f"{RUN_MARK}={mark}".encode())
        try:  # bounded: a process that cleared its environment and left torchrun's tree may remain
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            for pipe in (proc.stdout, proc.stderr):
                pipe.close()
            proc.wait()
            out, err = "", "(the output pipes stayed open after the kill: output lost)\n"
        timed_out = True
    seconds = time.monotonic() - start
    # the CPU logged: of the processes this call waited for
    log_launch(
        "python"
        if "--nproc" in map(str, command)
        else "torchrun"
        if "torch.distributed.run" in map(str, command)
        else "other",
        command,
        seconds,
        _children_cpu_s() - cpu,
    )
    return Result([str(c) for c in command], proc.returncode, out, err, timed_out, seconds=seconds)


def torchrun_command(lesson, nproc, args=()):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(ROOT / lesson),
        *args,
    ]


def run_lesson(lesson, *args, nproc=2, launcher="torchrun", timeout=120, env=None):
    """launcher: "torchrun", "python" (the lesson spawns --nproc ranks itself) or "warm" (torchrun's
    behaviour and environment, ranks forked from a process with torch imported; with the variable
    WARM_LAUNCHER=0 such runs use real torchrun instead, to compare)."""
    if launcher == "warm" and os.environ.get("WARM_LAUNCHER") == "0":
        launcher = "torchrun"
    if launcher == "warm":
        import warm_launcher  # tests/ is on sys.path (conftest.py)

        start = time.monotonic()
        result = Result(
            *warm_launcher.run(
                ROOT / lesson, args, nproc=nproc, env=lesson_env(env), cwd=ROOT, timeout=timeout
            )
        )
        # the run's own seconds: a server start (once per pytest process) is not the run's
        result.seconds = time.monotonic() - start - warm_launcher.last_server_s
        # the CPU logged: the ranks' (the warm launcher counts it)
        log_launch(
            "warm",
            [lesson, f"--nproc_per_node={nproc}", *args],
            time.monotonic() - start,
            warm_launcher.last_cpu_s or 0.0,
        )
        return result
    if launcher == "torchrun":
        command = torchrun_command(lesson, nproc, args)
    elif launcher == "python":
        command = [sys.executable, str(ROOT / lesson), "--nproc", str(nproc), *args]
        # Every lesson outside primitives/ and launch/ builds an optimizer, DDP or a mesh, each of
        # which imports torch._dynamo in every rank (measured): the forkserver imports it once.
        if Path(lesson).parent.name not in ("primitives", "launch"):
            env = {"DIST_PRELOAD": "torch._dynamo", **(env or {})}
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    return run_command(command, timeout=timeout, env=env)


def mutant(tmp_path, lesson, *changes, file=None):
    """A copy of `lesson`'s folder under tmp_path in which `file` (default: the lesson itself; else
    a sibling such as "model.py") has each (old, new) change made; returns the copy of the lesson,
    to hand to run_lesson. This is how the suite shows a check failing when the lesson is wrong: the
    mistake a reader could make is written into a copy, never behind a flag in the lesson. Each
    `old` must occur exactly once in the file, so a change to the lesson that moves the text fails
    here."""
    source = ROOT / lesson
    copy = Path(tempfile.mkdtemp(dir=tmp_path)) / source.parent.name
    shutil.copytree(source.parent, copy, ignore=shutil.ignore_patterns("__pycache__", "*.md"))
    target = copy / (file or source.name)
    text = target.read_text()
    for old, new in changes:
        count = text.count(old)
        assert count == 1, (
            f"{old!r} occurs {count} times in {(source.parent / target.name)}, not once"
        )
        text = text.replace(old, new)
    target.write_text(text)
    return copy / source.name


def ok_lines(result):
    return [line for line in result.stdout.splitlines() if line.startswith("OK")]


# A warning line as Python prints it: "<file>:<line>: FutureWarning: <message>". torch's
# deprecations of distributed calls are raised inside its c10d_logger wrapper, so the file named is
# torch's, not the lesson's: every such line fails the run, whoever's code it names.
DEPRECATION = re.compile(r"^\S+:\d+: (FutureWarning|DeprecationWarning): .*$", re.M)


def assert_ok(result, deprecated_on_purpose=None):
    """Exit code 0, no time-out, no deprecation warning, and exactly one line starting with OK;
    returns that line. `deprecated_on_purpose`: a regex for the one deprecation a test runs on
    purpose (the legacy launcher's own), which must then appear; any other still fails the run."""
    assert not result.timed_out and result.returncode == 0, str(result)
    warnings = [m.group(0) for m in DEPRECATION.finditer(result.stderr)]
    if deprecated_on_purpose:
        assert any(re.search(deprecated_on_purpose, w) for w in warnings), (
            f"no {deprecated_on_purpose}\n{result}"
        )
        warnings = [w for w in warnings if not re.search(deprecated_on_purpose, w)]
    assert not warnings, f"the run uses something deprecated in this torch: {warnings[0]}\n{result}"
    lines = ok_lines(result)
    assert len(lines) == 1, f"expected one OK line, got {lines}\n{result}"
    return lines[0]


def assert_fails(result, message, within=None, stops_others=False):
    """Non-zero exit, no hang, and message printed (once per rank if `within` names the ranks;
    on 1 to `within` ranks under torchrun, or where stops_others says the launcher stops them)."""
    assert not result.timed_out, f"hung instead of failing\n{result}"
    assert result.returncode != 0, f"expected a failure\n{result}"
    assert message in result.output, f"expected {message!r} in the output\n{result}"
    assert not ok_lines(result), f"a failed run must not print OK\n{result}"
    if within is not None:
        count = sum(message in line for line in result.output.splitlines())
        # torchrun stops the other ranks as soon as one exits, so some may never get to print
        stops_others |= "torch.distributed.run" in result.command or WARM in result.command
        low = 1 if stops_others else within
        assert low <= count <= within, (
            f"expected {message!r} on {within} ranks, saw it {count} times\n{result}"
        )
