"""The warm launcher (tests/warm_launcher.py) is as strict as torchrun: a failing rank stops the
others and fails the run, a hanging rank is killed at the time-out with every process of its run,
every rank's output is captured, and each rank sees what a torchrun worker sees."""

import json
import os
import signal
import sys
import textwrap
import time

import pytest

import warm_launcher
from harness import RUN_MARK, WARM, assert_fails, assert_ok, run_lesson


def script(tmp_path, body, name="script.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def alive(pid):
    """True while pid is a process that has not ended (a zombie waiting to be reaped has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def group_members(pgid):
    """Live processes whose process group is pgid, found through /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                found.append(int(entry))
    return found


def wait_until_gone(pids, seconds=10):
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


# Each rank writes its view to a file of its own: two ranks printing ~4 KB lines into one pipe can
# interleave (print writes the text and the newline separately), which broke this test once under
# load.
DUMP = """
    import json, os, sys
    view = dict(env=dict(os.environ), argv=sys.argv, orig_argv=sys.orig_argv[1:], path=sys.path,
                cwd=os.getcwd(), name=__name__, file=__file__)
    with open(os.path.join(os.path.dirname(__file__), f"view{os.environ['RANK']}.json"), "w") as f:
        json.dump(view, f)
"""


def test_environment_is_torchrun_s(tmp_path):
    """Same variables, values, argv, sys.path and cwd per rank as real torchrun (only the port and
    the error file's temporary folder differ)."""
    path = script(tmp_path, DUMP)
    views = {}
    for launcher in ["torchrun", "warm"]:
        result = run_lesson(path, "--flag", "x y", nproc=2, launcher=launcher, env={"MY_VAR": "1"})
        assert result.returncode == 0, result
        files = sorted(tmp_path.glob("view*.json"))
        views[launcher] = sorted(
            (json.loads(f.read_text()) for f in files), key=lambda view: int(view["env"]["RANK"])
        )
        for f in files:
            f.unlink()
    assert len(views["warm"]) == len(views["torchrun"]) == 2
    for rank, (real, warm) in enumerate(zip(views["torchrun"], views["warm"])):
        for view in (real, warm):
            assert view["env"]["RANK"] == str(rank) and view["env"]["MY_VAR"] == "1"
            assert (
                view["env"].pop("TORCHELASTIC_ERROR_FILE").endswith(f"/attempt_0/{rank}/error.json")
            )
            assert view["env"].pop("MASTER_PORT").isdigit()
        assert real["env"].pop(RUN_MARK)  # the harness's mark on a real run (harness.end_run)
        assert warm == real
    assert views["warm"][0]["argv"] == [str(path), "--flag", "x y"]
    assert views["warm"][0]["path"][0] == str(tmp_path.resolve())
    assert views["warm"][0]["name"] == "__main__"


def test_print_env_takes_the_torchrun_path():
    ok = assert_ok(run_lesson("launch/print_env.py", nproc=3, launcher="warm"))
    assert "3 rank(s) on 1 node(s) via torchrun" in ok


def test_lesson_runs_and_is_marked_warm():
    result = run_lesson("primitives/broadcast.py", nproc=3, launcher="warm")
    assert assert_ok(result) == "OK: broadcast copied rank 0's tensor to all 3 ranks"
    assert WARM in result.command and result.rank_codes == [0, 0, 0]


def test_usage_error_is_one_line_on_one_to_every_rank():
    """A rank that exits with a message stops the run; the other rank prints its line or is
    stopped."""
    result = run_lesson(
        "primitives/hello_distributed.py", "--backend", "nccl", nproc=2, launcher="warm"
    )
    assert_fails(result, "error: NCCL needs one CUDA GPU per rank", within=2)
    assert "Traceback" not in result.output, result
    assert 1 in result.rank_codes and set(result.rank_codes) <= {1, -signal.SIGTERM}, result


def test_failing_rank_stops_the_others(tmp_path):
    path = script(
        tmp_path,
        """
        import os, signal, sys, time
        rank = int(os.environ["RANK"])
        print(f"rank {rank} started", flush=True)
        if rank == 1:
            time.sleep(0.5)
            sys.exit(3)
        if rank == 2:  # ignores SIGTERM: must get SIGKILL after the grace period
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)
    """,
    )
    start = time.monotonic()
    result = run_lesson(path, nproc=3, launcher="warm", timeout=120)
    elapsed = time.monotonic() - start
    assert not result.timed_out and result.returncode == 1, result
    assert result.rank_codes == [-signal.SIGTERM, 3, -signal.SIGKILL], result
    assert elapsed < 60, result  # stopped after GRACE_S, not at the time-out
    assert all(f"rank {r} started" in result.stdout for r in range(3)), result
    assert "rank 1 failed first (exit code 3)" in result.stderr, result


def test_hanging_run_is_killed_at_timeout_with_every_process(tmp_path):
    """The ranks and a child process they started are gone after the time-out."""
    path = script(
        tmp_path,
        """
        import os, subprocess, sys, time
        pids = [os.getpid()]
        if os.environ["RANK"] == "0":
            sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
            pids.append(subprocess.Popen(sleeper).pid)
        # one write: print() writes piece by piece, and two ranks' pieces mixed on the pipe once
        sys.stdout.write(" ".join(map(str, ["pids", os.getpgid(0), *pids])) + "\\n")
        sys.stdout.flush()
        time.sleep(600)
    """,
    )
    start = time.monotonic()
    result = run_lesson(path, nproc=2, launcher="warm", timeout=8)
    assert result.timed_out and result.returncode != 0, result
    assert time.monotonic() - start < 40, result
    # the report says how far the run got: its seconds (the server's start not counted) and last
    # lines, first
    state = str(result).splitlines()[1]
    assert 8 <= result.seconds < 20 and f"TIMED OUT after {result.seconds:.1f} s" in state, state
    assert "last stdout line: 'pids " in state and "nothing on stderr" in state, state
    lines = [
        list(map(int, line.split()[1:]))
        for line in result.stdout.splitlines()
        if line.startswith("pids")
    ]
    assert len(lines) == 2, result  # output before the kill is kept
    group = lines[0][0]
    pids = [pid for line in lines for pid in line[1:]]
    assert len(pids) == 3 and group not in pids
    assert wait_until_gone(pids + [group]) == [], f"still running: {pids} {result}"
    assert group_members(group) == []


HANG = """
    import os, subprocess, sys, time
    pids = [os.getpid()]
    if os.environ["RANK"] == "0":
        sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
        pids.append(subprocess.Popen(sleeper).pid)
    # one write: print() writes piece by piece, and two ranks' pieces mixed on the pipe once
    sys.stdout.write(" ".join(map(str, ["pids", os.getpgid(0), *pids])) + "\\n")
    sys.stdout.flush()
    time.sleep(600)
"""


def test_hanging_torchrun_run_is_ended_at_its_limit_with_every_process(tmp_path):
    """Real torchrun starts each rank in a session of its own: the run still ends within seconds of
    its limit, with torchrun, both ranks and a rank's child gone (it took 100.8 s for an 8 s limit
    when only torchrun's process group was killed)."""
    # 60 s: torchrun (importing torch) and both ranks must have printed before the limit; with
    # 20 s, in a full run on a loaded 2-core machine, rank 0 had not printed yet once
    path, limit = script(tmp_path, HANG), 60
    start = time.monotonic()
    result = run_lesson(path, nproc=2, launcher="torchrun", timeout=limit)
    took = time.monotonic() - start
    assert result.timed_out and result.returncode != 0, result
    assert took < limit + 8, f"returned {took:.1f} s after the start, limit {limit} s\n{result}"
    lines = [
        list(map(int, line.split()[1:]))
        for line in result.stdout.splitlines()
        if line.startswith("pids")
    ]
    assert len(lines) == 2, result  # both ranks ran, and their output before the kill is kept
    groups = {line[0] for line in lines}
    pids = [pid for line in lines for pid in line[1:]]
    assert len(pids) == 3 and len(groups) == 2, result  # two ranks, two sessions (torchrun's)
    assert wait_until_gone(pids) == [], f"still running: {pids}\n{result}"
    assert all(group_members(group) == [] for group in groups)


def test_output_of_every_rank_is_captured(tmp_path):
    """Every line of every rank, on both streams, more than a pipe holds. (One write per line:
    print() writes the text and the newline separately, so ranks' lines can mix, as under
    torchrun.)"""
    path = script(
        tmp_path,
        """
        import os, sys
        rank = int(os.environ["RANK"])
        for i in range(3000):
            sys.stdout.write(f"out {rank} {i}\\n")
            sys.stderr.write(f"err {rank} {i}\\n")
    """,
    )
    result = run_lesson(path, nproc=3, launcher="warm")
    assert result.returncode == 0, result
    for rank in range(3):
        for stream, text in [("out", result.stdout), ("err", result.stderr)]:
            assert [line for line in text.splitlines() if line.startswith(f"{stream} {rank} ")] == [
                f"{stream} {rank} {i}" for i in range(3000)
            ]


@pytest.mark.parametrize(
    "ending, code, printed",
    [
        ("raise ValueError('boom')", 1, "ValueError: boom"),
        ("sys.exit('exit message')", 1, "exit message"),
        ("sys.exit(4)", 4, ""),
        ("sys.stdout.write('no newline at the end')", 0, "no newline at the end"),
        (
            "import threading, time; "
            "threading.Thread(target=lambda: (time.sleep(1), print('joined'))).start()",
            0,
            "joined",
        ),
        ("import atexit; atexit.register(print, 'at exit')", 0, "at exit"),
    ],
)
def test_a_rank_ends_as_python_would(tmp_path, ending, code, printed):
    path = script(tmp_path, f"import sys\n{ending}\n")
    result = run_lesson(path, nproc=1, launcher="warm")
    assert result.rank_codes == [code] and printed in result.output, result
    assert result.output.count("Traceback") == (1 if "raise" in ending else 0), result
    if "raise" in ending:  # the traceback starts at the script, as `python script.py` prints it
        assert "warm_launcher" not in result.stderr.split("warm_launcher: rank")[0], result
        assert "runpy" not in result.stderr, result


def test_env_overrides_and_startup_variables(tmp_path):
    """env= reaches every rank; a variable read at interpreter start-up gets a server of its own."""
    path = script(
        tmp_path,
        """
        import os
        # one write call for the whole line: with PYTHONUNBUFFERED even print(s) makes two, s and
        # then "\\n" (strace), and two ranks' pieces mixed on the shared pipe ("0 7 ...1 7 ...", "")
        # in a full run
        line = f'{os.environ["RANK"]} {os.environ.get("DIST_TIMEOUT")} {hash("warm")}\\n'
        os.write(1, line.encode())
    """,
    )
    seeded = [
        run_lesson(path, nproc=2, launcher="warm", env={"DIST_TIMEOUT": "7", "PYTHONHASHSEED": "5"})
        for _ in range(2)
    ]
    lines = {line for result in seeded for line in result.stdout.splitlines()}
    expected = {f"{rank} 7 {hash_under_seed(5)}" for rank in range(2)}
    assert lines == expected, seeded


def hash_under_seed(seed):
    import subprocess

    return int(
        subprocess.check_output(
            [sys.executable, "-c", "print(hash('warm'))"],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            text=True,
        )
    )


def test_server_is_single_threaded_and_restarts_after_it_died(tmp_path):
    path = script(tmp_path, "print('hello')\n")
    assert run_lesson(path, nproc=1, launcher="warm").stdout == "hello\n"
    servers = list(warm_launcher._servers.values())
    assert servers and all(server.threads == 1 for server in servers)  # see "Fork safety"
    for server in servers:
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
    result = run_lesson(path, nproc=1, launcher="warm")
    assert result.returncode == 0 and result.stdout == "hello\n", result


# A deprecated call as torch makes one: typing_extensions.deprecated under a wrapper of the
# library's own (distributed_c10d.py's @_exception_logger over @deprecated, torch 2.13 and 2.14.1),
# so the warning names the library's file, not the lesson's. Written here, not taken from torch:
# what torch marks deprecated changes between releases (2.15 no longer marks
# all_gather_into_tensor).
LIBRARY = """
    import functools
    from typing_extensions import deprecated

    def _exception_logger(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            return func(*args, **kwargs)
        return wrapper

    @_exception_logger
    @deprecated("`old_gather` is deprecated. Please use `new_gather` instead.", category=CATEGORY)
    def old_gather(x):
        return x
"""

LESSON = """
    \"\"\"Calls a deprecated function of a library, then prints OK.\"\"\"
    from fake_torch import old_gather
    from launch.dist_setup import lesson_parser, print0, run

    def main(args, ctx):
        print0(f"OK: gathered {old_gather([1.0])}")

    if __name__ == "__main__":
        run(main, lesson_parser(__doc__).parse_args())
"""


@pytest.mark.parametrize("category", ["FutureWarning", "DeprecationWarning"])
def test_a_deprecated_call_fails_the_run(tmp_path, category):
    """A lesson that calls something deprecated prints its OK line, and assert_ok fails it all the
    same: the next rename in torch shows up in the suite at once."""
    script(tmp_path, LIBRARY.replace("CATEGORY", category), name="fake_torch.py")
    result = run_lesson(script(tmp_path, LESSON), nproc=1, launcher="warm")
    assert result.returncode == 0 and "OK: gathered [1.0]" in result.stdout, result
    with pytest.raises(
        AssertionError,
        match=rf"deprecated in this torch: \S*fake_torch.py:\d+: {category}: `old_gather`",
    ):
        assert_ok(result)
