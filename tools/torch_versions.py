"""Run the test suite on one torch release and print one row of CONTRIBUTING.md's "Which torch".

    python tools/torch_versions.py --torch 2.14.1 --quick
    python tools/torch_versions.py --torch 2.15.0 --commit 79462db --venv /tmp/t215 -- -n 2

It makes (or reuses) a venv, installs `torch==VERSION` there, then requirements.txt, pytest and
pytest-xdist (so it also shows that requirements.txt keeps that torch) and requirements-debug.txt as
.ci/run does, clones the repository at the commit into a temporary folder and runs
`VENV/bin/python -m pytest` there, the venv not activated. Arguments after `--` go to pytest. pip
picks the build: on Linux PyPI's torch is the CUDA build (several GB; it runs on a machine without
a GPU too), a local CPU wheel where pip's index has one. --no-pip-config ignores pip's
configuration files during the installs (for a release above a cap that a constraints file sets on
this machine).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def sh(*command, **kwargs):
    print("$", " ".join(map(str, command)), flush=True)
    return subprocess.run([str(c) for c in command], check=True, **kwargs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--torch", required=True, help="release to install, e.g. 2.14.1")
    parser.add_argument("--commit", default="HEAD", help="commit of --repo to test (HEAD)")
    parser.add_argument("--repo", default=REPO, type=Path, help="repository (this one)")
    parser.add_argument(
        "--venv", type=Path, help="venv to make or reuse (a temp folder per release)"
    )
    parser.add_argument("--quick", action="store_true", help="pytest -m quick, not the whole suite")
    parser.add_argument("--no-pip-config", action="store_true", help="PIP_CONFIG_FILE=/dev/null")
    parser.add_argument("pytest_args", nargs="*", help="after --: more arguments for pytest")
    args = parser.parse_args()

    venv = args.venv or Path(tempfile.gettempdir()) / f"torch-{args.torch}-venv"
    python = venv / "bin" / "python"
    pip_env = dict(os.environ, PIP_CONFIG_FILE=os.devnull) if args.no_pip_config else None
    commit = subprocess.check_output(
        ["git", "-C", str(args.repo), "rev-parse", "--short", args.commit], text=True
    ).strip()
    with tempfile.TemporaryDirectory(prefix=f"torch-{args.torch}-") as tmp:
        clone = Path(tmp) / "repo"
        sh("git", "clone", "-q", "--no-checkout", args.repo, clone)
        sh("git", "-C", clone, "checkout", "-q", commit)
        if not python.exists():
            sh(sys.executable, "-m", "venv", venv)
        pip = [python, "-m", "pip", "install", "-q"]
        sh(*pip, f"torch=={args.torch}", env=pip_env)
        sh(*pip, "-r", "requirements.txt", "pytest", "pytest-xdist", cwd=clone, env=pip_env)
        if (clone / "requirements-debug.txt").exists():  # debug_server.py's packages, as .ci/run
            sh(*pip, "-r", "requirements-debug.txt", cwd=clone, env=pip_env)
        build = subprocess.check_output(
            [python, "-c", "import torch; print(torch.__version__, torch.version.cuda or 'cpu')"],
            text=True,
        ).split()
        if build[0].split("+")[0] != args.torch:
            sys.exit(f"error: requirements.txt changed torch {args.torch} to {build[0]}")
        # Without PYTHONPATH and VIRTUAL_ENV: the suite must find its checkout and tools by itself.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        command = [python, "-m", "pytest", "-p", "no:cacheprovider"]
        command += ["-m", "quick"] * args.quick + args.pytest_args
        print("$", " ".join(map(str, command)), flush=True)
        start = time.monotonic()
        proc = subprocess.Popen(
            command, cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        summary = ""  # pytest's last line: "==== 3 failed, 318 passed, 2 skipped in 61.20s ===="
        for line in proc.stdout:
            print(line, end="", flush=True)
            if re.match(r"=+ .*\d+ (passed|failed|skipped|errors?)\b.* in [\d.]+s", line):
                summary = line
        code = proc.wait()
        wall = time.monotonic() - start
    counts = dict((word, int(n)) for n, word in re.findall(r"(\d+) (\w+)", summary))
    errors = counts.get("error", 0) + counts.get("errors", 0)
    print(
        f"torch {build[0]} ({'CPU' if build[1] == 'cpu' else 'CUDA ' + build[1]} build)"
        f" | commit {commit} | pytest {' '.join(map(str, command[5:])) or '(whole suite)'}"
        f" | {counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed,"
        f" {counts.get('skipped', 0)} skipped"
        + (f", {errors} errors" if errors else "")
        + f" | {wall / 60:.1f} min, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
        f" | {time.strftime('%Y-%m-%d')} | pytest exit {code}"
    )
    sys.exit(code)


if __name__ == "__main__":
    main()
