"""What a collective costs, measured: scatter against broadcast-then-slice, all_reduce against
all_gather-then-sum. Each pair leaves the same result on every rank, for different memory and
bytes.

Memory: on CPU the storage sizes of the tensors a rank allocates for input and output; on CUDA
torch.cuda.max_memory_allocated over the block. Bytes (Gloo): sent is wchar of /proc/self/io
(bytes passed to write/writev; Gloo sends with writev), received is tcpi_bytes_received of the
process's TCP sockets (Gloo receives with recv, which rchar does not count; strace, torch 2.13).
Both count the whole process, so they are read right around each call, and a probe of known
size checks them. NCCL's bytes bypass the process's syscalls: see them with nsys or
NCCL_DEBUG=INFO. The meter is below the divider (Meter, socket_bytes).

    torchrun --nproc_per_node=3 primitives/collective_costs.py
    python primitives/collective_costs.py --nproc 4 --size 4000000

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#collective-functions
      https://man7.org/linux/man-pages/man5/proc_pid_io.5.html (wchar)
      https://man7.org/linux/man-pages/man7/tcp.7.html (TCP_INFO)
"""

import contextlib
import os
import re
import socket
import struct
import sys

import torch
import torch.distributed as dist
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    rank, world, dev, n, src = ctx.rank, ctx.world_size, ctx.device, args.size, 0
    # with meter(name, lambda: [the tensors the block allocates]): measured around the block
    meter = Meter(ctx)

    # scatter: only the source holds all world*n values; each rank allocates and receives its n.
    with meter("scatter", lambda: [full, mine]):
        full = rows(0, world, n, dev) if rank == src else None
        mine = torch.empty(n, dtype=torch.int32, device=dev)
        dist.scatter(mine, list(full.chunk(world)) if rank == src else None, src=src)
    # broadcast, then slice: every rank allocates and receives all world*n values, then keeps n.
    with meter("broadcast+slice", lambda: [everything]):
        everything = (
            rows(0, world, n, dev)
            if rank == src
            else torch.empty(world * n, dtype=torch.int32, device=dev)
        )
        dist.broadcast(everything, src=src)
        sliced = everything[rank * n : (rank + 1) * n]
    # all_reduce: n values in, the n sums out, in place.
    with meter("all_reduce", lambda: [x]):
        x = rows(rank, 1, n, dev)
        dist.all_reduce(x)
    # all_gather, then sum here: every rank receives all world*n values to compute the same n sums.
    with meter("all_gather+sum", lambda: [y, gathered, total]):
        y = rows(rank, 1, n, dev)
        gathered = torch.empty(world * n, dtype=torch.int32, device=dev)
        dist.all_gather_single(gathered, y)
        total = gathered.view(world, n).sum(0, dtype=torch.int32)

    check_results(
        rows(0, world, n, "cpu").view(world, n), rank, mine=mine, sliced=sliced, x=x, total=total
    )
    probe = check_counters(meter, ctx, 4 * n)
    print_in_order(meter.table())
    print0(check_costs(meter.rows, ctx, src, 4 * n, probe))


def rows(first, count, n, device):
    """Rows first..first+count-1 of the full data (world rows of n int32), flat:
    (r*n + i) % 997, so sums are exact."""
    rows = torch.arange(first * n, (first + count) * n, dtype=torch.int32, device=device)
    return rows.remainder_(997)  # in place: no second tensor in the memory measured


# ---- The lesson ends here. What follows is how it checks itself. ----


def socket_bytes():
    """(bytes this process wrote, bytes its TCP sockets received), or None where the kernel does
    not say."""
    if sys.platform != "linux" or not hasattr(socket, "TCP_INFO"):
        return None
    with open("/proc/self/io") as f:
        wrote = int(re.search(r"wchar: (\d+)", f.read()).group(1))
    received = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                # a duplicate: closing it leaves Gloo's open
                with socket.socket(fileno=os.dup(int(fd))) as s:
                    info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 136)
                # tcpi_bytes_received, linux/tcp.h
                received += struct.unpack_from("Q", info, 128)[0]
        except OSError:  # not a TCP socket, or closed meanwhile
            pass
    return wrote, received


class Meter:
    """Memory allocated and bytes moved by each block, read right around it."""

    def __init__(self, ctx):
        self.ctx, self.rows = ctx, {}
        self.counts = ctx.backend == "gloo" and socket_bytes() is not None

    @contextlib.contextmanager
    def __call__(self, name, tensors):
        cuda, dev = self.ctx.device.type == "cuda", self.ctx.device
        dist.barrier()  # the previous call has ended on every rank: none of its bytes land here
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        before = socket_bytes() if self.counts else None
        yield
        after = socket_bytes() if self.counts else None
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tensors()
            if t is not None
        }
        if cuda:
            row = self.rows[name] = dict(allocated=torch.cuda.max_memory_allocated(dev) - base)
        else:
            row = self.rows[name] = dict(allocated=sum(storages.values()))
        if after is not None:
            row.update(sent=after[0] - before[0], received=after[1] - before[1])

    def table(self):
        def kib(row, k):
            return f"{row[k] / 1024:12.1f}" if k in row else f"{'-':>12}"

        return "\n".join(
            [f"{'':16}{'allocated':>12}{'sent':>12}{'received':>12}  (KiB)"]
            + [
                f"{name:16}" + "".join(kib(row, k) for k in ("allocated", "sent", "received"))
                for name, row in self.rows.items()
            ]
        )


def check_results(full, rank, **got):
    """Plain torch on the full data: row `rank` for scatter and the slice, the column sums for
    the other two."""
    sums = full.sum(0, dtype=torch.int32)
    for name, t in got.items():
        expected = full[rank] if name in ("mine", "sliced") else sums
        if not torch.equal(t.cpu(), expected):
            raise RuntimeError(
                f"rank {rank}: {name} = {t[:4].tolist()}..., expected {expected[:4].tolist()}..."
            )


def check_counters(meter, ctx, nbytes, slack=4096):
    """Rank 0 sends rank 1 a tensor of nbytes: both counters must move by that much, give or
    take headers."""
    if not meter.counts:
        why = (
            "NCCL moves them without this process's syscalls: see them with nsys or NCCL_DEBUG=INFO"
            if ctx.backend == "nccl"
            else "no /proc/self/io or TCP_INFO on this system"
        )
        return print0(f"bytes moved: not measured ({why}); memory and results are still checked")
    if ctx.world_size == 1:
        return "1 rank: nothing crosses a socket"
    probe = torch.ones(nbytes // 4, dtype=torch.int32, device="cpu")  # Gloo's send/recv: host
    dist.barrier()
    before = socket_bytes()
    {0: lambda: dist.send(probe, 1), 1: lambda: dist.recv(probe, 0)}.get(ctx.rank, lambda: None)()
    moved = [a - b for a, b in zip(socket_bytes(), before)]
    if ctx.rank < 2 and not nbytes <= moved[ctx.rank] <= nbytes + slack:
        raise RuntimeError(
            f"rank {ctx.rank} {('wrote', 'received')[ctx.rank]} {moved[ctx.rank]} bytes "
            f"for a {nbytes}-byte probe: the counter is wrong"
        )
    return f"probe of {nbytes} bytes counted within {slack}"


def check_costs(rows, ctx, src, piece, probe):
    """Figures that must hold, whatever the algorithm, else raise; returns the OK line."""
    world, rank, sc, bc = ctx.world_size, ctx.rank, rows["scatter"], rows["broadcast+slice"]
    ratio = rows["all_gather+sum"]["allocated"] / rows["all_reduce"]["allocated"]
    if ratio < world or (rank != src and bc["allocated"] < world * sc["allocated"]):
        raise RuntimeError(
            f"rank {rank}: gathering allocated {ratio:.2f}x all_reduce's memory, broadcast "
            f"{bc['allocated']} B against scatter's {sc['allocated']} B: expected {world}x or more"
        )
    moved = f"; {probe}" if probe else ""
    if probe and world > 1:
        # what this rank lacked and must have received
        needs = {
            "scatter": piece * (rank != src),
            "broadcast+slice": world * piece * (rank != src),
            "all_gather+sum": (world - 1) * piece,
        }
        for name, need in needs.items():
            if rows[name]["received"] < need:
                raise RuntimeError(
                    f"{name}: rank {rank} received {rows[name]['received']} B, it lacked {need} B"
                )
        # At a few KiB, Gloo's headers (about 100 B a message, measured) decide it: compare from
        # 64 KiB.
        if rank == src and piece >= 1 << 16 and sc["sent"] >= bc["sent"]:
            raise RuntimeError(
                f"scatter's root sent {sc['sent']} B, not less than broadcast's {bc['sent']} B"
            )
        moved = (
            f"; root sent {sc['sent'] / 1024:.1f} KiB to scatter, "
            f"{bc['sent'] / 1024:.1f} KiB to broadcast{moved}"
        )
    return (
        f"OK: {world} rank(s), results equal plain torch; all_gather+sum allocated {ratio:.1f}x "
        f"all_reduce's memory{moved}"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--size",
        type=int_in(1, 1_000_000_000),
        default=1 << 18,
        help="int32 values per rank (the full data is world x size)",
    )
    run(main, parser.parse_args())
