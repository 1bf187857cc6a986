"""Stores: the small key-value servers through which ranks find each other.

init_process_group rendezvous through a Store; you can use one yourself to share small
values (a port, a path, a flag) without a process group. Four kinds:
  TCPStore     a server in one process (rank 0), clients in the others: works across nodes
  FileStore    a file every rank can open: one machine or a shared file system
  HashStore    in memory, one process only: for tests
  PrefixStore  wraps another store and prefixes every key: one namespace per component
First the use case: rank 0 publishes a value through a TCPStore; the others wait for it.
Then rank 0 tries every operation on each kind and prints what works (and how, where they
differ). Found so with torch 2.13: FileStore.wait ignores its timeout argument (the
store's own timeout applies), FileStore.delete_key of a missing key returns True, FileStore
has no queue; TCPStore and FileStore count a key of their own in num_keys.

    torchrun --nproc_per_node=3 primitives/stores.py
    python primitives/stores.py --nproc 2

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#distributed-key-value-store
"""

import datetime
import os
import tempfile
import time

import torch.distributed as dist
from launch.dist_setup import float_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    # Rank 0 hosts a TCPStore on a free port and publishes a value; the others connect and wait
    # for the key. (The port travels by broadcast_object_list; torchrun serves such a store on
    # MASTER_PORT.)
    host = os.environ["MASTER_ADDR"]  # rank 0 runs on this host (torchrun and our spawn path)
    timeout = datetime.timedelta(seconds=args.timeout)
    store = None
    if ctx.rank == 0:
        store = dist.TCPStore(
            host, 0, ctx.world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
    port = [store.port if store else None]
    dist.broadcast_object_list(port, src=0)
    if ctx.rank != 0:
        store = dist.TCPStore(host, port[0], ctx.world_size, is_master=False, timeout=timeout)
    store.add("arrived", 1)  # every rank checks in: add is atomic
    if ctx.rank == 0:
        time.sleep(args.delay)  # stands for work: finding a checkpoint, a port, a run id...
        store.set("run_id", f"run-{port[0]}")
    start = time.perf_counter()
    store.wait(["run_id"], timeout)  # blocks until rank 0 has set it
    run_id = store.get("run_id").decode()
    print_in_order(f"waited {time.perf_counter() - start:.2f}s for run_id: {run_id!r}")

    dist.barrier()  # everyone has checked in and read
    arrived = int(store.get("arrived"))
    check_published(run_id, f"run-{port[0]}", arrived, ctx.world_size)
    dist.barrier()  # the server (rank 0) must outlive its clients' last request
    if ctx.rank == 0:  # each store here is private to rank 0
        print_what_each_store_supports()
    print0(
        f"OK: {ctx.world_size} ranks read the value rank 0 published through a TCPStore, and "
        f"add() counted {arrived} arrivals; each store kind probed (table above)"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_published(run_id, published, arrived, world):
    if run_id != published or arrived != world:
        raise RuntimeError(
            f"got run_id {run_id!r} ({published!r} was set), {arrived} arrivals for {world} ranks"
        )


def print_what_each_store_supports():
    """Rank 0 tries every operation on a store of each kind and prints a table of what works."""
    with tempfile.TemporaryDirectory() as tmp:
        kinds = {
            "TCPStore": dist.TCPStore(
                "127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=1)
            ),
            "FileStore": dist.FileStore(os.path.join(tmp, "store"), 1),
            "HashStore": dist.HashStore(),
            "PrefixStore": dist.PrefixStore("lesson/", dist.HashStore()),
        }
        table = {}
        for name, store in kinds.items():
            store.set_timeout(datetime.timedelta(seconds=1))
            table[name] = try_each_operation(store)
        del kinds
    print(f"{'operation':16s}" + "".join(f"{kind:24s}" for kind in table), flush=True)
    for op in table["TCPStore"]:
        print(f"{op:16s}" + "".join(f"{found[op]:24s}" for found in table.values()), flush=True)
    print("(wait asked for a 0.3s timeout; the store's own timeout was 1s)", flush=True)


def try_each_operation(store):
    """{operation: what happened}: the answer of its last step, or NO. A wrong answer raises."""

    def expect(got, want):
        if got != want:
            raise RuntimeError(f"expected {want!r}, got {got!r}")
        return "yes"

    def timed_wait():
        start = time.perf_counter()
        try:
            store.wait(["missing"], datetime.timedelta(seconds=0.3))
        except RuntimeError:  # DistStoreError is a RuntimeError
            return f"yes, raised after {time.perf_counter() - start:.1f}s"
        raise RuntimeError("wait on a missing key returned")

    def num_keys():
        before, ours = store.num_keys(), sum(store.check([key]) for key in ["k", "n", "a"])
        store.set("one_more", "x")
        return expect(store.num_keys() - before, 1) + f"; {before} keys, {ours} ours"

    tries = {
        "set/get": [lambda: store.set("k", "v"), lambda: expect(store.get("k"), b"v")],
        "add": [lambda: store.add("n", 2), lambda: expect(store.add("n", 3), 5)],
        "append": [
            lambda: store.set("a", "x"),
            lambda: store.append("a", "y"),
            lambda: expect(store.get("a"), b"xy"),
        ],
        "compare_set": [
            lambda: expect(store.compare_set("k", "v", "w"), b"w"),  # matched: swapped
            lambda: expect(store.compare_set("k", "v", "z"), b"w"),  # no match: unchanged
        ],
        "wait(timeout)": [timed_wait],
        "check": [
            lambda: expect(store.check(["k"]), True),
            lambda: expect(store.check(["nope"]), False),
        ],
        "delete_key": [
            lambda: expect(store.delete_key("k"), True),
            lambda: f"yes; again: {store.delete_key('k')}",
        ],
        "num_keys": [num_keys],
        "multi_set/get": [
            lambda: store.multi_set(["x", "y"], ["1", "2"]),
            lambda: expect(store.multi_get(["x", "y"]), [b"1", b"2"]),
        ],
        "queue_push/pop": [
            lambda: store.queue_push("q", "m"),
            lambda: expect(store.queue_pop("q"), b"m"),
        ],
    }
    found = {}
    for name, steps in tries.items():
        try:
            for step in steps:
                found[name] = step()
        except (NotImplementedError, AttributeError) as error:
            found[name] = f"NO: {type(error).__name__}"
    return found


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--delay", type=float_in(0, 600), default=0.2, help="seconds before rank 0 publishes"
    )
    run(main, parser.parse_args())
