"""Train the GPT with context parallelism: the sequence of every window split over a cp group.

The ranks form a dp x cp grid (a 2-D DeviceMesh). The cp ranks of one row read the same windows;
each keeps two zig-zag chunks of every window (cp rank r: chunks r and 2cp-1-r of 2cp, as in
ring_attention.py): their tokens, targets and positions (model.py's forward would number them
0..n-1). Every block's attention runs as ring attention over the cp row, with the block's own q, k,
v, proj layers; the rest works token by token. Parameters are replicated; DDP averages the
gradients over all ranks. Checked: every step's loss and the final parameters equal one process's
on the global batch (float32). Measured: activations saved per rank against the sequence length,
and the collectives of one step per rank.

    torchrun --nproc_per_node=2 transformer_basics/train_cp.py               # cp 2
    torchrun --nproc_per_node=8 transformer_basics/train_cp.py --cp 8 --block-size 4096 \
        --n-embd 256                                                         # 8 GPUs
    python transformer_basics/train_cp.py --nproc 4                          # dp 2 x cp 2

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.batch_isend_irecv
      https://pytorch.org/tutorials/recipes/distributed_device_mesh.html
      https://pytorch.org/docs/stable/autograd.html#torch.autograd.graph.saved_tensors_hooks
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

import data
from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run
from model import GPT, config_from_args
from ring_attention import RingAttention, zigzag_positions


class RingSelfAttention(nn.Module):
    """A block's attention: its own q, k, v, proj layers (model.py's names), ring attention over
    group."""

    def __init__(self, attn, group):
        super().__init__()
        self.q, self.k, self.v, self.proj = attn.q, attn.k, attn.v, attn.proj
        self.head_dim, self.group = attn.head_dim, group

    def forward(self, x):  # x: (B, 2c, C), this rank's two chunks in sequence order
        B, T, _ = x.shape
        q, k, v = (
            lin(x).view(B, T, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v)
        )
        return self.proj(RingAttention.apply(q, k, v, self.group).transpose(1, 2).reshape(B, T, -1))


class GPTWithPositions(nn.Module):
    """model.py's GPT, its forward written out with the position ids as an input."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx, pos):
        gpt = self.gpt
        x = gpt.drop(gpt.wte(idx) + gpt.wpe(pos))
        for block in gpt.blocks.values():
            x = block(x)
        return gpt.lm_head(gpt.ln_f(x))


def main(args, ctx):
    W, T, B = ctx.world_size, args.block_size, args.batch_size
    cp = args.cp = args.cp or (2 if W % 2 == 0 else W)  # default: 1, 2, 3, 2 (dp 2), .., 2 (dp 4)
    ctx.require(
        W % cp == 0, f"--cp {cp} must divide the world size {W}: the ranks form a dp x cp grid"
    )
    ctx.require(
        T % (2 * cp) == 0,
        f"--block-size {T} must be a multiple of 2 x --cp = {2 * cp}: each cp rank takes two "
        "chunks of every window",
    )
    ctx.require(args.n_embd % args.n_head == 0, "--n-embd must be a multiple of --n-head")
    ctx.require(args.dropout == 0, "--dropout must be 0: this ring attention has no dropout")
    dp, tokens = W // cp, data.encode(data.generate_corpus(2000))
    ctx.require(not (problem := data.check_tokens(tokens, T, None)), str(problem))
    if cp > 1:
        # the ring: batch_isend_irecv, which Gloo does on CPU tensors only (docs:
        # distributed.html#backends)
        ctx.require(
            ctx.backend != "gloo" or ctx.device.type == "cpu",
            "point-to-point on gloo needs CPU tensors: use --backend nccl or --device cpu",
        )
    torch.backends.cuda.matmul.fp32_precision = "ieee"  # never TF32 (the check's bound)

    mesh = init_device_mesh(ctx.device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    cp_group, cp_rank = mesh["cp"].get_group(), mesh["cp"].get_local_rank()
    # The ranks of a cp row read the same windows; each keeps its zig-zag chunks of every window.
    shard = dict(rank=mesh["dp"].get_local_rank(), world_size=dp, seed=args.seed)
    windows = data.ShardedWindows(tokens, T, **shard)
    pos = zigzag_positions(cp_rank, cp, T)  # CPU: it indexes the CPU batches
    torch.manual_seed(args.seed)
    gpt = GPT(config_from_args(args)).to(ctx.device)
    start = copy.deepcopy(gpt)  # for the check: the same initial model, trained on one process
    for block in gpt.blocks.values():
        block.attn = RingSelfAttention(block.attn, cp_group)  # device: the block's own layers
    # DDP over the world: each rank's loss is the mean over its B*T/cp tokens (as many on every
    # rank), and the ring's backward hands each rank the gradient of every cp rank's loss through
    # its K and V: so the ranks' average gradient is that of the mean over the global batch.
    on = None if ctx.device.type == "cpu" else [ctx.device]
    model = DDP(GPTWithPositions(gpt), device_ids=on)  # device: gpt's, ctx.device
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)  # SGD: the README's key-bias note
    pos_ids = pos.to(ctx.device)  # the chunks' own positions, not 0..2c-1
    losses = []
    for step in range(args.steps):
        x, y = (t[:, pos].to(ctx.device) for t in windows.batch(step, 0, B))
        loss = F.cross_entropy(model(x, pos_ids).flatten(0, 1), y.flatten())
        loss.backward()  # ring attention's backward (p2p, cp row), then DDP's all_reduce (world)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())

    print_collectives(model, (x, y, pos_ids), mesh=mesh, args=args)
    print_activation_memory(start, model.module, mesh=mesh, args=args, ctx=ctx)
    losses = torch.stack(losses)
    check_against_one_process(start, model.module.gpt, losses, tokens=tokens, args=args, ctx=ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


def print_collectives(model, batch, mesh, args):
    """One more forward and backward of batch (x, y, position ids; gradients thrown away) under
    torch.profiler, counting the c10d ops that the dispatcher runs whatever the backend
    (torch/csrc/distributed/c10d/Ops.cpp)."""
    x, y, pos_ids = batch
    pos = zigzag_positions(mesh["cp"].get_local_rank(), args.cp, args.block_size)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        F.cross_entropy(model(x, pos_ids).flatten(0, 1), y.flatten()).backward()
    model.zero_grad(set_to_none=True)
    names = [event.name for event in prof.events()]
    p2p = names.count("c10d::send") + names.count("c10d::recv_")
    dp, cp, c = mesh["dp"].size(), mesh["cp"].size(), args.block_size // (2 * args.cp)
    print_in_order(
        f"dp {mesh['dp'].get_local_rank()}/{dp}, cp {mesh['cp'].get_local_rank()}/{cp}: positions "
        f"{pos[0]}..{pos[c - 1]} and {pos[c]}..{pos[-1]} of {args.batch_size} window(s) per step\n"
        f"one step: {p2p} p2p ops (isend + irecv, cp row), {names.count('c10d::allreduce_')} "
        "all_reduce (DDP, world)"
    )


def print_activation_memory(start, model, mesh, args, ctx):
    """Forward and loss of one batch at 1/4, 1/2 and all of --block-size: whole windows on one
    process (start: model.py's GPT) against this rank's two chunks of them under cp (model)."""
    B, cp, cp_rank = args.batch_size, args.cp, mesh["cp"].get_local_rank()
    print0(f"activations saved for backward per rank, forward + loss of {B} window(s), KiB:")
    lengths = (args.block_size // 4, args.block_size // 2, args.block_size)
    for T in [t for t in lengths if t % (2 * cp) == 0]:
        gen = torch.Generator().manual_seed(T)
        idx = torch.randint(0, 256, (B, T + 1), generator=gen, device="cpu")
        whole = torch.arange(T, device="cpu")
        one_process = GPTWithPositions(start)  # device: start's, ctx.device
        a, peak_a = activation_bytes(one_process, idx, whole, ctx.device)
        b, peak_b = activation_bytes(model, idx, zigzag_positions(cp_rank, cp, T), ctx.device)
        cuda = ""
        if peak_a is not None:  # on CUDA
            cuda = f" (CUDA max_memory_allocated {peak_a / 1024:,.0f} | {peak_b / 1024:,.0f})"
        print0(
            f"  T {T:5d}: one process, T tokens {a / 1024:9,.1f} | cp {cp}, T/{cp} tokens "
            f"{b / 1024:9,.1f} | ratio {b / a:.3f}{cuda}"
        )


def check_against_one_process(start, gpt, losses, tokens, args, ctx):
    """The same GPT, trained on one process on the global batch (every dp row's windows, whole)."""
    dp = ctx.world_size // args.cp
    reference, B, initial = start, args.batch_size, [p.detach().clone() for p in start.parameters()]
    optimizer = torch.optim.SGD(reference.parameters(), lr=args.lr)
    rows = [data.ShardedWindows(tokens, args.block_size, d, dp, args.seed) for d in range(dp)]
    ref_losses = []
    for step in range(args.steps):
        x, y = (torch.cat(t).to(ctx.device) for t in zip(*(w.batch(step, 0, B) for w in rows)))
        ref_losses.append(F.cross_entropy(reference(x).flatten(0, 1), y.flatten()))
        ref_losses[-1].backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.all_reduce(losses)  # the ranks' mean is the global batch's loss: equal token counts
    losses, ref_losses = (losses / ctx.world_size).tolist(), [loss.item() for loss in ref_losses]
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        print0(f"step {step}: loss {got:.6f} (one process {want:.6f})")
    # float32 (eps 2**-23), TF32 off. A sum of n terms errs by at most about n*eps of their sizes
    # (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., 4.2); the longest: a
    # weight's gradient over the global batch's tokens (dp*B*T), the MLP's matmuls (4*n_embd); a
    # few chained (8x); each step's error carried on (x steps).
    bound = 8 * args.steps * (dp * B * args.block_size + 4 * args.n_embd) * 2.0**-23
    loss_error = max(abs(g - w) / w for g, w in zip(losses, ref_losses))
    # Updates, not values: relative to the largest update of any parameter (one that SGD barely
    # moved, e.g. the key bias, whose gradient is exactly 0, is compared at the scale of the
    # training that happened).
    update = max((r - r0).abs().max().item() for r, r0 in zip(reference.parameters(), initial))
    pairs = zip(gpt.named_parameters(), reference.parameters())
    diffs = {name: (p - r).abs().max().item() for (name, p), r in pairs}
    name = max(diffs, key=diffs.get)
    diff = diffs[name]
    print_in_order(
        f"max error vs one process: loss {loss_error:.1e} (relative), parameters "
        f"{diff / update:.1e} of the largest update ({name}); bound {bound:.1e}"
    )
    if not (loss_error <= bound and diff / update <= bound):
        raise RuntimeError(
            f"rank {ctx.rank}: context-parallel training differs from one process: loss error "
            f"{loss_error:.1e}, {name} {diff / update:.1e} of the largest update "
            f"(bound {bound:.1e})"
        )
    print0(
        f"OK: the GPT trained {args.steps} steps with context parallelism on a {dp}x{args.cp} "
        "(dp x cp) mesh, ring attention in every block: losses and parameters equal one "
        "process's on the global batch"
    )


def activation_bytes(model, idx, pos, device):
    """The forward and loss of model(x, positions) (train_cp.py's GPTWithPositions) on idx at pos:
    the bytes of the tensors autograd saves for backward, each storage once, parameters left out
    (pack sees every one, save_for_backward's too: torch/autograd/graph.py); on CUDA also the peak
    of max_memory_allocated."""
    x, y = (t[:, pos].to(device) for t in (idx[:, :-1], idx[:, 1:]))
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, cuda = {}, device.type == "cuda"

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x, pos.to(device)).flatten(0, 1), y.flatten())
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
    del loss  # held until here: no saved storage was freed, and its address reused, while counting
    return sum(seen.values()), peak


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--cp",
        type=int_in(1, 4096),
        help="context-parallel size, a row of the mesh; dp = ranks / cp (default: 2 on an even "
        "world size, else the whole world)",
    )
    parser.add_argument("--steps", type=int_in(1, 1000), default=3)
    parser.add_argument(
        "--batch-size", type=int_in(1, 1024), default=2, help="windows per dp row and step"
    )
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.3)
    parser.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0)
    # 2cp divides 96 for cp 1, 2, 3, 4, 6, 8
    # the GPT of model.py
    parser.add_argument("--n-layer", type=int_in(1, 256), default=2)
    parser.add_argument("--n-head", type=int_in(1, 1024), default=2)
    parser.add_argument("--n-embd", type=int_in(1, 65_536), default=32)
    parser.add_argument(
        "--block-size", type=int_in(1, 1_048_576), default=96, help="context length"
    )
    parser.add_argument("--dropout", type=float_in(0, 0.9), default=0.0)
    run(main, parser.parse_args())
