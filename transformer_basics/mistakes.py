"""The mistakes parity.py runs (--mistake NAME): each swaps functions of layouts.py for the versions
a reader plausibly writes, in the parallel layouts only (the one-process runs come before the swap).

    dropout-rng-per-rank       each rank seeds its own RNG: right for data parallelism, wrong in TP
    no-data-sharding           every rank reads the same share of each global batch
    gradients-summed           the gradients reduced by hand are summed, not averaged
    loss-averaged-twice        the pipeline's loss_fn divides by m, and so does its schedule
    clip-local-norm            each rank clips to the norm of what it holds
    tied-gradients-not-summed  the pipeline's embedding and head each keep their own gradient
    bf16-reductions            every reduction of the gradients in bfloat16

Some need a setting to show, which they then take as their default (a flag given still wins): a
clip that acts scales any gradient to the same norm, so a gradient N times too large, or m times too
small, makes the same step as the right one.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import data
import layouts
from launch.dist_setup import print0


@dataclass
class Mistake:
    what: str  # as the run prints it
    swaps: dict  # a function of layouts.py -> the version a reader writes instead
    settings: dict = field(default_factory=dict)  # the defaults it runs with, said in `what`


def make(name):
    """Swap in the mistake's functions, on every rank."""
    for function, wrong in MISTAKES[name].swaps.items():
        setattr(layouts, function, wrong)
    print0(f"mistake {name}: {MISTAKES[name].what}")


def seed_per_rank(args, ctx):
    torch.manual_seed(args.seed + ctx.rank)


def windows_of_rank_0(tokens, i, n, args):  # a reader built without rank and world size
    return data.ShardedWindows(tokens, args.block_size, rank=0, world_size=1, seed=args.seed)


def summed_gradients(params, group, n):
    flat = torch.cat([p.grad.flatten() for p in params])
    dist.all_reduce(flat, group=group)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))


def schedule_dividing_again(stage, n_microbatches, loss_fn):
    # an accumulation loop's "loss / m", carried into the loss_fn of a schedule that divides too
    return Schedule1F1B(stage, n_microbatches, loss_fn=lambda *a: loss_fn(*a) / n_microbatches)


@torch.no_grad()
def clip_to_local_norm(layout, max_norm):
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in
             layout.model.parameters()]  # fmt: skip
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in local]))
    for g in local:
        g.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))


def tied_gradient_kept(weight, group):
    pass


def ddp_reducing_in_bf16(module, device_ids):
    model = DDP(module, device_ids=device_ids)
    model.register_comm_hook(dist.group.WORLD, bf16_mean)
    return model


def bf16_mean(group, bucket):  # torch's bf16_compress_hook, which refuses any backend but NCCL
    half = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size(group))
    work = dist.all_reduce(half, group=group, async_op=True)
    return work.get_future().then(lambda done: bucket.buffer().copy_(done.value()[0]))


def shard_reducing_in_bf16(model, mesh):
    bf16 = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)  # half the bytes of float32
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh, mp_policy=bf16)
    return fully_shard(model, mesh=mesh, mp_policy=bf16)


def average_in_bf16(params, group, n):
    flat = torch.cat([p.grad.flatten() for p in params]).bfloat16()
    dist.all_reduce(flat, group=group)
    flat /= n
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))


def tied_sum_in_bf16(weight, group):
    half = weight.grad.bfloat16()
    dist.all_reduce(half, group=group)
    weight.grad.copy_(half)


NO_CLIP = " (--grad-clip 0 by default: a clip that acts would scale it back to the right step)"
MISTAKES = {
    "dropout-rng-per-rank": Mistake(
        "each rank seeds its RNG with seed + rank (right for data parallelism): the TP ranks drop "
        "different units of the activations they each hold a copy of",
        {"seed_dropout": seed_per_rank},
    ),
    "no-data-sharding": Mistake(
        "each rank reads its windows without its rank and world size: all read the same share",
        {"my_windows": windows_of_rank_0},
    ),
    "gradients-summed": Mistake(
        "the gradients reduced by hand (context and expert parallel) are summed over the ranks, "
        "not averaged: N times too large" + NO_CLIP,
        {"average_gradients": summed_gradients},
        settings=dict(grad_clip=0.0),
    ),
    "loss-averaged-twice": Mistake(
        "the pipeline's loss_fn divides each micro-batch's mean loss by m, as an accumulation loop "
        "does, and the schedule divides by m again" + NO_CLIP,
        {"Schedule1F1B": schedule_dividing_again},
        settings=dict(grad_clip=0.0),
    ),
    "clip-local-norm": Mistake(
        "each rank clips its gradients to the norm of what it holds (its shards, its stage, its "
        "experts), not to the norm of the whole model's",
        {"clip_grad_norm": clip_to_local_norm},
    ),
    "tied-gradients-not-summed": Mistake(
        "the pipeline's embedding (first stage) and head (last stage), one matrix, each step with "
        "their own part of its gradient",
        {"sum_tied_gradients": tied_gradient_kept},
    ),
    "bf16-reductions": Mistake(
        "every reduction of the gradients in bfloat16 (8 bits of mantissa): DDP's hook, FSDP2's "
        "reduce_dtype, the sums by hand",
        {
            "DDP": ddp_reducing_in_bf16,
            "shard": shard_reducing_in_bf16,
            "average_gradients": average_in_bf16,
            "sum_tied_gradients": tied_sum_in_bf16,
        },
    ),
}
