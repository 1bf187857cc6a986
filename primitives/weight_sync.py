"""Weight sync for RL trainers: push a trainer's new weights to inference workers, every step.

Ranks 0..T-1 train (in a real job FSDP or DDP ranks; here each holds the whole model), ranks
T..N-1 are the inference workers, and a group made for the sync holds trainer rank 0 and the
workers only: the other trainer ranks never wait on a weight update. Two ways to send: one
broadcast per parameter (one latency per tensor), then a few flat buckets (one call each) whose
slices the workers' parameters are, so a bucket lands straight in the parameters. Checked bit for
bit against a replica each rank computes (for the check only). Two jobs: weight_sync_two_jobs.py.

    torchrun --nproc_per_node=4 primitives/weight_sync.py --trainers 2     # rank 0 -> ranks 2, 3
    torchrun --nproc_per_node=8 primitives/weight_sync.py --layers 24 --width 4096 --bucket-mb 256
run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.
Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.broadcast
"""

import time

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors
from torch.distributed.tensor import DTensor, distribute_tensor
from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_rank, run


def buckets_of(params, bucket_bytes):
    """Split params, in order, into lists of at most bucket_bytes (at least one tensor each)."""
    buckets, size = [[]], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


def bucket_views(buckets):
    """Make each parameter a slice of one flat tensor per bucket, once; return the flat tensors."""
    flats = []
    for bucket in buckets:
        flat = _flatten_dense_tensors([p.data for p in bucket])  # one contiguous copy, at set-up
        offset = 0
        for p in bucket:
            p.data = flat[offset : offset + p.numel()].view_as(p)  # now a view of flat
            offset += p.numel()
        flats.append(flat)
    return flats


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks (a trainer and a worker)")
    ctx.require(
        args.trainers < ctx.world_size,
        f"--trainers must be from 1 to {ctx.world_size - 1}: at least one rank must be a worker",
    )
    rank, trainer, workers = ctx.rank, 0, list(range(args.trainers, ctx.world_size))
    sync_group = dist.new_group([trainer, *workers])  # every rank calls it, even one not in it
    if rank != trainer and rank not in workers:
        return print_outside(sync_group, args, ctx)  # a trainer rank that goes on training
    model = make_model(args, seed=0 if rank == trainer else 1 + rank, device=ctx.device)
    model.requires_grad_(False)  # workers' weights are written by communication, not autograd
    params = list(model.parameters())
    buckets = buckets_of(params, int(args.bucket_mb * 2**20))
    flats = bucket_views(buckets) if rank != trainer else []  # worker parameters: views of these

    def per_parameter():  # one call, one latency, per tensor
        for p in params:
            dist.broadcast(p, src=trainer, group=sync_group)

    def bucketed():  # one call per bucket
        for i, bucket in enumerate(buckets):
            if rank == trainer:  # pack: the trainer's optimizer owns its tensors
                dist.broadcast(_flatten_dense_tensors(bucket), src=trainer, group=sync_group)
            else:
                dist.broadcast(flats[i], src=trainer, group=sync_group)  # lands in the parameters

    check = SyncCheck(args, ctx, sync_group)  # a replica to compare with, and the timings
    for step in range(args.steps + 1):  # step 0 is a warm-up: not timed
        if rank == trainer:
            train_step(model, step)  # the trainer's optimizer step
        for sync in (per_parameter, bucketed):
            check.before_sync(model)
            sync()
            check.after_sync(sync.__name__, model, step)
    check.print_timings(params, buckets)


# ---- The lesson ends here. What follows is how it checks itself. ----


def make_model(args, seed, device):
    """Many tensors of mixed sizes, like a transformer's; initialised by the CPU generator, so the
    weights are the same whatever the device."""
    torch.manual_seed(seed)
    with torch.device("cpu"):
        layers = []
        for _ in range(args.layers):
            layers += [torch.nn.LayerNorm(args.width), torch.nn.Linear(args.width, args.width)]
        model = torch.nn.Sequential(*layers)
    return model.to(device=device, dtype=getattr(torch, args.dtype))


@torch.no_grad()
def train_step(model, step):
    """A stand-in for an optimizer step: deterministic, so the check can recompute it. A sharded
    parameter (a DTensor under FSDP: weight_sync_two_jobs.py) gets its slice of the same noise."""
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=gen, device="cpu")  # the full shape, on the host
        noise = noise.to(device=p.device, dtype=p.dtype)
        if isinstance(p, DTensor):  # this rank's slice; src_data_rank=None: every rank has it
            noise = distribute_tensor(noise, p.device_mesh, p.placements, src_data_rank=None)
        p.add_(noise, alpha=1e-3)


def print_outside(sync_group, args, ctx):
    if dist.get_rank(sync_group) != -1:  # -1: not a member (the docs of get_rank)
        raise RuntimeError(f"rank {ctx.rank} is a member of the sync group and should not be")
    print_rank("trainer rank outside the sync group: takes part in no weight update")


class SyncCheck:
    """Around each sync: a worker sets its weights to NaN first (the sync must deliver every value
    again) and after it compares them, bit for bit, with a replica it trains itself; every member
    of the group times the sync (the slowest rank's time counts), from step 1 on."""

    def __init__(self, args, ctx, group):
        self.args, self.ctx, self.group = args, ctx, group
        self.replica, self.replica_step = make_model(args, seed=0, device=ctx.device), 0
        self.seconds = {"per_parameter": [], "bucketed": []}

    def before_sync(self, model):
        if self.ctx.rank != 0:  # a worker forgets its weights
            for p in model.parameters():
                p.fill_(float("nan"))
        dist.barrier(group=self.group)
        self.synchronize()
        self.start = time.perf_counter()

    def after_sync(self, name, model, step):
        self.synchronize()
        elapsed = torch.tensor([time.perf_counter() - self.start], device=self.ctx.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=self.group)  # the slowest member's
        if step:
            self.seconds[name].append(elapsed.item())
        while self.replica_step <= step:  # the replica catches up with the trainer's steps
            train_step(self.replica, self.replica_step)
            self.replica_step += 1
        check_equals_replica(model, self.replica, name, step, self.ctx.rank)

    def synchronize(self):
        if self.ctx.device.type != "cpu":
            torch.accelerator.synchronize()

    def print_timings(self, params, buckets):
        print_timings(self.seconds, params, buckets, self.args, self.ctx)


def check_equals_replica(model, replica, method, step, rank):
    for p, q in zip(model.parameters(), replica.parameters()):  # the bytes, not the values
        if not torch.equal(p.reshape(-1).view(torch.uint8), q.data.reshape(-1).view(torch.uint8)):
            raise RuntimeError(
                f"rank {rank}: after {method} sync at step {step} a parameter of shape "
                f"{tuple(p.shape)} differs from the trainer's"
            )


def print_timings(times, params, buckets, args, ctx):
    nbytes = sum(p.numel() * p.element_size() for p in params)
    per, buck = (sum(times[k]) / args.steps * 1e3 for k in ("per_parameter", "bucketed"))
    print0(
        f"model: {len(params)} tensors, {nbytes / 2**20:.2f} MiB of {args.dtype}; {len(buckets)} "
        f"bucket(s) of at most {args.bucket_mb:g} MiB; trainer rank 0 -> "
        f"{ctx.world_size - args.trainers} worker(s) (ranks {args.trainers}.."
        f"{ctx.world_size - 1}); {args.trainers - 1} trainer rank(s) outside the group"
    )
    print0(f"per-parameter broadcast: {per:8.3f} ms per sync ({len(params)} calls)")
    print0(f"bucketed broadcast:      {buck:8.3f} ms per sync ({len(buckets)} calls)")
    print0(
        f"speed-up of bucketed over per-parameter: {per / buck:.2f}x (mean of {args.steps} steps)"
    )
    print0(
        f"OK: after each of {args.steps + 1} steps every worker's weights equal the trainer's bit "
        f"for bit, both per-parameter and bucketed; bucketed was {per / buck:.2f}x as fast here"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument(
        "--trainers",
        type=int_in(1, 4095),
        default=1,
        help="ranks 0..T-1 train; only rank 0 of them joins the sync group",
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
        "--steps", type=int_in(1, 10_000), default=3, help="timed training steps (plus a warm-up)"
    )
    run(main, parser.parse_args())
