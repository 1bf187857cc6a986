"""Errors that name the rank and the line. When a rank raises under torchrun, the agent stops the
others and prints a summary of every failed rank. What it can say comes from a file: @record on the
entry point writes the rank's uncaught exception (type, message, traceback to the line) as JSON to
TORCHELASTIC_ERROR_FILE, a path torchrun gives each rank; the summary prints that traceback under
the rank. Without @record it says only "To enable traceback see: .../elastic/errors.html".

    torchrun --nproc_per_node=3 launch/record_errors.py                  # runs and checks itself
    torchrun --nproc_per_node=3 launch/record_errors.py --fail-rank 1    # rank 1 raises at step 3
    torchrun --nproc_per_node=3 --log-dir logs --tee 3 launch/record_errors.py --fail-rank 1
    torchrun --nproc_per_node=3 --local-ranks-filter 1 launch/record_errors.py --fail-rank 1

--fail-rank R is the demonstration: rank R's data is corrupt at step --fail-step. --log-dir DIR
keeps each rank's error.json (and with --redirects 3 its stdout and stderr, --tee 3: there and on
the console) in a folder per rank; --local-ranks-filter 1 shows local rank 1 alone on the console
and drops the others' output unless --tee or --redirects keeps it in files (torch 2.13).
run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/elastic/errors.html
"""

import argparse
import json
import os
import tempfile
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from launch.dist_setup import int_in, lesson_parser, print0, run


@record  # this rank's uncaught exception goes to TORCHELASTIC_ERROR_FILE, then torchrun's summary
def main(args, ctx):
    ctx.require(
        args.fail_rank is None or args.fail_rank < ctx.world_size,
        f"--fail-rank {args.fail_rank}: there are ranks 0 to {ctx.world_size - 1}",
    )
    total = torch.zeros(1, dtype=torch.int64, device=ctx.device)
    for step in range(args.steps):
        batch = load_batch(step, ctx.rank, args)
        mine = torch.tensor([sum(batch)], dtype=torch.int64, device=ctx.device)
        dist.all_reduce(mine)  # a rank that raised never joins: the others fail here
        total += mine
    check_total(total.item(), args, ctx)
    error, where = check_what_record_writes(args, ctx)
    print0(f"OK: {args.steps} steps on {ctx.world_size} rank(s), the total equals the serial sum; "
           f"@record's error file holds '{error}' and its line, {where}")  # fmt: skip


def load_batch(step, rank, args):
    """This rank's samples of one step (integers standing for a data set)."""
    if rank == args.fail_rank and step == args.fail_step:  # the demonstration
        raise ValueError(f"sample {100 * step + rank} of the data set is corrupt")
    return [100 * step + rank + i for i in range(args.batch)]


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_total(total, args, ctx):
    expected = sum(100 * s + r + i for s in range(args.steps) for r in range(ctx.world_size)
                   for i in range(args.batch))  # fmt: skip
    if total != expected:
        raise RuntimeError(f"the all_reduced total {total} is not the serial sum {expected}")


def check_what_record_writes(args, ctx):
    """@record around a call that raises, with TORCHELASTIC_ERROR_FILE pointed at a file of our
    own: the JSON torchrun reads must name the exception and the line that raised it."""
    line = next(n for n, text in enumerate(open(__file__), 1) if "raise ValueError(" in text)
    where = f'{os.path.basename(__file__)}", line {line}, in load_batch'
    corrupt = argparse.Namespace(**{**vars(args), "fail_rank": ctx.rank, "fail_step": 0})
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "error.json")
        with mock.patch.dict(os.environ, {"TORCHELASTIC_ERROR_FILE": path}):
            try:
                record(load_batch)(0, ctx.rank, corrupt)
            except ValueError:
                pass
        with open(path) as file:
            written = json.load(file)["message"]  # {"message", "extraInfo": {"py_callstack"...}}
    if where not in written["extraInfo"]["py_callstack"]:
        raise RuntimeError(f"@record's file does not name {where}: {written}")
    return written["message"], f"{os.path.basename(__file__)}, line {line}"


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--steps", type=int_in(1, 10_000), default=5)
    parser.add_argument("--batch", type=int_in(1, 10_000), default=4, help="samples per rank")
    parser.add_argument("--fail-rank", type=int_in(0, 4095),
                        help="the demonstration: this rank raises at --fail-step")  # fmt: skip
    parser.add_argument("--fail-step", type=int_in(0, 10_000), default=3)
    run(main, parser.parse_args())
