"""primitives/debug_server.py (issue 43): torch's debug server read while a job hangs.

- The OK line at 2 ranks (`python lesson.py --nproc 2`) and 3 (warm launcher, rank 0 the stuck one:
  its watchdog thread reads the pages while its main thread sleeps); the watchdog's lines name the
  stuck rank and the line where each rank waits.
- The mistakes the check must catch, each a source mutation of a copy (tests/harness.mutant): the
  rank ahead named instead of the rank behind; the sleep put on another rank than the one asked;
  --stuck-rank ignored (the check compares with what the reader asked, not with what main made of
  it).
- Refusals in one line on every rank: 1 rank; --late not below --stall; the front end's packages
  missing (tabulate hidden from the ranks); a --port another program listens on.
- The page in a real browser: headless Chromium opens the front end's /stacks while the job hangs,
  saves a screenshot and dumps the DOM after the page ran; the stuck rank's section shows its sleep
  line, the others' their all_reduce. Skipped with its reason where Chromium is missing
  (.ci/install_system_packages.sh installs Debian's `chromium`).

Every run passes --port with a free port: the front end's default, 25999, is one per machine.
"""

import importlib.util
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from harness import (
    RUN_MARK,
    ROOT,
    assert_fails,
    assert_ok,
    end_run,
    free_port,
    lesson_env,
    mutant,
    run_command,
    run_lesson,
)

LESSON = "primitives/debug_server.py"
T = 240  # seconds: a 10 s hang, a spawned front end and ranks importing torch, on a loaded machine
SOURCE = (ROOT / LESSON).read_text().splitlines()


def line_no(text):
    """The line of the lesson that holds `text` (once)."""
    found = [i + 1 for i, line in enumerate(SOURCE) if text in line]
    assert len(found) == 1, (text, found)
    return found[0]


SLEEP = f"debug_server.py:{line_no('time.sleep(args.stall)')} in load_batch"
ALL_REDUCE = f"debug_server.py:{line_no('dist.all_reduce(grad)')} in main"


# The front end's packages (requirements-debug.txt; .ci/run installs them): without them the lesson
# refuses to start, which only the test of that refusal expects.
MISSING = [name for name in ("aiohttp", "jinja2", "tabulate") if not importlib.util.find_spec(name)]
needs_packages = pytest.mark.skipif(
    bool(MISSING), reason=f"no {' '.join(MISSING)}: pip install -r requirements-debug.txt"
)


def port():
    return str(free_port(hold=False))  # the front end's server does not set SO_REUSEADDR on ::


# The runs that must read the pages hang 20 s, not the default 10: in a full run on 2 cores the
# front end's pages (which ask every rank) can take seconds to answer.
STALL = ("--stall", "20")


@needs_packages
@pytest.mark.parametrize(
    "nproc, launcher, stuck",
    [pytest.param(2, "python", None, marks=pytest.mark.quick), (3, "warm", 0)],
)
def test_the_pages_name_the_stuck_rank(nproc, launcher, stuck):
    args = ["--port", port(), *STALL] + (["--stuck-rank", str(stuck)] if stuck is not None else [])
    result = run_lesson(LESSON, *args, nproc=nproc, launcher=launcher, timeout=T)
    stuck = nproc - 1 if stuck is None else stuck
    line = assert_ok(result)
    assert line.startswith(f"OK: the debug server's pages named rank {stuck}, the rank asked"), line
    assert re.search(
        rf"^\[watchdog\] no step for [\d.]+ s; behind: rank {stuck}$", result.stdout, re.M
    )
    for rank in range(nproc):
        at = SLEEP if rank == stuck else ALL_REDUCE
        issued = 3 if rank == stuck else 4  # a broadcast, --hang-step 2 all_reduces, the third
        want = f"[watchdog] rank {rank}: issued collective #{issued}, waits at {at}: "
        assert want in result.stdout, result


MISTAKES = {
    # the rank that issued the most collectives named: the one ahead, not the one behind
    "the-rank-ahead-named": (
        ("behind=min(issued, key=issued.get)", "behind=max(issued, key=issued.get)"),
        "the pages name rank 0; rank 1 was to hang",
        (),
    ),
    # the sleep on rank 0 whatever --stuck-rank says: the pages name rank 0, the reader asked 1
    "another-rank-stalled": (
        ("stalls=ctx.rank == stuck", "stalls=ctx.rank == 0"),
        "the pages name rank 0; rank 1 was to hang",
        (),
    ),
    # --stuck-rank ignored: the last rank hangs, and main's `stuck` agrees with it
    "stuck-rank-ignored": (
        (
            "stuck = ctx.world_size - 1 if args.stuck_rank is None else args.stuck_rank",
            "stuck = ctx.world_size - 1",
        ),
        "the pages name rank 1; rank 0 was to hang",
        ("--stuck-rank", "0"),
    ),
}


@needs_packages
@pytest.mark.parametrize("mistake", MISTAKES)
def test_mistakes_fail_the_check(mistake, tmp_path):
    change, message, args = MISTAKES[mistake]
    copy = mutant(tmp_path, LESSON, change)
    result = run_lesson(copy, "--port", port(), *STALL, *args, nproc=2, launcher="warm", timeout=T)
    assert_fails(result, message)


@needs_packages
def test_one_rank_and_a_watchdog_slower_than_the_hang_are_refused():
    result = run_lesson(LESSON, "--port", port(), nproc=1, launcher="warm", timeout=60)
    assert_fails(result, "needs at least 2 ranks", within=1)
    result = run_lesson(
        LESSON, "--port", port(), "--late", "30", nproc=2, launcher="warm", timeout=60
    )
    assert_fails(result, "needs --late < --stall < --timeout", within=2)


# Each rank runs the lesson with tabulate made unfindable (its spec None: find_spec says so), as in
# an environment where only requirements.txt was installed (jinja2 comes with torch: its METADATA).
WITHOUT_TABULATE = """
    import importlib.util, runpy, sys
    find_spec = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: None if name == "tabulate" else find_spec(name, *a)
    sys.argv = [LESSON, *sys.argv[1:]]
    runpy.run_path(LESSON, run_name="__main__")
"""


@needs_packages
def test_missing_packages_are_named_with_the_command_that_installs_them(tmp_path):
    wrapper = tmp_path / "without_tabulate.py"
    wrapper.write_text(
        textwrap.dedent(WITHOUT_TABULATE).replace("LESSON", repr(str(ROOT / LESSON)))
    )
    result = run_lesson(wrapper, "--port", port(), nproc=2, launcher="warm", timeout=60)
    assert_fails(result, "error: needs tabulate: pip install tabulate", within=2)
    assert "Traceback" not in result.output, result


@needs_packages
def test_a_port_in_use_is_refused_on_every_rank(tmp_path):
    """Another program listens on --port: refused before the front end starts (which would die,
    and rank 0 would wait out its --timeout for it), one line on every rank, nothing written."""
    with socket.socket(socket.AF_INET6) as other:
        other.bind(("::1", 0))
        other.listen()
        held = other.getsockname()[1]
        result = run_lesson(LESSON, "--port", str(held), nproc=2, launcher="warm", timeout=60)
    assert_fails(result, f"--port {held} is in use on rank 0's machine: pass another", within=2)
    assert "Traceback" not in result.output, result


# ---- the page in a browser ------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def listening_address(port):
    """The local address of the socket listening on `port`, from /proc/net/tcp6 (IPv6 and, on a
    dual-stack socket, IPv4 too): 32 zeros is "::", every interface."""
    with open("/proc/net/tcp6") as f:
        rows = [line.split() for line in f.read().splitlines()[1:]]
    return [
        r[1].split(":")[0] for r in rows if r[3] == "0A" and int(r[1].split(":")[1], 16) == port
    ]


def dom_sections(dom):
    """{rank: text} of the rendered /stacks page: each "Rank N: ..." heading and the text after."""
    text = re.sub(r"<[^>]+>", "", dom)
    parts = re.split(r"^\s*Rank (\d+): \S+\s*$", text, flags=re.M)
    return {int(rank): body for rank, body in zip(parts[1::2], parts[2::2])}


@needs_packages
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: apt-get install chromium")
def test_the_stacks_page_in_headless_chromium(tmp_path):
    """The job hangs for 30 s; meanwhile Chromium renders http://127.0.0.1:PORT/stacks."""
    front = int(port())
    command = [sys.executable, ROOT / LESSON, "--nproc", "2", "--port", front, "--stall", "30"]
    mark = f"debug-server-browser-{os.getpid()}-{time.time_ns()}"
    proc = subprocess.Popen(
        [str(c) for c in command],
        cwd=ROOT,
        env={**lesson_env(), RUN_MARK: mark},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout])
    reader.start()
    seen = []
    try:
        deadline = time.monotonic() + 120
        while not any("[watchdog] no step for" in line for line in seen):
            assert time.monotonic() < deadline, "the watchdog did not report:\n" + "".join(seen)
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                assert proc.poll() is None, "the job ended before it hung:\n" + "".join(seen)
        # The job hangs now (rank 1 sleeps for 30 s from 2 s ago).
        shot = tmp_path / "stacks.png"
        browser = run_command(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1100,1400",
             f"--screenshot={shot}", "--dump-dom", f"http://127.0.0.1:{front}/stacks"],
            timeout=60, cwd=tmp_path,
        )  # fmt: skip
        assert browser.returncode == 0 and not browser.timed_out, str(browser)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
        shown = dom_sections(browser.stdout)
        assert sorted(shown) == [0, 1], browser.stdout[-3000:]
        sleep_line = SLEEP.replace("debug_server.py:", 'debug_server.py", line ')
        reduce_line = ALL_REDUCE.replace("debug_server.py:", 'debug_server.py", line ')
        assert sleep_line in shown[1] and sleep_line not in shown[0], shown
        assert reduce_line in shown[0] and reduce_line not in shown[1], shown
        # What the README says about the front end, checked while it runs:
        # it listens on every interface ("::", dual-stack), not only on 127.0.0.1 ...
        assert listening_address(front) == ["0" * 32], listening_address(front)
        # ... and on Gloo its flight-record table fails (torch 2.13: the group recorded unnamed)
        if torch.__version__.startswith("2.13"):
            with pytest.raises(urllib.error.HTTPError) as failed:
                urllib.request.urlopen(f"http://127.0.0.1:{front}/fr_trace", timeout=60)
            assert failed.value.code == 500 and "KeyError(('0', 0))" in str(failed.value.reason)
        # The job then ends by itself, within the hang's 30 s and its teardown.
        proc.wait(timeout=T)
    finally:
        end_run(proc.pid, f"{RUN_MARK}={mark}".encode())  # nothing of the run outlives the test
        reader.join(timeout=30)  # the pipe closes once every process of the run has ended
    while not lines.empty():
        seen.append(lines.get())
    result = "".join(seen)
    assert proc.returncode == 0, result
    assert re.search(r"^OK: the debug server's pages named rank 1", result, re.M), result
