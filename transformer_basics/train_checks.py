"""What train.py and train_2d.py check, and the measurements they print. Not a lesson: imported.

Both: a resume restored the model, the optimizer state, the scheduler, the step and the RNG state
of the checkpoint. train.py: DDP's replicas hold the same parameters; the first asynchronous
checkpoint holds the state of its step; the time each checkpoint stopped the loop. train_2d.py:
the first step's gradients equal the unsharded model's on the global batch.
"""

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_map

import data
from checkpointing import checkpoint_state
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


def check_resumed(path, stateful, start, ctx):
    """After --resume, before anything draws a random number: the model, the optimizer's state
    (AdamW's moments and step counts), the scheduler, the step and the CPU RNG state equal the
    checkpoint's, read back on their own into fresh tensors. A resume that skipped one of them
    (the optimizer's, say) would train on from another state, and its loss might not show it."""
    model, optimizer, scheduler = stateful
    if os.path.isdir(path):  # DCP: each rank reads its shards into copies of its own tensors
        model_sd, optim_sd = get_state_dict(model, optimizer)
        live = {"model": model_sd, "optimizer": optim_sd}
        saved = tree_map(clone, live) | {"scheduler": scheduler.state_dict(), "step": -1}
        saved["rng"] = torch.empty_like(torch.get_rng_state())
        dcp.load(saved, checkpoint_id=path)
    else:
        module = model.module if isinstance(model, DDP) else model
        live = {"model": module.state_dict(), "optimizer": optimizer.state_dict()}
        saved = torch.load(path, map_location="cpu", weights_only=True)
    live |= {"scheduler": scheduler.state_dict(), "step": start, "rng": torch.get_rng_state()}
    n = compare_states(live, {key: saved[key] for key in live}, "--resume: after the resume,")
    print0(
        f"check: resumed at step {start}: model, optimizer ({n} tensors in all), scheduler and "
        f"RNG state equal the checkpoint's"
    )


class CheckedSaves:
    """train.py's save, and the check of --async-save: when the first asynchronous save is
    called, a copy of this rank's state at that step (as DCP would write it); once that write is
    complete and published (at the next save), the checkpoint is read back and compared with the
    copy, to the bit. A write of live tensors that training changed meanwhile (no staged copy)
    differs. Reads the checkpoint once: the first asynchronous one only."""

    def __init__(self, save):
        self.save, self.stalls, self.expected, self.checked = save, save.stalls, None, False

    def __call__(self, step, last=False):
        save = self.save
        save.wait()  # the write in flight, now complete, and published
        if self.expected is not None:
            saved_step, expected = self.expected
            saved = tree_map(clone, checkpoint_state(save.path, save.stateful, -1, save.ctx))
            dcp.load(saved, checkpoint_id=save.path)
            what = f"--async-save: the checkpoint of step {saved_step}, read back,"
            n = compare_states(expected, saved, what)
            print0(
                f"check: the asynchronous checkpoint of step {saved_step}, read back, holds "
                f"the state of step {saved_step} ({n} tensors, to the bit)"
            )
            self.expected, self.checked = None, True
        if save.asynchronous and not last and not self.checked:
            state = checkpoint_state(save.path, save.stateful, step, save.ctx)
            self.expected = (step, tree_map(cpu_copy, state))
        save(step, last=last)


def clone(t):
    return t.clone() if isinstance(t, torch.Tensor) else t


def cpu_copy(t):
    """This rank's part of a tensor (a DTensor: its shard), copied to the CPU."""
    if not isinstance(t, torch.Tensor):
        return t
    return (t.to_local() if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)


def compare_states(want, got, what):
    """Every leaf of two state dicts equal (tensors: this rank's part, to the bit); the number of
    tensors compared. Raises naming the first that differs, or is missing."""
    want, got = (dict(tree_flatten_with_path(tree_map(cpu_copy, s))[0]) for s in (want, got))
    for key in sorted(want.keys() | got.keys(), key=keystr):
        if key not in want or key not in got:
            where = "the checkpoint only" if key not in want else "the state only"
            raise RuntimeError(
                f"{what} the state differs from the checkpoint: {keystr(key)} is in {where}"
            )
        a, b = want[key], got[key]
        if not (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b):
            raise RuntimeError(f"{what} the state differs from the checkpoint at {keystr(key)}")
    n = sum(isinstance(a, torch.Tensor) for a in want.values())
    if not n:
        raise RuntimeError(f"{what} no tensor compared")
    return n
