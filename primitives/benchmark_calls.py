"""The calls that benchmark_collectives.py (a tool) times, each with the closed form of its result.

Rank r's input holds value(r, i) = i % 7 + r + 1 at index i, so every result element is a small
integer known in closed form; fill and first_wrong work chunk by chunk, on the device, so that no
temporary is as large as the message (up to 8G on a GPU).
"""

import sys

import torch
import torch.distributed as dist
from tqdm import tqdm

CHUNK = 1 << 22  # elements per step of fill and check: their temporaries stay near 0.3 GB


def value(r, i):
    """Rank r's input at index i (a tensor of indices): small integers, so every sum is exact."""
    return i % 7 + r + 1


def fill(buf, r):
    """Write rank r's input into buf, chunk by chunk: no temporary the size of the message."""
    flat = buf.view(-1)
    for start in range(0, flat.numel(), CHUNK):
        idx = torch.arange(start, min(start + CHUNK, flat.numel()), device=flat.device)
        flat[start : start + idx.numel()] = value(r, idx)


def first_wrong(result, expected, rtol):
    """(index, got, want) of the first element of result unlike expected(index), or None."""
    flat = result.view(-1)
    for start in range(0, flat.numel(), CHUNK):
        idx = torch.arange(start, min(start + CHUNK, flat.numel()), device=flat.device)
        got, want = flat[start : start + idx.numel()].double(), expected(idx).double()
        bad = (
            ~((got - want).abs() <= rtol * want.abs())
        ).nonzero()  # written so that a NaN counts as wrong
        if bad.numel():
            i = bad[0].item()
            return start + i, got[i].item(), want[i].item()
    return None


def make_call(op, count, dtype, device, rank, n):
    """(result, input, call, expected) for one message of `count` elements (count % n == 0):
    expected(i) is what result[i] must hold, in closed form (None where it is undefined). At most
    twice the message."""
    part, right, left = count // n, (rank + 1) % n, (rank - 1) % n
    out = torch.empty(part if op == "reduce_scatter" else count, dtype=dtype, device=device)
    in_place = op in ("all_reduce", "broadcast", "reduce")
    inp = (
        out
        if in_place
        else torch.empty(part if op == "all_gather" else count, dtype=dtype, device=device)
    )

    def total(i):  # the sum over ranks r of value(r, i)
        return n * (i % 7) + n * (n + 1) // 2

    def sendrecv():  # every rank sends right and receives from the left, in one batch (NCCL-safe)
        for work in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, inp, right), dist.P2POp(dist.irecv, out, left)]
        ):
            work.wait()

    (
        call,
        expected,
    ) = {  # size = all_gather's output, reduce_scatter's input: rank r's part is at r * part
        "all_reduce": (lambda: dist.all_reduce(out), total),
        "all_gather": (
            lambda: dist.all_gather_single(out, inp),
            lambda i: value(i // part, i % part),
        ),
        "reduce_scatter": (
            lambda: dist.reduce_scatter_single(out, inp),
            lambda i: total(rank * part + i),
        ),
        "broadcast": (lambda: dist.broadcast(out, src=0), lambda i: value(0, i)),
        "reduce": (
            lambda: dist.reduce(out, dst=0),
            total if rank == 0 else None,
        ),  # defined on the root only
        "all_to_all": (
            lambda: dist.all_to_all_single(out, inp),  # block j of my input goes to rank j
            lambda i: value(i // part, rank * part + i % part),
        ),  # block s of my output came from s
        "sendrecv": (sendrecv, lambda i: value(left, i)),
    }[op]
    return out, inp, call, expected


def tolerance(dtype, n):
    """Every value a result holds is an integer no larger than all_reduce's 6n + n(n+1)/2. A float
    type holds every integer up to 2^(mantissa bits + 1) = 2 / eps exactly, so up to there any sum
    is exact and the check bit for bit (float32: any sane n; bfloat16: n <= 17; float16: n <= 58).
    Beyond, each of a reduction's n-1 additions may round by half an ulp: n * eps bounds the
    relative error."""
    eps = torch.finfo(dtype).eps
    return 0.0 if 6 * n + n * (n + 1) // 2 <= 2 / eps else n * eps


def sweep(ops, sizes, rank):
    """Every (op, size), op by op; on rank 0 a tqdm bar on stderr when it is a terminal (None)."""
    return tqdm([(op, size) for op in ops for size in sizes], "sizes", disable=rank != 0 or None)


def row(text):
    """Rank 0 prints a line of the table through tqdm.write: on a terminal it clears the bar, prints
    the line and draws the bar again below it, so the two never share a line."""
    if dist.get_rank() == 0:
        tqdm.write(text)
        sys.stdout.flush()
