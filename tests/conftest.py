import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))  # so tests can `import harness`


def pytest_sessionstart(session):
    # Subprocesses that start `torchrun` or `python` by name (launch/*.sh, srun, the netns tests)
    # find this interpreter's first: the suite then needs no activated venv.
    bin_dir = os.path.dirname(sys.executable)
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    # The lessons import launch.dist_setup from the editable install of this repository.
    try:
        import launch.dist_setup as module
    except ImportError:
        pytest.exit(
            "launch.dist_setup is not importable: run `pip install -r requirements.txt` first", 2
        )
    if Path(module.__file__).resolve().parents[1] != ROOT:
        pytest.exit(
            f"`launch` is imported from {module.__file__}, not this checkout: "
            "run `pip install -r requirements.txt` here",
            2,
        )


def pytest_addoption(parser):
    # The GPU tiers of tests/test_gpu.py (see its docstring and CONTRIBUTING.md)
    for name, what in (
        ("--gpu", "the node check: every lesson on NCCL at the node's GPUs and at 2 (minutes)"),
        ("--gpu-full", "every lesson at every world size up to the GPUs, every Gloo-on-CUDA case"),
        ("--gpu-scale", "the GPU-scale commands the READMEs advertise (memory and time stated)"),
    ):
        parser.addoption(name, action="store_true", help=f"GPU mode, tests/test_gpu.py: {what}")
    parser.addoption(
        "--gpu-runs",
        metavar="FILE",
        help="GPU mode: write each run's id, status, seconds and last output line to FILE (TSV)",
    )


GPU_RUNS = []  # the --gpu-runs file, in the process that receives the reports (not an xdist worker)


def pytest_configure(config):
    if config.getoption("--gpu-runs") and not hasattr(config, "workerinput"):
        GPU_RUNS.append(config.getoption("--gpu-runs"))
        with open(GPU_RUNS[0], "w") as f:
            f.write("id\tstatus\tseconds\trun_s\tlast\n")


def pytest_runtest_logreport(report):
    """--gpu-runs: one line per GPU run, written where the reports arrive (with pytest-xdist, the
    controller): id, status, seconds of the test, seconds of its runs (a warm server's start left
    out), and its last line (a failure's on stdout and stderr, an expected failure's reason)."""
    if not GPU_RUNS or "test_gpu.py::test_gpu[" not in report.nodeid:
        return
    if report.when != "call" and not (report.when == "setup" and report.outcome != "passed"):
        return
    props = dict(report.user_properties)
    status = "xfailed" if hasattr(report, "wasxfail") else report.outcome
    if status == "xfailed":
        last = report.wasxfail
    elif status == "skipped":
        last = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    else:  # a failure: how far it got on both streams
        last = "; ".join(
            props.get(name, "") for name in ("stdout", "stderr")[: 1 + (status == "failed")]
        )
    case = report.nodeid.split("[", 1)[1].rstrip("]")
    fields = [case, status, f"{report.duration:.1f}", props.get("run_s", ""), last]
    with open(GPU_RUNS[0], "a") as f:
        f.write("\t".join(" ".join(str(x).split()) for x in fields) + "\n")


def _workers_asked(config):
    """-n / --numprocesses on the command line (pyproject.toml's addopts do not count)."""
    return any(
        arg.startswith(("-n", "--numprocesses")) or arg == "--dist"
        for arg in map(str, config.invocation_params.args)
    )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which turns the count into workers
def pytest_cmdline_main(config):
    """On one GPU the GPU tiers pick their own workers (tests/test_gpu.py, plan). Not in a worker:
    it would start workers of its own."""
    if not hasattr(config, "workerinput") and any(
        config.getoption(name) for name in ("--gpu", "--gpu-full", "--gpu-scale")
    ):
        import test_gpu

        workers, _ = test_gpu.plan(config)
        if workers and not _workers_asked(config):
            config.option.numprocesses = workers
        config.gpu_workers = config.option.numprocesses if workers else 1


def gpu_tier_lines(config):
    """tests/test_gpu.py's run count and time estimate per chosen tier."""
    if any(config.getoption(name) for name in ("--gpu", "--gpu-full", "--gpu-scale")):
        import test_gpu

        return test_gpu.collection_report(config)
    return []


def pytest_report_header(config):  # shown by xdist's controller too; -q hides the header, so:
    return gpu_tier_lines(config) if config.option.verbose >= 0 else []


def pytest_report_collectionfinish(config):  # after "collected N items", -q and --collect-only
    return gpu_tier_lines(config) if config.option.verbose < 0 else []


# Tests that share a session-scoped run (or one Slurm cluster, or network namespaces) stay on one
# pytest-xdist worker (--dist loadgroup in pyproject.toml), so that run is made once.
SHARED_FIXTURES = ("whole_run", "checkpoint_2_ranks", "print_env_3", "slurm")


# before pytest-xdist's own hook, which reads the marks into the test ids
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        shared = [f for f in SHARED_FIXTURES if f in getattr(item, "fixturenames", ())]
        # one cluster; several GPUs run one lesson at a time (on one GPU runs share it)
        if item.module.__name__ == "test_launch_cluster" or (
            item.module.__name__ == "test_gpu" and item.module.gpu_count() != 1
        ):
            shared = [item.module.__name__]
        if shared:
            item.add_marker(pytest.mark.xdist_group(shared[0]))
    # A group runs on one worker, one test after another: start the groups first, so that the
    # longest of them (train.py's runs, a few minutes) does not begin near the end and keep one
    # worker busy alone.
    items.sort(key=lambda item: not any(item.iter_markers("xdist_group")))
