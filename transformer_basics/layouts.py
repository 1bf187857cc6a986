"""The GPT laid out each way this folder parallelizes it, side by side: parity.py trains each one.

Each function of LAYOUTS (at the end) takes the model loaded from parity.py's seed checkpoint (the
same full weights on every rank) and returns a Layout: what this rank trains, which share of each
step's global batch it reads, the loss of one of its micro-batches, what it reduces by hand after
backward, and how many ranks hold each plain gradient it holds. First what every layout shares: the
reading, the micro-batch loop (forward_backward), the clip to the whole model's gradient norm. The
parallelisms are the sibling lessons' own functions, imported: apply_tensor_parallel
(tensor_parallel.py), cut_stage and loss_fn (pipeline_parallel.py), RingSelfAttention and
GPTWithPositions (train_cp.py, over ring_attention.py's ring), MoE (train_moe.py, over
expert_parallel.py's all_to_all); DDP and fully_shard are torch's. mistakes.py swaps some of these
functions for the versions a reader plausibly writes.
"""

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import data
from pipeline_parallel import cut_stage, loss_fn
from ring_attention import zigzag_positions
from tensor_parallel import apply_tensor_parallel
from train_cp import GPTWithPositions, RingSelfAttention
from train_moe import MoE


@dataclass
class Layout:
    what: str  # its shape at this world size, for the table
    model: nn.Module  # this rank's part of the model: what its optimizer steps
    group: object  # the ranks that train it together: their losses are averaged
    share: tuple = (0, 1)  # (i, n): the rank reads the i-th of n shares of each global batch
    loss: Callable = None  # (x, y) of a micro-batch -> its mean loss (None: loss_fn(model(x), y))
    sync: Callable = None  # after backward: the gradients reduced by hand
    copies: Callable = None  # name -> ranks holding that plain gradient (None: every rank)
    step: Callable = None  # (x, y) of the whole batch -> loss: a pipeline's own micro-batches


def seed_dropout(args, ctx):
    # The same seed on every rank: TP ranks hold copies of the same activations and must drop the
    # same units of them, as one process does (data-parallel ranks may differ: here they drop none).
    torch.manual_seed(args.seed)


def my_windows(tokens, i, n, args):
    """The i-th of n shares of every step's global batch (as DistributedSampler gives rank i)."""
    return data.ShardedWindows(tokens, args.block_size, rank=i, world_size=n, seed=args.seed)


def forward_backward(layout, windows, step, args, device):
    """Forward and backward of this rank's share of the step's batch, in --microbatches: each one's
    mean loss / m, so that the gradients add up to those of the share's mean; then the syncs by
    hand. Returns the mean loss of the global batch (the ranks' mean: equal shares)."""
    if layout.step:  # a pipeline: its schedule cuts the whole batch into micro-batches itself
        return layout.step(*windows.batch(step, 0, args.batch, device=device))
    m, total = args.microbatches, torch.zeros((), dtype=torch.float64, device=device)
    size = args.batch // layout.share[1] // m
    for micro in range(m):
        x, y = windows.batch(step, micro, size, m, device=device)
        loss = layout.loss(x, y) if layout.loss else loss_fn(layout.model(x), y)
        (loss / m).backward()
        total += loss.detach() / m
    if layout.sync:
        layout.sync()
    dist.all_reduce(total, op=dist.ReduceOp.AVG, group=layout.group)
    return total


@torch.no_grad()
def clip_grad_norm(layout, max_norm):
    """Scale every gradient so that the whole model's gradient has a norm of at most max_norm
    (0: no clipping). Each rank holds parts of it (shards, stages, experts), some of them held by
    other ranks too (replicas): each adds up the squares of its parts, each / the number of ranks
    that hold it, and one all_reduce sums them."""
    if not max_norm:
        return
    ranks, squares, grads = dist.get_world_size(layout.group), 0.0, []
    for name, p in layout.model.named_parameters():
        if isinstance(p.grad, DTensor):  # a shard is held by the ranks along its Replicate dims
            # (not `is_shard()`: FSDP2's _StridedShard over TP is none in torch 2.13)
            mesh, places = p.grad.device_mesh.shape, p.grad.placements
            shards = math.prod(size for size, how in zip(mesh, places) if not how.is_replicate())
            grads.append(p.grad.to_local())
            copies = ranks // shards
        else:
            grads.append(p.grad)
            copies = layout.copies(name) if layout.copies else ranks
        squares += grads[-1].pow(2).sum() / copies
    dist.all_reduce(squares, group=layout.group)
    scale = (max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)  # as clip_grad_norm_ does
    for g in grads:
        g.mul_(scale)


def one_process(gpt, group):
    return Layout("1 process", gpt, group)


def ddp(gpt, args, ctx):
    on = None if ctx.device.type == "cpu" else [ctx.device]
    n = ctx.world_size
    return Layout(f"dp {n} (replicas)", DDP(gpt, device_ids=on), dist.group.WORLD, (ctx.rank, n))


def shard(model, mesh):
    """FSDP2: each block its own all-gather and reduce-scatter, then the root (embeddings, head)."""
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fsdp(gpt, args, ctx):
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    n = ctx.world_size
    return Layout(f"dp {n} (shards)", shard(gpt, mesh), dist.group.WORLD, (ctx.rank, n))


def hsdp(gpt, args, ctx):  # R replicas of S shards: fsdp_basics/hsdp.py
    n = ctx.world_size
    replicas = min((r for r in range(2, n + 1) if n % r == 0), default=1)
    shape, names = (replicas, n // replicas), ("replicate", "shard")
    mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)
    what = f"replicate {replicas} x shard {n // replicas}"
    return Layout(what, shard(gpt, mesh), dist.group.WORLD, (ctx.rank, n))


def tensor_parallel(gpt, args, ctx):  # every rank reads the whole batch
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("tp",))
    what = f"tp {ctx.world_size}"
    return Layout(what, apply_tensor_parallel(gpt, mesh, False), dist.group.WORLD)


def fsdp_tp(gpt, args, ctx):  # train_2d.py: TP inside each row of the mesh, FSDP down its columns
    tp = 2 if ctx.world_size % 2 == 0 else 1
    mesh = init_device_mesh(
        ctx.device.type, (ctx.world_size // tp, tp), mesh_dim_names=("dp", "tp")
    )
    shard(apply_tensor_parallel(gpt, mesh["tp"], False), mesh["dp"])
    what, share = (
        f"dp {ctx.world_size // tp} x tp {tp}",
        (mesh["dp"].get_local_rank(), mesh["dp"].size()),
    )
    return Layout(what, gpt, dist.group.WORLD, share)


def pipeline(gpt, args, ctx):  # pipeline_parallel.py's stages, 1F1B
    p, rank = ctx.world_size, ctx.rank
    stage_model = cut_stage(gpt, rank, p)
    m = max(args.microbatches, p)  # 1F1B needs at least as many micro-batches as stages
    # The schedule scales each micro-batch's loss by 1/m itself: loss_fn is the plain mean.
    schedule = Schedule1F1B(PipelineStage(stage_model, rank, p, ctx.device), m, loss_fn=loss_fn)
    tie_group = dist.new_group(sorted({0, p - 1}))  # the embedding's two copies (every rank calls)
    tied = {0: stage_model.wte, p - 1: stage_model.lm_head}.get(rank) if p > 1 else None

    def step(x, y):
        losses = []  # one per micro-batch, on the last stage
        inputs = [x] if rank == 0 else []  # the first stage feeds the inputs...
        targets = dict(target=y, losses=losses) if rank == p - 1 else {}  # ...the last the targets
        schedule.step(*inputs, **targets)
        if tied is not None:
            sum_tied_gradients(tied.weight, tie_group)
        loss = torch.zeros((), dtype=torch.float64, device=ctx.device)
        if losses:
            loss = torch.stack(losses).detach().mean()
        dist.broadcast(loss, src=p - 1)  # the loss is known on the last stage only
        return loss

    copies = {"wte.weight": 2, "lm_head.weight": 2} if p > 1 else {}  # the tie: on two stages
    what, group = f"pp {p} x {m} micro-batches", dist.group.WORLD
    return Layout(what, stage_model, group, copies=lambda n: copies.get(n, 1), step=step)


def sum_tied_gradients(weight, group):
    """The embedding and the head are one matrix: its gradient is the sum of both uses."""
    dist.all_reduce(weight.grad, group=group)


def context_parallel(gpt, args, ctx):  # train_cp.py, the whole world one ring (cp = N)
    for block in gpt.blocks.values():
        block.attn = RingSelfAttention(block.attn, dist.group.WORLD)  # device: the block's layers
    model = GPTWithPositions(gpt)  # device: gpt's
    # this rank's two zig-zag chunks of every window: tokens, targets and their positions
    pos = zigzag_positions(ctx.rank, ctx.world_size, args.block_size).to(ctx.device)
    params = list(model.parameters())
    return Layout(
        f"cp {ctx.world_size} (a ring)",
        model,
        dist.group.WORLD,
        loss=lambda x, y: loss_fn(model(x[:, pos], pos), y[:, pos]),
        sync=lambda: average_gradients(params, dist.group.WORLD, ctx.world_size),
    )


def expert_parallel(moe_gpt, args, ctx):  # train_moe.py's dp x ep mesh
    n = ctx.world_size
    ep = 2 if n % 2 == 0 else 1
    mesh = init_device_mesh(ctx.device.type, (n // ep, ep), mesh_dim_names=("dp", "ep"))
    local, row = args.experts // ep, mesh["ep"].get_group()  # row: my ep row, its all_to_alls
    first = mesh["ep"].get_local_rank() * local  # my experts: first .. first + local - 1
    for block in moe_gpt.blocks.values():
        old = block.mlp  # every expert: keep mine, send each token to its experts' ranks
        weights = (old.router.detach(), old.w1.detach(), old.w2.detach())
        block.mlp = MoE(*weights, first, local, args.top_k, row)  # device: the weights'
    # The loss: the cross-entropy alone. train_moe.py adds Switch's load-balancing loss, computed on
    # each rank's own tokens: one process would then have to split its batch the same way.

    def expert(name):
        return name.endswith((".w1", ".w2"))

    experts = [p for name, p in moe_gpt.named_parameters() if expert(name)]
    dense = [p for name, p in moe_gpt.named_parameters() if not expert(name)]

    def sync():  # dense parts over all ranks, an expert's over its copies down the dp column
        average_gradients(dense, dist.group.WORLD, n)
        average_gradients(experts, mesh["dp"].get_group(), n)  # / n too: train_moe.py says why

    def copies(name):  # an expert is held by its dp column, the rest by every rank
        return n // ep if expert(name) else n

    what, share = f"dp {n // ep} x ep {ep}", (ctx.rank, n)
    return Layout(what, moe_gpt, dist.group.WORLD, share, sync=sync, copies=copies)


def average_gradients(params, group, n):
    """Each gradient summed over group with one all_reduce, then / n: the mean over n ranks."""
    flat = torch.cat([p.grad.flatten() for p in params])
    dist.all_reduce(flat, group=group)
    flat /= n
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))


# parity.py's rows: the layout, and the model it trains ("gpt+dropout": the tp row's only)
LAYOUTS = {
    "ddp": (ddp, "gpt"),
    "fsdp2": (fsdp, "gpt"),
    "hsdp": (hsdp, "gpt"),
    "tp": (tensor_parallel, "gpt+dropout"),
    "pp 1f1b": (pipeline, "gpt"),
    "cp ring": (context_parallel, "gpt"),
    "ep": (expert_parallel, "moe"),
    "fsdp x tp": (fsdp_tp, "gpt"),
}
