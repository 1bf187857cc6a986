"""Printing from several ranks: rank-prefixed lines, rank-0-only lines, lines gathered and printed
in rank order. Re-exported by launch/dist_setup.py (lessons import them from there)."""

import os
import sys

import torch.distributed as dist


def _rank():
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def _tag():
    return f"[rank {_rank()}]"


def _write(text):
    # One write call per message: print(a, b) makes a write per argument and one for the newline,
    # and with unbuffered output (python -u, PYTHONUNBUFFERED) the ranks' pieces mix on a shared
    # terminal or pipe. A single write of up to 4 KiB to a pipe is never split (POSIX PIPE_BUF).
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def print_rank(*values):
    """Print one line prefixed with this rank."""
    _write(" ".join(map(str, (_tag(), *values))))


def print0(*values):
    """Print on rank 0 only."""
    if _rank() == 0:
        _write(" ".join(map(str, values)))


def print_in_order(*values, group=None):
    """Every rank of group calls this; its first rank prints all lines in rank order."""
    text = "\n".join(f"{_tag()} {line}" for line in " ".join(map(str, values)).splitlines() or [""])
    first = dist.get_global_rank(group, 0) if group is not None else 0
    lines = [None] * dist.get_world_size(group) if dist.get_rank() == first else None
    dist.gather_object(text, lines, dst=first, group=group)  # pickles: fine between our own ranks
    if lines is not None:
        _write("\n".join(lines))
