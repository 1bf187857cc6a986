"""Weight sync between two jobs: an FSDP trainer and an inference engine, launched separately.

In an RLHF system the trainer and the inference engine (vLLM, SGLang, ...) are two programs, each
with its own launcher and default process group. To push weights from one to the other they meet
through a TCPStore that trainer rank 0 hosts, agree there on the model's layout, and make one more
process group just for the update: trainer rank 0 is its rank 0, inference rank r its rank 1 + r;
the other trainer ranks stay out. Each step the trainer ranks gather their FSDP shards a bucket of
tensors at a time (`full_tensor()`: an all_gather among them), trainer rank 0 broadcasts the
bucket, and it lands in the inference ranks' parameters (views of the bucket, see weight_sync.py).

    # the trainer, 2 ranks (each holds half of every weight), hosts the store on --sync-port
    torchrun --nproc_per_node=2 --master_port=29500 primitives/weight_sync_two_jobs.py \\
        --role trainer
    # the inference engine, in a second terminal (either job may start first)
    torchrun --nproc_per_node=3 --master_port=29501 primitives/weight_sync_two_jobs.py \\
        --role inference

One GPU node: each job its own GPUs (CUDA_VISIBLE_DEVICES; NCCL refuses two ranks of a communicator
on one GPU, "Duplicate GPU detected", init.cc; README: the 1 -> 7 recipe). Two hosts: --sync-host.
run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.
Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.TCPStore
"""

import datetime
import json
import socket
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run
from weight_sync import bucket_views, buckets_of, check_equals_replica, make_model, train_step


def open_store(args, ctx, timeout):
    """Trainer rank 0 hosts the store on --sync-host:--sync-port; every other rank connects
    (retrying until the timeout, so either job may start first)."""
    fd = None
    if args.role == "trainer" and ctx.rank == 0:
        # TCPStore(is_master=True) listens on every interface whatever host it is given (`ss -ltn`
        # shows *:PORT with torch 2.13); a socket bound here and handed over (detach: the store owns
        # it now) keeps it on --sync-host.
        try:
            fd = socket.create_server((args.sync_host, args.sync_port)).detach()
        except OSError as error:
            ctx.require(
                False,
                f"cannot listen on {args.sync_host}:{args.sync_port} ({error.strerror}): "
                "pick a free --sync-port, the same for both jobs",
            )
    try:
        options = dict(is_master=fd is not None, timeout=timeout, wait_for_workers=False)
        return dist.TCPStore(args.sync_host, args.sync_port, master_listen_fd=fd, **options)
    except dist.DistError:
        ctx.require(
            False,
            f"no trainer listened on {args.sync_host}:{args.sync_port} within {args.timeout:g} s: "
            "start the trainer job (--role trainer) with the same --sync-host and --sync-port",
        )


def main(args, ctx):
    trainer, timeout = args.role == "trainer", datetime.timedelta(seconds=args.timeout)
    model = make_model(args, seed=0 if trainer else 1 + ctx.rank, device=ctx.device)
    model.requires_grad_(False)
    if trainer:  # FSDP2: each trainer rank keeps a 1/T slice of every tensor
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

    # 1. Meet: trainer rank 0 hosts a TCPStore, every rank of both jobs connects to it; the two
    #    sides compare their models' layouts there before a byte of weights moves (the check of
    #    that, agree_on_layout, is below).
    store = open_store(args, ctx, timeout)
    n_inference = agree_on_layout(store, model, args, ctx, timeout)

    # 2. The update group. Each job already has its default group (its own launcher), so this one
    #    is made from the backend class itself, on the shared store; only its members make it.
    group = None
    if not trainer or ctx.rank == 0:
        backend = dist.ProcessGroupNCCL if ctx.backend == "nccl" else dist.ProcessGroupGloo
        rank = 0 if trainer else 1 + ctx.rank
        group = backend(dist.PrefixStore("weights", store), rank, 1 + n_inference, timeout)

    # 3. Each step: train, then stream the weights bucket by bucket.
    buckets = buckets_of(list(model.parameters()), int(args.bucket_mb * 2**20))
    flats = [] if trainer else bucket_views(buckets)  # inference: the parameters are views of these
    check = SyncCheck(args, ctx)
    for step in range(args.steps):
        if trainer:
            train_step(model, step)
        check.before_sync(flats)
        for i, bucket in enumerate(buckets):
            if trainer:
                full = [p.full_tensor() for p in bucket]  # every trainer rank: an all_gather each
                if group is not None:  # trainer rank 0 packs the bucket and sends it
                    group.broadcast(torch.cat([t.reshape(-1) for t in full]), 0).wait()
            else:
                group.broadcast(flats[i], 0).wait()  # lands in the parameters
        check.after_sync(model, step)
    report(store, group, check, n_inference, buckets, args, ctx, timeout)
    if group is not None:
        group.shutdown()  # not registered with torch.distributed: destroy_process_group skips it


# ---- The lesson ends here. What follows is how it checks itself. ----


class SyncCheck:
    """Around each sync: an inference rank sets its weights to NaN first (the sync must deliver
    every value again) and compares them after it with a replica it trains itself, keeping the first
    mismatch (it goes on receiving, so the trainer is never left waiting); trainer rank 0 times
    it."""

    def __init__(self, args, ctx):
        self.trainer, self.ctx, self.seconds, self.wrong = args.role == "trainer", ctx, [], None
        self.replica = None if self.trainer else make_model(args, seed=0, device=ctx.device)

    def before_sync(self, flats):
        for flat in flats:
            flat.fill_(float("nan"))
        self.start = time.perf_counter()

    def after_sync(self, model, step):
        if self.trainer:
            if self.ctx.device.type != "cpu":
                torch.accelerator.synchronize()  # the last bucket may still be on its way
            self.seconds.append(time.perf_counter() - self.start)
            return
        train_step(self.replica, step)
        try:
            check_equals_replica(model, self.replica, "the two-job", step, self.ctx.rank)
        except RuntimeError as error:
            self.wrong = self.wrong or str(error)


def agree_on_layout(store, model, args, ctx, timeout):
    """Both jobs must agree on each tensor's name, global shape and dtype, buckets and backend."""
    tensors = [
        [name, list(p.shape), str(p.dtype).removeprefix("torch.")]
        for name, p in model.named_parameters()
    ]
    mine = {"backend": ctx.backend, "bucket_mb": args.bucket_mb, "tensors": tensors}
    other = "inference" if args.role == "trainer" else "trainer"
    if ctx.rank == 0:  # json, not pickle: nothing read from the store is executed
        store.set(f"{args.role}/layout", json.dumps(mine))
        if args.role == "inference":
            store.set("inference/ranks", str(ctx.world_size))
    try:
        store.wait([f"{other}/layout", "inference/ranks"], timeout)
    except dist.DistError:
        ctx.require(
            False,
            f"no {other} job joined on {args.sync_host}:{args.sync_port} within {args.timeout:g} "
            f"s: start it with --role {other} and the same --sync-port",
        )
    theirs = json.loads(store.get(f"{other}/layout"))
    n_inference = int(store.get("inference/ranks"))
    store.set(f"read/{args.role}/{ctx.rank}", "1")
    if theirs != mine and args.role == "trainer":  # keep the store up while the others read
        if ctx.rank == 0:
            try:  # a rank that never reads (its launcher stopped it) holds this up 10 s at most
                store.wait(
                    [f"read/trainer/{r}" for r in range(ctx.world_size)]
                    + [f"read/inference/{r}" for r in range(n_inference)],
                    datetime.timedelta(seconds=10),
                )
            except dist.DistError:
                pass
            store.set("read/all", "1")
        store.wait(["read/all"], timeout)
    ctx.require(
        theirs == mine,
        f"the two jobs differ: {args.role} has {summary(mine)}, {other} has "
        f"{summary(theirs)}: start both with the same --layers, --width, --dtype, "
        "--bucket-mb and backend",
    )
    return n_inference


def summary(got):
    n = sum(torch.Size(shape).numel() for _, shape, _ in got["tensors"])
    dtypes = "/".join(sorted({dtype for _, _, dtype in got["tensors"]}))
    return (
        f"{len(got['tensors'])} tensors of {n} elements ({dtypes}), {got['bucket_mb']:g} MiB, "
        f"{got['backend']}"
    )


def report(store, group, check, n_inference, buckets, args, ctx, timeout):
    """Inference ranks post verdicts; trainer rank 0 waits for them (a mismatch fails both jobs)."""
    if args.role == "inference":
        store.set(f"verdict/{ctx.rank}", check.wrong or "ok")
        verdict = check.wrong or "equal to the replica, bit for bit"
        print_in_order(f"weights after step {args.steps - 1}: {verdict}")
        if check.wrong:
            raise RuntimeError(check.wrong)
        print0(
            f"OK: inference job, {ctx.world_size} rank(s): after each of {args.steps} steps every "
            "rank's weights equal the trainer's bit for bit"
        )
        return
    if group is None:  # trainer ranks other than 0 only helped gather
        return
    store.wait([f"verdict/{r}" for r in range(n_inference)], timeout)
    bad = [v for r in range(n_inference) if (v := store.get(f"verdict/{r}").decode()) != "ok"]
    if bad:
        raise RuntimeError(f"{len(bad)} inference rank(s) report a mismatch, first: {bad[0]}")
    mib = sum(p.numel() * p.element_size() for b in buckets for p in b) / 2**20
    timed = check.seconds[1:] or check.seconds  # step 0 also sets up the communicators
    ms = sum(timed) / len(timed) * 1e3
    print0(
        f"trainer: {ctx.world_size} FSDP rank(s) -> {n_inference} inference rank(s), "
        f"{len(buckets)} bucket(s), {mib:.2f} MiB per sync, {ms:.1f} ms per sync "
        f"({mib / 1024 / (ms / 1e3):.3f} GiB/s)"
    )
    print0(
        f"OK: trainer job: {args.steps} syncs streamed from {ctx.world_size} FSDP rank(s); all "
        f"{n_inference} inference rank(s) confirmed their weights bit for bit"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--role", required=True, choices=["trainer", "inference"], help="which job this is"
    )
    parser.add_argument("--sync-host", default="127.0.0.1", help="trainer rank 0's address")
    parser.add_argument(
        "--sync-port", type=int_in(1, 65535), default=29600, help="its port, the same for both jobs"
    )
    parser.add_argument(
        "--layers", type=int_in(1, 128), default=8, help="LayerNorm+Linear pairs (4 tensors each)"
    )
    parser.add_argument("--width", type=int_in(1, 8192), default=64, help="hidden size")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--bucket-mb",
        type=float_in(0, 65536, low_open=True),
        default=1.0,
        help="largest bucket in MiB",
    )
    parser.add_argument(
        "--steps", type=int_in(1, 10_000), default=3, help="training steps, each followed by a sync"
    )
    run(main, parser.parse_args())
