"""Which backend supports which call, on which device: found out here, by trying each one.

For every backend/device pair this machine has (Gloo on CPU; Gloo with CUDA tensors and
NCCL where every local rank has a GPU), every rank makes each call on a group with a short
timeout and checks the result against the value worked out by hand. A call that raises,
hangs or returns a wrong value is "no" (with the reason below the table). Pairs this machine
lacks say "not available here": nothing is assumed about them. Rank 0 prints a Markdown table.

Why the calls run in a child process per rank, not in the lesson's own: a timed-out NCCL call
cannot be caught. Its watchdog aborts the whole process (TORCH_NCCL_ASYNC_ERROR_HANDLING
defaults to 3, "tear down"; docs: https://pytorch.org/docs/stable/torch_nccl_environment_variables.html),
and torchrun would then stop every rank, table and all. So each column is probed by child
processes that form their own group; after every call they agree on its outcome and pass it
up. A call that raises does so at once, on the ranks that made it, and counts as "no". A call
that hangs or crashes takes only the children with it: the parents mark that call "no", start
new children and go on with the next call. Every probe is a program that is correct under
each backend's rules (pairs for unbatched send/recv: see deadlock.py), so a "no" means the
backend refused the call, not that the probe deadlocked.

    torchrun --nproc_per_node=2 primitives/backend_matrix.py
    python primitives/backend_matrix.py --nproc 4 --op-timeout 10

Docs: https://pytorch.org/docs/stable/distributed.html#backends
"""
import datetime
import multiprocessing
import os
import platform
import signal

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

    def isend_irecv(g):  # pairs, as send_recv (an unbatched ring may deadlock on NCCL: deadlock.py)
        if rank % 2 == 0 and rank + 1 < n:
            dist.isend(mine(), dst=rank + 1, group=g).wait()
        elif rank % 2 == 1:
            t = torch.empty(2, device=dev); dist.irecv(t, src=rank - 1, group=g).wait(); expect(t, float(rank))

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


def error_text(e):
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"


def probe_column(conn, backend, device_type, start, rank, n, local_rank, gpus, store_at, timeouts):
    """A child process: a group of its own, the calls from `start` on. After each call the ranks agree
    on every rank's outcome over a Gloo group and send it to the parent: (index, [error or None per rank])."""
    op_timeout, coord_timeout = (datetime.timedelta(seconds=t) for t in timeouts)
    torch.set_num_threads(1)
    try:
        dev = torch.device(device_type, local_rank % gpus) if device_type == "cuda" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)  # as launch/dist_setup.py does: device_id below, as in the lessons
        (host, port), prefix = store_at
        store = dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False, timeout=coord_timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=n, timeout=op_timeout,
                                device_id=dev if dev.type != "cpu" else None)
        coord = dist.new_group(backend="gloo", timeout=coord_timeout)
        group = dist.new_group(backend=backend, timeout=op_timeout)
    except Exception as e:
        conn.send(("init", error_text(e)))
        os._exit(0)
    for i, (name, fn) in enumerate(calls(rank, n, dev)):
        if i < start:
            continue
        try:
            fn(group)
            error = None
        except Exception as e:  # an unsupported call, a Gloo time-out or a wrong value: record it
            error = error_text(e)
        errors = [None] * n
        try:
            dist.all_gather_object(errors, error, group=coord)  # pickles: fine between our own ranks
        except Exception:
            os._exit(3)  # a peer's process is gone: leave too, the parents know where we were
        conn.send((i, errors))
        if any(errors):  # the group may be stuck mid-call: start a clean one
            dist.destroy_process_group(group)
            group = dist.new_group(backend=backend, timeout=op_timeout)
    dist.destroy_process_group()
    conn.send(("done", None))
    os._exit(0)


def how_it_ended(code):
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return "a time-out of the lesson (killed)" if code is None else f"exit code {code}"


def probe(backend, device_type, names, ctx, gpus, store_at, args, coord):
    """Fill one column: {call index: None if it works, else the reason}."""
    outcome, start, attempt = {}, 0, 0
    spawn = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA or threads
    deadline = args.op_timeout + 2 * args.timeout  # a call, the agreement after it, or the start-up
    while start < len(names):
        receiver, sender = spawn.Pipe(duplex=False)
        child = spawn.Process(target=probe_column, args=(
            sender, backend, device_type, start, ctx.rank, ctx.world_size, ctx.local_rank, gpus,
            (store_at, f"matrix/{backend}/{device_type}/{attempt}"), (args.op_timeout, args.timeout)))
        child.start()
        sender.close()
        seen, init_error = {}, None
        while receiver.poll(deadline):
            try:
                index, errors = receiver.recv()
            except EOFError:  # the child ended
                break
            if index == "init":
                init_error = errors
            elif index != "done":
                seen[index] = errors
        if child.is_alive():
            child.kill()
        child.join()
        reports = [None] * ctx.world_size  # what every rank's child reported, and how it ended
        dist.all_gather_object(reports, (seen, init_error, child.exitcode), group=coord)
        for seen_r, _, _ in reports:
            outcome.update({i: next((f"rank {r}: {e}" for r, e in enumerate(errs) if e), None)
                            for i, errs in seen_r.items()})
        failed_init = next((f"rank {r}: {e}" for r, (_, e, _) in enumerate(reports) if e), None)
        if failed_init:
            outcome.update({i: f"the group could not be made: {failed_init}" for i in range(start, len(names))})
            break
        start = next((i for i in range(start, len(names)) if i not in outcome), len(names))
        if start < len(names):  # no rank's child finished this call: one of them hung or crashed in it
            dead = [(r, code) for r, (_, _, code) in enumerate(reports) if code not in (0, 3)]
            who = ", ".join(f"rank {r}'s ended with {how_it_ended(code)}" for r, code in dead) or "they ended"
            outcome[start] = f"hung or crashed: the probing processes did not finish it ({who})"
            start, attempt = start + 1, attempt + 1
    return outcome


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: run with --nproc_per_node=2 or more")
    ctx.require(args.op_timeout > 0, "--op-timeout must be positive")
    rank, n = ctx.rank, ctx.world_size
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    has_gpu = gpus >= ctx.local_world_size  # one GPU per local rank, or the CUDA columns are off
    columns = [("Gloo", "gloo", "cpu", dist.is_gloo_available()),
               ("Gloo", "gloo", "cuda", dist.is_gloo_available() and has_gpu),
               ("NCCL", "nccl", "cuda", dist.is_nccl_available() and has_gpu)]
    # A CPU group to agree on outcomes, whatever the default is; it waits while children probe.
    coord = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3 * args.timeout + args.op_timeout))
    # A store for the children's groups, served by rank 0 on a free port of MASTER_ADDR (rank 0's host).
    server = dist.TCPStore(os.environ["MASTER_ADDR"], 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [server.port if server else None]
    dist.broadcast_object_list(port, src=0, group=coord)
    store_at = (os.environ["MASTER_ADDR"], port[0])
    names = [name for name, _ in calls(rank, n, torch.device("cpu"))]
    table = {name: [] for name in names}
    notes = []
    for label, backend, device_type, available in columns:
        if not available:
            for name in names:
                table[name].append("not available here")
            continue
        outcome = probe(backend, device_type, names, ctx, gpus, store_at, args, coord)
        for i, name in enumerate(names):
            if outcome[i] is None:
                table[name].append("yes")
            else:
                notes.append(f"{label}/{device_type.upper()} {name}, {outcome[i]}")
                table[name].append(f"no ({len(notes)})")

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
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument("--op-timeout", type=float, default=5.0, help="seconds a call may take before it counts as no")
    run(main, parser.parse_args())
