"""The GPU tiers of tests/test_gpu.py, checked on the CPU (in this process, nothing launched but one
row tried on Gloo with CPU tensors, and the Gloo-with-CUDA crash's stages on CPU tensors): the node
check fits its 5 minutes on one GPU with 16 cores and its 25 minutes on an 8-GPU node by its
budgets (tests/gpu_budgets.py), holds every lesson, and every tier is well formed (unique ids,
world sizes within the node, flags the lessons parse, outputs in tmp, each lesson started the way
it can start).
"""

import dataclasses
import re
from pathlib import Path

import gloo_cuda_crash as crash
import gpu_budgets
import pytest
import test_gpu as gpu
from harness import run_lesson
from lesson_cli import lesson_parser, lessons, parse

ROOT = Path(__file__).resolve().parents[1]
SIZES = (1, 2, 4, 8)
LAUNCHERS = {"torchrun", "warm", "python", "elastic", "two_jobs", "command", "stages"}


def test_node_check_fits_its_budget_on_8_gpus():
    cases = gpu.node_check(gpu.NODE_GPUS)
    runs, seconds = gpu.estimate(cases)
    largest = sorted(cases, key=lambda c: -c.budget)[:5]
    assert seconds <= gpu.NODE_BUDGET_S, (
        f"the node check at {gpu.NODE_GPUS} GPUs: {runs} runs, {seconds:.0f} s of budgets, over "
        f"{gpu.NODE_BUDGET_S} s. Move a run to --gpu-full (NODE_GLOO, NODE_PYTHON), or lower a "
        f"budget that a GPU run has measured lower. Largest: "
        + ", ".join(f"{c.id} {c.budget:g} s" for c in largest)
    )


def test_node_check_fits_5_minutes_on_one_gpu(monkeypatch):
    """`pytest --gpu` at one GPU on 16 cores: all its runs (none skips), planned on the workers
    the budgets were measured at, within ONE_GPU_BUDGET_S, and the printed plan says so."""
    monkeypatch.setenv("GPU_TEST_DEVICES", "1")
    monkeypatch.setenv("GPU_TEST_CPUS", str(gpu.ONE_GPU_CORES))
    workers, _ = gpu.plan(Options("--gpu"))
    cases = gpu.node_check(1)
    assert gpu.runnable(["--gpu"], 1) == cases  # every run runs at one GPU
    seconds = gpu.plan_seconds(cases, workers)
    assert workers == gpu.MEASURED_WORKERS and seconds <= gpu.ONE_GPU_BUDGET_S, (workers, seconds)
    (line,) = [line for line in gpu.collection_report(Options("--gpu")) if "plan" in line]
    assert f"about {seconds / 60:.1f} min" in line, line


def test_every_budget_comes_from_a_measurement_where_there_is_one():
    """A run measured as it now runs has that figure; a run measured under another launcher has
    the figure less or plus the imports that launcher pays (measured), never less than the
    lesson's own warm run on that GPU, and a limit of at least 1.5x what it took as measured
    (it passes under torchrun too, WARM_LAUNCHER=0); the rest
    are named in gpu_budgets.UNMEASURED."""
    measured = gpu_budgets.RUN_5 | gpu_budgets.RUN_8
    for case in gpu.node_check(1):
        if case.source == "measured":
            table = gpu_budgets.RUN_5 if case.id in gpu_budgets.RUN_5 else gpu_budgets.RUN_8
            assert case.budget == table[case.id][0], case
        elif case.source == "derived":
            assert case.id in measured or case.id.startswith("other-"), case
            assert case.floor >= case.budget >= gpu_budgets.MIN_RUN_S, case
            assert case.limit >= gpu_budgets.FLOOR * measured.get(case.id, (0.0,))[0], case
        else:
            assert case.source == "unmeasured", case
            assert case.id in gpu_budgets.UNMEASURED or case.id == "other-dist_device_cuda", case
        if case.id.startswith("nccl-1-") and case.launcher == "warm":
            assert case.source != "measured", f"{case.id}: measured under torchrun, not warm"


def test_torchrun_once_per_folder_the_rest_warm():
    """One lesson per folder keeps real torchrun in the node check (a reader's launch); the other
    NCCL runs are warm, but a lesson's own launch (elastic.py), at every size."""
    folders = {lesson.split("/")[0] for lesson in gpu.LESSONS}
    assert sorted(lesson.split("/")[0] for lesson in gpu.TORCHRUN) == sorted(folders)
    for gpus in SIZES:
        for case in gpu.node_check(gpus):
            if case.id.startswith("nccl-"):
                own = gpu.LESSONS[case.lesson].get("launch")
                top = case.lesson in gpu.TORCHRUN and case.nproc == min(gpus, gpu.MAX_WORLD)
                expected = own or ("torchrun" if top else "warm")
                assert case.launcher == expected, (gpus, case.id, case.launcher)


def test_every_lesson_is_in_the_node_check():
    covered = {case.lesson for case in gpu.node_check(gpu.NODE_GPUS)}
    missing = [lesson for lesson in lessons() if lesson not in covered]
    rows = "\n".join(
        f'    "{lesson}": ANY,   # or dict(min_ranks=2, gloo_cuda=False, divides=48, extra=5); '
        'or nccl="why not" and a Case in other_cases()'
        for lesson in missing
    )
    assert not missing, (
        f"lessons the GPU node check does not run; add to LESSONS in tests/test_gpu.py:\n{rows}"
    )
    stale = [lesson for lesson in gpu.LESSONS if not (ROOT / lesson).exists()]
    assert not stale, f"rows of LESSONS in tests/test_gpu.py for files that are gone: {stale}"


@pytest.mark.parametrize("gpus", SIZES)
@pytest.mark.parametrize("tier", list(gpu.TIERS))
def test_tier_is_well_formed(tier, gpus):
    cases = gpu.TIERS[tier](gpus)
    assert cases, f"{tier} at {gpus} GPU(s) has no run"
    ids = [case.id for case in cases]
    assert len(ids) == len(set(ids)), (
        f"{tier}: ids repeat: {sorted(i for i in ids if ids.count(i) > 1)}"
    )
    for case in cases:
        where = f"{tier} at {gpus} GPU(s), {case.id}"
        if case.launcher == "stages":  # the suite's own script, not a lesson
            assert case.lesson == "tests/gloo_cuda_crash.py", where
            continue
        assert case.lesson in gpu.LESSONS, f"{where}: {case.lesson} has no row in LESSONS"
        assert case.launcher in LAUNCHERS, f"{where}: launcher {case.launcher!r}"
        assert case.budget > 0, f"{where}: no time budget"
        if tier != "--gpu-scale":  # the scale rows skip on a smaller node instead
            assert case.needs_gpus <= gpus, f"{where}: needs {case.needs_gpus} GPUs"
        if case.launcher in ("torchrun", "warm", "elastic") and "nccl" in case.args:
            assert case.nproc <= gpus, f"{where}: {case.nproc} NCCL ranks on {gpus} GPUs"
    if tier == "--gpu":  # each NCCL lesson at the largest size it allows, and at 2
        top = min(gpus, gpu.MAX_WORLD)
        for lesson, spec in gpu.LESSONS.items():
            sizes = [c.nproc for c in cases if c.lesson == lesson and c.id.startswith("nccl-")]
            allowed = gpu._sizes(spec, top)
            if "nccl" not in spec and allowed:
                expected = sorted({allowed[-1], *([2] if 2 in allowed else [])})
                assert sorted(sizes) == expected, f"{lesson}: NCCL at {sizes}, not {expected}"


def test_scale_rows_state_what_they_need():
    for case in gpu.scale(gpu.NODE_GPUS):
        assert case.memory_gib > 0 and case.needs_gpus >= 1 and case.budget > 0, case


def tier_commands():
    """(lesson, args) -> its first case id: the runs with flags beyond --backend and --device."""
    seen = {}
    for tier in gpu.TIERS.values():
        for case in tier(gpu.NODE_GPUS):
            if case.launcher in ("two_jobs", "command", "stages"):
                continue
            plain = set(case.args) <= {"--backend", "nccl", "gloo", "--device", "cuda", "cpu"}
            out = gpu.LESSONS[case.lesson].get("out")
            if not (plain and not out):
                seen.setdefault((case.lesson, case.args), case.id)
    return seen


def test_runs_with_flags_parse():
    """Each run's flags (and its tmp output path) parse with its lesson's parser: a renamed flag
    fails here, not on a GPU node (the plain runs' flags are tests/test_flags.py's)."""
    parsers = {}
    for (lesson, args), case_id in tier_commands().items():
        parser = parsers.get(lesson) or parsers.setdefault(lesson, lesson_parser(lesson))
        out = gpu.LESSONS[lesson].get("out")
        argv = [*args, *([out, "/tmp/x"] if out else [])]
        code, output, _ = parse(parser, argv)
        assert code == 0, f"{case_id}: {lesson} {' '.join(argv)}: {output}"


# a flag of an output path with a relative default: `"--dir", default="runs/..."`
RELATIVE_OUT = re.compile(r'"(--(?:out|dir|checkpoint|ckpt-dir))",\s*default="(?!/)[^"]+"')


def test_runs_write_only_to_tmp():
    """A lesson that writes under the checkout by default (an output flag with a relative default,
    or train.py's add_flags's --out) has `out` in its row: the GPU mode gives it a tmp path."""
    for lesson, spec in gpu.LESSONS.items():
        text = (ROOT / lesson).read_text()
        flags = RELATIVE_OUT.findall(text) + (["--out"] if "add_flags(parser)" in text else [])
        if flags and "nccl" not in spec:  # the nccl="..." lessons run in other_cases, paths given
            assert spec.get("out") == flags[0], (
                f"{lesson} writes under the checkout by default ({flags[0]}): give its row "
                f'out="{flags[0]}" in tests/test_gpu.py'
            )


@pytest.mark.parametrize("tier", list(gpu.TIERS))
def test_a_lesson_with_its_own_launch_gets_it(tier):
    """launch/elastic.py refuses torchrun's static rendezvous and the warm launcher (the agent's
    shared store): every torchrun-like run of a lesson whose row names a launch uses it (the
    `gloo-2-elastic` row ran under the warm launcher and failed on every machine)."""
    for case in gpu.TIERS[tier](gpu.NODE_GPUS):
        launch = gpu.LESSONS.get(case.lesson, {}).get("launch")  # the crash script: no row
        if launch and case.launcher in ("torchrun", "warm"):
            pytest.fail(f"{tier}: {case.id} runs under {case.launcher}, not {launch}")


def test_the_gloo_elastic_row_runs_on_cpu(tmp_path):
    """The --gpu-full row gloo-2-elastic, run as test_gpu.run_case runs it, on CPU tensors: elastic
    torchrun, the last rank dies at step 5, both restart and finish with the serial result."""
    (case,) = [c for c in gpu.full_matrix(gpu.NODE_GPUS) if c.id == "gloo-2-elastic"]
    args = tuple("cpu" if a == "cuda" else a for a in case.args)
    assert args != case.args  # it was the Gloo-with-CUDA row
    gpu.run_case(dataclasses.replace(case, args=args), tmp_path, env={}, real=0)


class Options:
    """What plan() and collection_report() read of pytest's config: the tier options."""

    def __init__(self, *chosen):
        self.chosen = chosen

    def getoption(self, name):
        return name in self.chosen


def test_makespan_gives_each_run_to_the_least_loaded_worker():
    assert gpu.makespan([3, 3, 2, 2, 2], 2) == 7  # 3+2+2 | 3+2
    assert gpu.makespan([5, 1, 1], 3) == 5 and gpu.makespan([5, 1, 1], 1) == 7
    assert gpu.makespan([5, 1, 1], 2, start=10) == 15  # each worker starts its warm server first


@pytest.mark.parametrize("cores, gpus, expected", [(16, 1, 5), (32, 1, 5), (8, 1, 2), (2, 1, 1),
                                                   (16, 8, 1)])  # fmt: skip
def test_one_gpu_plans_the_workers_its_budgets_were_measured_at(monkeypatch, cores, gpus, expected):
    """On one GPU, `pytest --gpu` takes as many workers as the budgets were measured at (5 runs on
    16 cores), fewer on fewer cores (each run keeps the cores it had); on several GPUs one run at
    a time. The plan and its minutes are printed."""
    monkeypatch.setenv("GPU_TEST_DEVICES", str(gpus))
    monkeypatch.setenv("GPU_TEST_CPUS", str(cores))
    workers, how = gpu.plan(Options("--gpu"))
    assert workers == expected, how
    (plan_line,) = [line for line in gpu.collection_report(Options("--gpu")) if "plan" in line]
    assert f"{workers} worker" in plan_line
    minutes = gpu.plan_seconds(gpu.node_check(gpus), workers) / 60
    assert f"about {minutes:.1f} min" in plan_line, plan_line


def test_the_crash_stages_run_on_cpu_and_a_native_crash_is_named(tmp_path):
    """tests/gloo_cuda_crash.py as the node check runs it, on CPU tensors: every stage gathers the
    right values; a segfault in a thread with no Python frame (what Gloo's worker thread did on
    torch 2.11 with CUDA tensors) is read as a crash naming the fault address, the faulting
    native frame and the Python frame the main thread was in."""
    (case,) = [case for case in gpu.node_check(1) if case.launcher == "stages"]
    gpu.RESULTS.clear()
    try:  # as the node check runs it (a longer limit: this machine is slower, and shared)
        gpu.run_case(dataclasses.replace(case, budget=40.0), tmp_path, env={}, real=0)
    except pytest.xfail.Exception as crashed:
        pytest.fail(f"a stage crashed on CPU tensors: {crashed}")
    assert [crash.read(s, r)[0] for s, r in zip(crash.STAGES, gpu.RESULTS)] == ["ok"] * 4
    result = run_lesson("tests/gloo_cuda_crash.py", crash.SELFTEST, "--device", "cpu", nproc=2,
                        launcher="warm", timeout=60)  # fmt: skip
    verdict, summary = crash.read(crash.SELFTEST, result)
    # rank 0 dies of SIGSEGV, rank 1 (asleep) of the launcher's SIGTERM
    codes = result.rank_codes or []
    assert verdict == "crashed" and -11 in codes and set(codes) <= {-11, -15}, str(result)
    assert "SIGSEGV at address 0x0 (in none of the stage's tensors)" in summary, summary
    assert "native frames: " in summary and "libc.so" in summary, summary
    assert "in crash_in_a_native_thread" in summary, summary
    assert "Fatal Python error: Segmentation fault" in result.stderr, result


def test_a_stage_is_read_as_ok_crashed_or_hung():
    """gloo_cuda_crash.read on outputs as the stages print them: both ranks' OK lines; a SIGSEGV
    with faulthandler's stack but no native report; the watchdog's dump of a hung rank."""
    from harness import Result

    def result(out, err, code, codes):
        return Result(["x"], code, out, err, False, codes)

    ok = "".join(f"[rank {r}] stage funcol_cpu ok: [0.0]\n" for r in range(2))
    assert crash.read("funcol_cpu", result(ok, "", 0, [0, 0]))[0] == "ok"
    stack = '  File "/x/_functional_collectives.py", line 138 in wait_tensor\n'
    verdict, summary = crash.read("funcol_all_gather", result(
        "", f"Fatal Python error: Segmentation fault\n\n{stack}", 1, [-11, -15]))  # fmt: skip
    assert verdict == "crashed" and "no native report" in summary, summary
    assert "line 138 in wait_tensor" in summary, summary
    hung = f"Timeout (0:00:05)!\nThread 0x1 (most recent call first):\n{stack}"
    verdict, summary = crash.read("dtensor_full_tensor", result("", hung, 1, [1, 1]))
    assert verdict == "failed" and "the watchdog ended a hung rank" in summary, summary
