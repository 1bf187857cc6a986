"""The calls that backend_matrix.py (a tool) tries, each with the check of its result.

A probe makes one call on a group and raises if the backend refuses it or the result is wrong
(rank r holds r + 1). Unbatched send/recv go in pairs, never in a ring that may deadlock on NCCL
(deadlock.py).
"""

import datetime
import functools

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (1.13-2.12) to *_single; the old
# names still work: 2.13.0 and 2.14.1 warn (FutureWarning, distributed_c10d.py), 2.15.0 does not.
# torch 2.13: ReduceOp.PREMUL_SUM(factor) makes the op (public since pytorch PR #172216); before,
# only the private dist._make_nccl_premul_sum(factor) did.
PREMUL_SUM = (
    dist.ReduceOp.PREMUL_SUM if callable(dist.ReduceOp.PREMUL_SUM) else dist._make_nccl_premul_sum
)


def expect(tensor, value, what=""):
    got = tensor.cpu()
    if not torch.equal(got, torch.full_like(got, value)):
        raise ValueError(f"wrong result{what}: {got.tolist()} instead of {value}")


def expect_object(got, want):
    if got != want:
        raise ValueError(f"wrong result: {got!r} instead of {want!r}")


def calls(rank, n, dev):
    """(name, probe(group)) pairs, in the order of the table's rows."""
    total = n * (n + 1) / 2
    even_sender = rank % 2 == 0 and rank + 1 < n  # pairs (0,1), (2,3)...: even sends, odd receives

    def mine():
        return torch.full((2,), rank + 1.0, device=dev)

    def expect_from_each_rank(tensors, value_of):
        for r, t in enumerate(tensors):
            expect(t, value_of(r), f" from rank {r}")

    def broadcast(g):
        t = mine()
        dist.broadcast(t, src=0, group=g)
        expect(t, 1.0)

    def all_reduce(g):
        t = mine()
        dist.all_reduce(t, group=g)
        expect(t, total)

    def reduce(g):
        t = mine()
        dist.reduce(t, dst=0, group=g)
        if rank == 0:
            expect(t, total)

    def all_gather(g):
        out = [torch.empty(2, device=dev) for _ in range(n)]
        dist.all_gather(out, mine(), group=g)
        expect_from_each_rank(out, lambda r: r + 1.0)

    def all_gather_single(g, shape):  # output: n*k elements, or n rows of k
        out = torch.empty(shape, device=dev)
        dist.all_gather_single(out, mine(), group=g)
        expect_from_each_rank(out.view(n, 2), lambda r: r + 1.0)

    def gather(g):
        out = [torch.empty(2, device=dev) for _ in range(n)] if rank == 0 else None
        dist.gather(mine(), out, dst=0, group=g)
        expect_from_each_rank(out or [], lambda r: r + 1.0)

    def scatter(g):
        out = torch.empty(2, device=dev)
        parts = [torch.full((2,), r + 1.0, device=dev) for r in range(n)] if rank == 0 else None
        dist.scatter(out, parts, src=0, group=g)
        expect(out, rank + 1.0)

    def reduce_scatter(g):  # rank r sends mine * (j + 1) to rank j
        out = torch.empty(2, device=dev)
        dist.reduce_scatter(out, [mine() * (j + 1) for j in range(n)], group=g)
        expect(out, total * (rank + 1))

    def reduce_scatter_single(g):
        out = torch.empty(2, device=dev)
        dist.reduce_scatter_single(out, torch.cat([mine() * (j + 1) for j in range(n)]), group=g)
        expect(out, total * (rank + 1))

    def to_each(j):  # what this rank sends to rank j in all_to_all
        return torch.full((2,), (rank + 1) * 10.0 + j, device=dev)

    def all_to_all(g):
        out = [torch.empty(2, device=dev) for _ in range(n)]
        dist.all_to_all(out, [to_each(j) for j in range(n)], group=g)
        expect_from_each_rank(out, lambda r: (r + 1) * 10.0 + rank)

    def all_to_all_single(g):
        out = torch.empty(2 * n, device=dev)
        dist.all_to_all_single(out, torch.cat([to_each(j) for j in range(n)]), group=g)
        expect_from_each_rank(out.view(n, 2), lambda r: (r + 1) * 10.0 + rank)

    def send_recv(g, send, recv):  # send, recv: dist.send/recv, or isend/irecv (wait() at once)
        if even_sender:
            send(mine(), dst=rank + 1, group=g)
        elif rank % 2 == 1:
            t = torch.empty(2, device=dev)
            recv(t, src=rank - 1, group=g)
            expect(t, float(rank))

    def batch_isend_irecv(g):  # a ring is safe here: batched, so nothing waits on anything
        t = torch.empty(2, device=dev)
        ops = [
            dist.P2POp(dist.isend, mine(), (rank + 1) % n, g),
            dist.P2POp(dist.irecv, t, (rank - 1) % n, g),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        expect(t, (rank - 1) % n + 1.0)

    def broadcast_object_list(g):
        objs = [{"from": rank}]
        dist.broadcast_object_list(objs, src=0, group=g)
        expect_object(objs, [{"from": 0}])

    def all_gather_object(g):
        out = [None] * n
        dist.all_gather_object(out, {"r": rank}, group=g)
        expect_object([o["r"] for o in out], list(range(n)))

    def gather_object(g):
        out = [None] * n if rank == 0 else None
        dist.gather_object(rank * 10, out, dst=0, group=g)
        expect_object(out, [10 * r for r in range(n)] if rank == 0 else None)

    def scatter_object_list(g):
        out = [None]
        dist.scatter_object_list(
            out, [f"to {r}" for r in range(n)] if rank == 0 else None, src=0, group=g
        )
        expect_object(out[0], f"to {rank}")

    def send_recv_object_list(g):
        if even_sender:
            dist.send_object_list([("hi", rank)], dst=rank + 1, group=g)
        elif rank % 2 == 1:
            got = [None]
            dist.recv_object_list(got, src=rank - 1, group=g)
            expect_object(got[0], ("hi", rank - 1))

    def posted_then_waited(call):  # isend/irecv used as send/recv: post, then wait at once
        return lambda *args, **kwargs: call(*args, **kwargs).wait()

    return [
        ("broadcast", broadcast),
        ("all_reduce", all_reduce),
        ("reduce", reduce),
        ("all_gather", all_gather),
        (
            "all_gather_single / all_gather_into_tensor",
            functools.partial(all_gather_single, shape=(2 * n,)),
        ),
        (
            "all_gather_single, output shaped (n, k)",
            functools.partial(all_gather_single, shape=(n, 2)),
        ),
        ("gather", gather),
        ("scatter", scatter),
        ("reduce_scatter", reduce_scatter),
        ("reduce_scatter_single / reduce_scatter_tensor", reduce_scatter_single),
        ("all_to_all", all_to_all),
        ("all_to_all_single", all_to_all_single),
        ("barrier", lambda g: dist.barrier(group=g)),
        ("send / recv", functools.partial(send_recv, send=dist.send, recv=dist.recv)),
        (
            "isend / irecv",
            functools.partial(
                send_recv, send=posted_then_waited(dist.isend), recv=posted_then_waited(dist.irecv)
            ),
        ),
        ("batch_isend_irecv", batch_isend_irecv),
        *reduce_op_calls(rank, n, dev),
        ("broadcast_object_list", broadcast_object_list),
        ("all_gather_object", all_gather_object),
        ("gather_object", gather_object),
        ("scatter_object_list", scatter_object_list),
        ("send_object_list / recv_object_list", send_recv_object_list),
        (
            "monitored_barrier",
            lambda g: dist.monitored_barrier(
                group=g, timeout=datetime.timedelta(seconds=5), wait_all_ranks=True
            ),
        ),
    ]


def reduce_op_calls(rank, n, dev):
    """One all_reduce per ReduceOp, with the value it must give when rank r holds r + 1."""
    values = range(1, n + 1)
    band, bor, bxor = (functools.reduce(f, values) for f in (int.__and__, int.__or__, int.__xor__))
    total, product, R = sum(values), functools.reduce(int.__mul__, values), dist.ReduceOp
    ops = [  # (row name, a function that makes the op, expected value, dtype)
        ("ReduceOp.SUM", lambda: R.SUM, total, torch.float32),
        ("ReduceOp.PRODUCT", lambda: R.PRODUCT, float(product), torch.float32),
        ("ReduceOp.MIN", lambda: R.MIN, 1.0, torch.float32),
        ("ReduceOp.MAX", lambda: R.MAX, float(n), torch.float32),
        ("ReduceOp.AVG", lambda: R.AVG, total / n, torch.float32),
        ("ReduceOp.BAND (int32)", lambda: R.BAND, band, torch.int32),
        ("ReduceOp.BOR (int32)", lambda: R.BOR, bor, torch.int32),
        ("ReduceOp.BXOR (int32)", lambda: R.BXOR, bxor, torch.int32),
        ("ReduceOp.PREMUL_SUM(2.0)", lambda: PREMUL_SUM(2.0), 2 * total, torch.float32),
    ]

    def probe(g, make_op, value, dtype):
        t = torch.full((2,), rank + 1, dtype=dtype, device=dev)
        dist.all_reduce(t, op=make_op(), group=g)
        expect(t, value)

    return [
        (name, functools.partial(probe, make_op=make_op, value=value, dtype=dtype))
        for name, make_op, value, dtype in ops
    ]
