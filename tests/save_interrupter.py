"""Runs launch/preemption.py (or a copy) with torch.save wrapped, to interrupt one of its saves.

    warm_launcher.run("tests/save_interrupter.py", [LESSON, MODE, N, *ARGS], nproc=..., ...)

Each rank runs LESSON as __main__ with ARGS. At the N-th call of torch.save in its process (only
rank 0 saves):
- MODE signal: the rank sends itself SIGTERM as the call begins (a real signal, delivered while
  the save is in progress: Python runs the handler at once, in this wrapper), then saves;
- MODE kill: the rank saves, cuts the file it wrote to half its length and SIGKILLs itself before
  the call returns, as a kill mid-write leaves a file (the lesson never gets to its rename).
The lesson holds no hook for this (tests/test_preemption.py).
"""

import os
import runpy
import signal
import sys

import torch


def main():
    lesson, mode, nth, *args = sys.argv[1:]
    real, calls = torch.save, []

    def save(obj, f, *rest, **kwargs):
        calls.append(f)
        if len(calls) != int(nth):
            return real(obj, f, *rest, **kwargs)
        if mode == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
            return real(obj, f, *rest, **kwargs)
        real(obj, f, *rest, **kwargs)
        os.truncate(f, os.path.getsize(f) // 2)
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save
    sys.argv = [lesson, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(lesson))
    runpy.run_path(lesson, run_name="__main__")


if __name__ == "__main__":
    main()
