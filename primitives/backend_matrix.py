"""Which backend supports which call, on which device: found out here, by trying each one.

For every backend/device pair this machine has (Gloo on CPU; Gloo with CUDA tensors and
NCCL where every local rank has a GPU), every rank makes each call on a group with a short
timeout and checks the result against the value worked out by hand. A call that raises,
times out or returns a wrong value is "no" (with the reason below the table); the group is
then replaced, so one failure cannot spoil the next call. Pairs this machine lacks say
"not available here": nothing is assumed about them. Rank 0 prints a Markdown table.

    torchrun --nproc_per_node=2 primitives/backend_matrix.py
    python primitives/backend_matrix.py --nproc 4 --op-timeout 10

Docs: https://pytorch.org/docs/stable/distributed.html#backends
"""
import datetime
import platform

import torch
import torch.distributed as dist
from launch.dist_setup import lesson_parser, print0, run


def calls(rank, n, dev):
    """(name, fn(group)) pairs; fn raises if the result is wrong. Rank r contributes r + 1."""
    total = n * (n + 1) / 2
    mine = lambda: torch.full((2,), rank + 1.0, device=dev)

    def expect(tensor, value, what=""):
        got = tensor.cpu()
        if not torch.equal(got, torch.full_like(got, value)):
            raise ValueError(f"wrong result{what}: {got.tolist()} instead of {value}")

    def all_reduce_op(op, value, dtype=torch.float32):  # op: a function that makes the ReduceOp
        def fn(g):
            t = torch.full((2,), rank + 1, dtype=dtype, device=dev)
            dist.all_reduce(t, op=op(), group=g)
            expect(t, value)
        return fn

    def broadcast(g):
        t = mine(); dist.broadcast(t, src=0, group=g); expect(t, 1.0)

    def all_reduce(g):
        t = mine(); dist.all_reduce(t, group=g); expect(t, total)

    def reduce(g):
        t = mine(); dist.reduce(t, dst=0, group=g)
        if rank == 0:
            expect(t, total)

    def all_gather(g):
        out = [torch.empty(2, device=dev) for _ in range(n)]
        dist.all_gather(out, mine(), group=g)
        for r, t in enumerate(out):
            expect(t, r + 1.0, f" from rank {r}")

    # torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single.
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def all_gather_into_tensor(g, stacked=False):  # output: n*k elements, or n rows of k
        out = torch.empty((n, 2) if stacked else (2 * n,), device=dev)
        gather_single(out, mine(), group=g)
        for r in range(n):
            expect(out.view(n, 2)[r], r + 1.0, f" from rank {r}")

    def gather(g):
        out = [torch.empty(2, device=dev) for _ in range(n)] if rank == 0 else None
        dist.gather(mine(), out, dst=0, group=g)
        for r, t in enumerate(out or []):
            expect(t, r + 1.0, f" from rank {r}")

    def scatter(g):
        out = torch.empty(2, device=dev)
        parts = [torch.full((2,), r + 1.0, device=dev) for r in range(n)] if rank == 0 else None
        dist.scatter(out, parts, src=0, group=g); expect(out, rank + 1.0)

    def reduce_scatter(g):
        out = torch.empty(2, device=dev)
        dist.reduce_scatter(out, [mine() * (r + 1) for r in range(n)], group=g); expect(out, total * (rank + 1))

    def reduce_scatter_tensor(g):
        out = torch.empty(2, device=dev)
        inp = torch.cat([mine() * (r + 1) for r in range(n)])
        scatter_single(out, inp, group=g); expect(out, total * (rank + 1))

    def all_to_all(g):  # rank r sends (r+1)*10 + j to rank j
        out = [torch.empty(2, device=dev) for _ in range(n)]
        dist.all_to_all(out, [torch.full((2,), (rank + 1) * 10.0 + j, device=dev) for j in range(n)], group=g)
        for r, t in enumerate(out):
            expect(t, (r + 1) * 10.0 + rank, f" from rank {r}")

    def all_to_all_single(g):
        out = torch.empty(2 * n, device=dev)
        inp = torch.cat([torch.full((2,), (rank + 1) * 10.0 + j, device=dev) for j in range(n)])
        dist.all_to_all_single(out, inp, group=g)
        for r in range(n):
            expect(out[2 * r:2 * r + 2], (r + 1) * 10.0 + rank, f" from rank {r}")

    def barrier(g):
        dist.barrier(group=g)

    def send_recv(g):  # pairs (0,1), (2,3)...: even sends, odd receives; no cycle, no deadlock
        if rank % 2 == 0 and rank + 1 < n:
            dist.send(mine(), dst=rank + 1, group=g)
        elif rank % 2 == 1:
            t = torch.empty(2, device=dev); dist.recv(t, src=rank - 1, group=g); expect(t, float(rank))

    def isend_irecv(g):  # a ring: each rank sends right, receives from the left
        t = torch.empty(2, device=dev)
        works = [dist.isend(mine(), dst=(rank + 1) % n, group=g), dist.irecv(t, src=(rank - 1) % n, group=g)]
        for w in works:
            w.wait()
        expect(t, (rank - 1) % n + 1.0)

    def batch_isend_irecv(g):
        t = torch.empty(2, device=dev)
        ops = [dist.P2POp(dist.isend, mine(), (rank + 1) % n, g), dist.P2POp(dist.irecv, t, (rank - 1) % n, g)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        expect(t, (rank - 1) % n + 1.0)

    def broadcast_object_list(g):
        objs = [{"from": rank}]
        dist.broadcast_object_list(objs, src=0, group=g)
        if objs != [{"from": 0}]:
            raise ValueError(f"wrong result: {objs}")

    def all_gather_object(g):
        out = [None] * n
        dist.all_gather_object(out, {"r": rank}, group=g)
        if [o["r"] for o in out] != list(range(n)):
            raise ValueError(f"wrong result: {out}")

    def gather_object(g):
        out = [None] * n if rank == 0 else None
        dist.gather_object(rank * 10, out, dst=0, group=g)
        if rank == 0 and out != [10 * r for r in range(n)]:
            raise ValueError(f"wrong result: {out}")

    def scatter_object_list(g):
        out = [None]
        dist.scatter_object_list(out, [f"to {r}" for r in range(n)] if rank == 0 else None, src=0, group=g)
        if out[0] != f"to {rank}":
            raise ValueError(f"wrong result: {out[0]!r}")

    def send_recv_object_list(g):
        if rank % 2 == 0 and rank + 1 < n:
            dist.send_object_list([("hi", rank)], dst=rank + 1, group=g)
        elif rank % 2 == 1:
            got = [None]
            dist.recv_object_list(got, src=rank - 1, group=g)
            if got[0] != ("hi", rank - 1):
                raise ValueError(f"wrong result: {got[0]!r}")

    def monitored_barrier(g):
        dist.monitored_barrier(group=g, timeout=datetime.timedelta(seconds=5), wait_all_ranks=True)

    ints, product = torch.int32, 1.0
    for r in range(n):
        product *= r + 1
    bits = [r + 1 for r in range(n)]
    band, bor, bxor = bits[0], 0, 0
    for b in bits:
        band, bor, bxor = band & b, bor | b, bxor ^ b
    R = dist.ReduceOp
    return [
        ("broadcast", broadcast),
        ("all_reduce", all_reduce),
        ("reduce", reduce),
        ("all_gather", all_gather),
        ("all_gather_single / all_gather_into_tensor", all_gather_into_tensor),
        ("all_gather_single, output shaped (n, k)", lambda g: all_gather_into_tensor(g, stacked=True)),
        ("gather", gather),
        ("scatter", scatter),
        ("reduce_scatter", reduce_scatter),
        ("reduce_scatter_single / reduce_scatter_tensor", reduce_scatter_tensor),
        ("all_to_all", all_to_all),
        ("all_to_all_single", all_to_all_single),
        ("barrier", barrier),
        ("send / recv", send_recv),
        ("isend / irecv", isend_irecv),
        ("batch_isend_irecv", batch_isend_irecv),
        ("ReduceOp.SUM", all_reduce_op(lambda: R.SUM, total)),
        ("ReduceOp.PRODUCT", all_reduce_op(lambda: R.PRODUCT, product)),
        ("ReduceOp.MIN", all_reduce_op(lambda: R.MIN, 1.0)),
        ("ReduceOp.MAX", all_reduce_op(lambda: R.MAX, float(n))),
        ("ReduceOp.AVG", all_reduce_op(lambda: R.AVG, total / n)),
        ("ReduceOp.BAND (int32)", all_reduce_op(lambda: R.BAND, band, ints)),
        ("ReduceOp.BOR (int32)", all_reduce_op(lambda: R.BOR, bor, ints)),
        ("ReduceOp.BXOR (int32)", all_reduce_op(lambda: R.BXOR, bxor, ints)),
        ("ReduceOp.PREMUL_SUM (x2, made by dist._make_nccl_premul_sum)",
         all_reduce_op(lambda: dist._make_nccl_premul_sum(2.0), 2 * total)),
        ("broadcast_object_list", broadcast_object_list),
        ("all_gather_object", all_gather_object),
        ("gather_object", gather_object),
        ("scatter_object_list", scatter_object_list),
        ("send_object_list / recv_object_list", send_recv_object_list),
        ("monitored_barrier", monitored_barrier),
    ]


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    ctx.require(args.op_timeout > 0, "--op-timeout must be positive")
    rank, n = ctx.rank, ctx.world_size
    timeout = datetime.timedelta(seconds=args.op_timeout)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    has_gpu = gpus >= ctx.local_world_size  # one GPU per local rank, or the CUDA columns are off
    columns = [("Gloo", "gloo", "cpu", dist.is_gloo_available()),
               ("Gloo", "gloo", "cuda", dist.is_gloo_available() and has_gpu),
               ("NCCL", "nccl", "cuda", dist.is_nccl_available() and has_gpu)]
    coord = dist.new_group(backend="gloo")  # CPU group to agree on outcomes, whatever the default is
    names = [name for name, _ in calls(rank, n, torch.device("cpu"))]
    table = {name: [] for name in names}
    notes = []
    for label, backend, device_type, available in columns:
        if not available:
            for name in names:
                table[name].append("not available here")
            continue
        dev = torch.device(device_type, ctx.local_rank % gpus) if device_type == "cuda" else torch.device("cpu")
        group = dist.new_group(backend=backend, timeout=timeout)
        for name, fn in calls(rank, n, dev):
            try:
                fn(group)
                error = None
            except Exception as e:  # an unsupported call, a time-out or a wrong value: record it
                error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
            errors = [None] * n
            dist.all_gather_object(errors, error, group=coord)  # pickles: fine between our own ranks
            failed = [(r, e) for r, e in enumerate(errors) if e]
            if not failed:
                table[name].append("yes")
                continue
            notes.append(f"{label}/{device_type.upper()} {name}, rank {failed[0][0]}: {failed[0][1]}")
            table[name].append(f"no ({len(notes)})")
            dist.destroy_process_group(group)  # it may be stuck mid-call: start a clean one
            group = dist.new_group(backend=backend, timeout=timeout)
        dist.destroy_process_group(group)

    header = [f"{label} / {dev.upper()}" for label, _, dev, _ in columns]
    print0(f"| call | {' | '.join(header)} |")
    print0(f"|---|{'---|' * len(header)}")
    for name in names:
        print0(f"| `{name}` | {' | '.join(table[name])} |")
    print0("")
    for i, note in enumerate(notes, 1):
        print0(f"({i}) {note}")
    print0(f"\nMade with torch {torch.__version__} on {platform.system()} {platform.machine()}, {n} ranks, "
           f"{gpus} GPU(s), by: python primitives/backend_matrix.py --nproc {n} --op-timeout {args.op_timeout:g}")
    live = [f"{label}/{dev.upper()}" for label, _, dev, ok in columns if ok]
    supported = sum(row.count("yes") for row in table.values())
    tried = len(names) * len(live)
    print0(f"OK: tried {len(names)} calls on {', '.join(live)} with {n} ranks, each result checked: "
           f"{supported} of {tried} work; {len(columns) - len(live)} backend/device pair(s) not available here")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--op-timeout", type=float, default=5.0, help="seconds a call may take before it counts as no")
    run(main, parser.parse_args())
