"""Every lesson, started at 1 rank, at the world size below its smallest legal one, and with each
flag at an end of its range, either runs or is refused up front: one line on every rank, a non-zero
exit code, no traceback, no hang, and nothing written.

By mechanism, for every lesson that tests/lesson_cli.lessons() finds (a new lesson is covered
without editing this file, or fails here until it is):
- the world size: the lesson is started at 1, 2, 3 and 4 ranks until one is accepted; that one is
  its smallest legal size, and it must be what its parser declares (`lesson_parser(...,
  min_ranks=K)`, what `python lesson.py` starts on a CPU); each size below it must be refused.
- the flags: every flag that takes a number gets each end of the range its type declares (parsed
  from the type's name, `an integer in [1, 100]`, as --help shows it; a range open at 0 gets its
  end's neighbour 1e-6); every store_true flag is set; every choice other than the default is
  given; each alone, at the lesson's smallest legal size. Left out: the set-up flags (--nproc,
  --timeout, --backend, --device) and flags that take a path or a free string.
- a start is cheap: tests/start_probe.py runs the lesson in ranks forked by the warm launcher and
  stops it, as accepted, once main has passed its last call that refuses, at its first call that
  communicates with another rank, or after CPU_S seconds of CPU in main; a lesson that refuses
  does so before (launch/dist_setup.py's ctx.require). Each start runs in an empty folder with an
  empty TMPDIR, which a refused start must leave empty; the output paths the lessons name by
  default are relative, so they land there.

What this does not show: that an accepted start runs correctly to its end (the lessons' own tests
run each lesson at its world sizes, 1 among them where it is legal; the top of a range is sized for
GPUs: 10**6 steps, widths of 16384); a refusal after the first communication, or after CPU_S
seconds, is seen as an accepted start. A lesson whose main calls nothing named *require*, nor a
function of its folder that does (the collectives of primitives/, ddp_minimal.py, ...), is
stopped as main begins: it refuses nothing up front, so every start of it is accepted here.
"""

import atexit
import importlib.util
import math
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

import warm_launcher
from harness import ROOT, lesson_env, mutant
from lesson_cli import lesson_parser, lessons

PROBE = Path(__file__).resolve().with_name("start_probe.py")
TIMEOUT = 90
# A refusal comes up front, before a lesson sets to work. So a rank of a start that has spent CPU_S
# seconds of CPU in main without refusing or communicating (a lesson that times one process first,
# builds data) has started its work: it is stopped there (SIGPROF) and the start counts as
# accepted. Each rank may allocate GIB GiB more than the warm launcher's fork of torch: past that, a
# start at the top of a range counts as too big to start on this machine (TOO_BIG_STARTS), anywhere
# else it fails.
GIB, CPU_S = 2, 0.25
TOO_BIG = re.compile(r"can't allocate memory|MemoryError|std::bad_alloc|Cannot allocate memory")
TOO_BIG_HERE = "too big to start here"
TOO_BIG_STARTS = []
RANKS_CPU_S = []  # the CPU of each start's ranks (the warm launcher counts it), to measure the cost
SETUP_FLAGS = {"--nproc", "--timeout", "--backend", "--device", "--help"}
MAX_WORLD = 4
# Lessons this test cannot start as it starts the others, each with the reason and the test that
# covers its refusals instead. A lesson not in lessons() here fails test_exceptions_are_lessons.
NOT_PROBED = {
    # its own mp.spawn / mp.Process children: the probe would stop only the parent
    "launch/spawn_template.py": "tests/test_launch.py",
    # two jobs that meet on --sync-host:--sync-port: one alone waits for the other
    "primitives/weight_sync_two_jobs.py": "tests/test_weight_sync.py",
    # refuses, on purpose, every launcher whose agent shares its store, as the warm launcher does
    # (see its docstring); it is started its own way there, a damaged checkpoint included
    "launch/elastic.py": "tests/test_damaged_checkpoints.py",
    # one process, no group; it needs train.py's model.pt and refuses without one (in one line)
    "transformer_basics/generate.py": "tests/test_damaged_checkpoints.py",
    # its own launcher, refused under any other (RANK set): its refusals are tested there
    "launch/fault_tolerant_ddp.py": "tests/test_fault_tolerant.py",
}
_BASE = tempfile.mkdtemp(prefix="start_probe_")
atexit.register(shutil.rmtree, _BASE, ignore_errors=True)
RANGE = re.compile(r"in ([\[(])(\S+), (\S+)\]$|from (\S+) to (\S+) \(")


def range_ends(kind):
    """The two ends of a ranged type's declared range, as command-line text (None: not ranged)."""
    found = RANGE.search(getattr(kind, "__name__", ""))
    if not found:
        return None
    if found.group(4):  # benchmark_collectives' sizes in bytes: "from 1 to 16G (K, M, G)"
        return [found.group(4), found.group(5)]
    bracket, low, high = found.group(1, 2, 3)
    if bracket == "(":  # open at low: the nearest value above it that the type takes
        low = repr(float(low) + max(1e-6, abs(float(low)) * 1e-6))
    return [low, high]


def flag_vectors(parser):
    """(what, argv, at the top of a range) for each flag at each end of its range, each store_true
    flag, each choice."""
    vectors = []
    for action in parser._actions:
        name = (action.option_strings or [""])[-1]
        if not action.option_strings or name in SETUP_FLAGS:
            continue
        if action.nargs == 0:
            if action.const is True:  # store_true
                vectors.append((name, [name], False))
        elif action.choices:
            others = [c for c in action.choices if c != action.default]
            vectors += [(f"{name} {c}", [name, c], False) for c in others]
        elif (ends := range_ends(action.type)) is not None:
            vectors += [(f"{name} {end}", [name, end], end == ends[1]) for end in ends]
    return vectors


def start(lesson, argv, nproc):
    """One start of the lesson through start_probe.py: (verdict, what it printed), where verdict is
    "accepted", "ok" (ran to its OK line), "refused", or a string that says what went wrong."""
    # Folders of its own per start, emptied after it but kept: the warm launcher's server keeps
    # the working directory and TMPDIR of its first start (all are removed at exit).
    top = Path(tempfile.mkdtemp(dir=_BASE))
    cwd, tmp, peers = (top / name for name in ("cwd", "tmp", "peers"))
    for folder in (cwd, tmp, peers):
        folder.mkdir()
    env = lesson_env(dict(PROBE_TMPDIR=str(tmp), PROBE_PEERS=str(peers), PROBE_GIB=str(GIB)))
    env.update(PROBE_CPU_S=str(CPU_S))
    _, code, out, err, timed_out, codes = warm_launcher.run(
        str(PROBE), [str(ROOT / lesson), *argv], nproc, env, str(cwd), TIMEOUT
    )
    # torch makes its compile cache folder in TMPDIR when torch._dynamo is first imported
    # (torch/_inductor/runtime/cache_dir_utils.py, 2.13): torch's doing, not the lesson's
    made = [p for p in (*cwd.rglob("*"), *tmp.rglob("*")) if "torchinductor_" not in str(p)]
    written = sorted(str(p.relative_to(top)) for p in made)
    RANKS_CPU_S.append(warm_launcher.last_cpu_s or 0.0)
    for folder in (*tmp.iterdir(), *peers.iterdir(), *cwd.iterdir()):
        shutil.rmtree(folder) if folder.is_dir() and not folder.is_symlink() else folder.unlink()
    output = f"$ {lesson} {' '.join(argv)} at {nproc} rank(s): exit codes {codes}\n{out}{err}"
    return verdict(out, err, nproc, code, timed_out, codes or [], written), output


def verdict(out, err, nproc, code, timed_out, codes, written):
    if timed_out:
        return f"hung (no end within {TIMEOUT} s)"
    if TOO_BIG.search(err):
        return TOO_BIG_HERE
    if "Traceback" in out + err:
        return "a traceback"
    # still at work after CPU_S seconds; the others then stopped by the launcher (SIGTERM)
    working = [c == -signal.SIGPROF for c in codes]
    stopped = [c in (0, -signal.SIGPROF, -signal.SIGTERM) for c in codes]
    if code == 0 or (any(working) and all(stopped)):
        if any(line.startswith("OK") for line in out.splitlines()):
            return "ok"
        if any(working) or out.count("PROBE: rank") == nproc:
            return "accepted"
        return "exit 0 without an OK line"
    errors = [line for line in err.splitlines() if re.search(r"\berror\b", line)]
    errors = [line for line in errors if not line.startswith("warm_launcher:")]
    by_rank = {m.group(1) for line in errors if (m := re.match(r"\[rank (\d+)\] error:", line))}
    if any(c == 0 for c in codes):
        return f"refused on some ranks only (exit codes {codes})"
    if not errors:
        return "failed without an error line"
    if by_rank and by_rank != {str(r) for r in range(nproc)} or len(errors) > nproc:
        return f"not one error line per rank: {errors}"
    if written:
        return f"refused, but wrote {written}"
    return "refused"


def check_world_sizes(lesson, parser):
    """(the smallest world size that starts, problems, their outputs): 1, 2, ... until one starts;
    each size below must be refused, and the parser's min_ranks must name the one that starts."""
    problems, outputs = [], []
    for nproc in range(1, MAX_WORLD + 1):
        said, output = start(lesson, [], nproc)
        if said in ("accepted", "ok"):
            declared = parser.get_default("min_ranks")
            if declared is not None and declared != nproc:
                problems.append(f"the smallest world size that starts is {nproc}, its parser says "
                                f"min_ranks={declared}")  # fmt: skip
                outputs.append(output)
            return nproc, problems, outputs
        if said != "refused":
            problems.append(f"{nproc} rank(s): {said}")
            outputs.append(output)
    return None, problems or [f"no world size up to {MAX_WORLD} starts"], outputs


def check(lesson):
    """Every problem of lesson's starts, one line each; and their outputs."""
    parser = lesson_parser(lesson)
    smallest, problems, outputs = check_world_sizes(lesson, parser)
    if smallest is None:
        return problems, outputs

    def note(what, said, output):
        problems.append(f"{what}: {said}")
        outputs.append(output)

    for what, argv, top in flag_vectors(parser):
        said, output = start(lesson, argv, smallest)
        if said == TOO_BIG_HERE and top:
            TOO_BIG_STARTS.append(f"{lesson} {what}")
        elif said not in ("accepted", "ok", "refused"):
            note(f"{what} at {smallest} rank(s)", said, output)
    return problems, outputs


# debug_server.py refuses every start without its front end's packages (requirements-debug.txt),
# as it should: without them its starts are not probed (tests/test_debug_server.py skips too)
NO_DEBUG_PACKAGES = [n for n in ("aiohttp", "tabulate") if not importlib.util.find_spec(n)]


@pytest.mark.parametrize("lesson", [lesson for lesson in lessons() if lesson not in NOT_PROBED])
def test_every_start_runs_or_is_refused_in_one_line(lesson):
    if lesson == "primitives/debug_server.py" and NO_DEBUG_PACKAGES:
        pytest.skip(f"{lesson} needs {', '.join(NO_DEBUG_PACKAGES)}: pip install -r "
                    "requirements-debug.txt")  # fmt: skip
    problems, outputs = check(lesson)
    for start_ in TOO_BIG_STARTS:  # shown by pytest -rP
        if start_.startswith(f"{lesson} "):
            print(f"too big to start here (more than {GIB} GiB a rank): {start_}")
    assert not problems, "\n".join([f"{lesson}:", *problems, "", *outputs])[-8000:]


def test_exceptions_are_lessons():
    """NOT_PROBED names lessons that exist, each with the test that covers it."""
    for lesson, test in NOT_PROBED.items():
        assert lesson in lessons() and (ROOT / test).is_file(), (lesson, test)


def test_range_ends_are_read_from_the_types():
    from launch.dist_setup import float_in, int_in

    assert range_ends(int_in(1, 100)) == ["1", "100"]
    # a lesson's own list type (ring_all_reduce.py's ints_in: comma-separated integers)
    sizes = next(
        a for a in lesson_parser("primitives/ring_all_reduce.py")._actions if a.dest == "sizes"
    )
    assert range_ends(sizes.type) == ["1", str(1 << 30)]
    assert range_ends(float_in(0, 10, low_open=True)) == ["1e-06", "10"]
    assert float(range_ends(float_in(0, 10, low_open=True))[0]) > 0
    assert math.isclose(float(range_ends(float_in(0.5, 600))[0]), 0.5)
    assert os.path.isfile(PROBE)


# ---- the checks above fail when a lesson is wrong: a reader's mistakes, each in a copy ----


def test_a_refusal_written_as_an_assert_is_a_traceback(tmp_path):
    lesson = "ddp_basics/ddp_uneven_inputs.py"
    assert start(lesson, [], 1)[0] == "refused"
    copy = mutant(
        tmp_path, lesson, ("ctx.require(ctx.world_size >= 2,", "assert (ctx.world_size >= 2),")
    )
    assert start(copy, [], 1)[0] == "a traceback"


def test_a_lesson_that_needs_a_peer_and_does_not_say_so(tmp_path):
    """Without its world-size refusal, flight_recorder.py starts at 1 rank (and fails late, with a
    traceback): its parser's min_ranks=2 no longer matches the smallest size that starts."""
    lesson = "primitives/flight_recorder.py"
    old = (
        'ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: one of them breaks the pattern")'
    )
    copy = mutant(tmp_path, lesson, (old, "pass"))
    _, problems, _ = check_world_sizes(copy, lesson_parser(copy))
    assert problems == ["the smallest world size that starts is 1, its parser says min_ranks=2"]


def test_a_refused_run_that_made_its_output_folder_first(tmp_path):
    lesson, argv = "transformer_basics/train.py", ["--resume"]
    assert start(lesson, argv, 1)[0] == "refused"
    early = "    out = Path(args.out)\n"
    copy = mutant(tmp_path, lesson, (early, early + "    out.mkdir(parents=True, exist_ok=True)\n"))
    said = start(copy, argv, 1)[0]
    assert said == "refused, but wrote ['cwd/runs', 'cwd/runs/gpt']", said
