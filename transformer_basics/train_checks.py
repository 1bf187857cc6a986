"""What train.py and train_2d.py check, and the measurements they print. Not a lesson: imported.

train.py (DDP): every replica holds the same parameters; the time each checkpoint stopped the
loop. train_2d.py: the first step's gradients equal the unsharded model's on the global batch.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import data
from launch.dist_setup import print0


def check_replicas_agree(model):
    """DDP's promise: every replica holds the same parameters, to the bit."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if not torch.equal(low, high):
        raise RuntimeError("DDP replicas diverged: parameters differ between ranks")


def print_stalls(stalls):
    """What the saves cost the loop: the time each stopped it, and the CPU copy each staged."""
    ms = {k: [s * 1e3 for _, kind, s, _ in stalls if kind == k] for k in ("sync", "async", "wait")}
    if ms["async"]:
        steps = ", ".join(str(step) for step, kind, _, _ in stalls if kind == "async")
        print0(
            f"checkpoint stall: synchronous save {max(ms['sync']):.1f} ms, asynchronous "
            f"{sum(ms['async']) / len(ms['async']):.1f} ms (mean of steps {steps}) + "
            f"{sum(ms['wait']):.1f} ms in all waiting for a write in flight; staged copy "
            f"{max(n for *_, n in stalls) / 2**20:.2f} MiB of CPU memory per rank until written"
        )


def check_first_step(model, reference, windows, args, ctx):
    """Before training, on every rank and device: the 2-D model on this rank's windows and the
    unsharded model on the whole global batch (every dp row's) must produce the same gradients.
    In float32 without dropout (eval mode), whatever --dtype and --dropout train with: both models
    are then the same function, so only the order of sums differs (reduce-scatter over dp, TP's
    all_reduce, matmul splits), a few float32 ulps of each gradient, far below --tol 2e-5."""

    def batches(shard):
        return [
            tuple(t.to(ctx.device) for t in shard.batch(0, micro, args.batch_size, args.accum))
            for micro in range(args.accum)
        ]

    rows = windows.world_size  # dp
    every_row = [
        data.ShardedWindows(
            windows.tokens, args.block_size, rank=d, world_size=rows, seed=args.seed
        )
        for d in range(rows)
    ]
    local, whole = batches(windows), [batch for row in every_row for batch in batches(row)]
    model.eval(), reference.eval()
    for x, y in local:
        (F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / len(local)).backward()
    for x, y in whole:
        (F.cross_entropy(reference(x).flatten(0, 1), y.flatten()) / len(whole)).backward()
    worst = 0.0
    for (name, p), ref_p in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, (grad - ref_p.grad).abs().max().item())
        if worst > args.tol:
            raise RuntimeError(
                f"first step: gradient of {name} differs from the unsharded model's by {worst:.2e}"
            )
    model.zero_grad(set_to_none=True)
    model.train()
    print0(
        "check: step 0's gradients (float32) equal the unsharded model's on the global batch "
        f"(max diff {worst:.1e})"
    )
