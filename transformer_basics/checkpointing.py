"""The checkpoints of train.py and train_2d.py: complete, atomic, resumable on another machine.

A checkpoint holds everything a run needs to go on exactly: model, optimizer, scheduler, step
and RNG state. checkpoint.pt (one process, DDP): rank 0 writes its replica with torch.save.
checkpoint/ (FSDP, FSDP x TP, train.py --async-save): torch.distributed.checkpoint (DCP), each
rank its own shards (a replica once) into one directory, read back by the shards each owns.
Either way it is written under a temporary name, then renamed (checkpoint/ is a symbolic link
switched by a rename): a crash never leaves half a checkpoint; Checkpointer can also write it in
the background. --resume reads whichever of the two --out holds (find_checkpoint). The RNG
state: dropout must draw the same numbers after a resume as the uninterrupted run would.
export_full_model() gathers the unsharded weights for generate.py.

Docs: https://pytorch.org/docs/stable/distributed.checkpoint.html
"""

import os
import shutil
import zipfile
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.dist_setup import print0


def save_checkpoint(path, stateful, step, ctx):
    """A collective: every rank calls it. path ending in .pt: torch.save; else a DCP directory.
    stateful: (model, optimizer, scheduler)."""
    state = checkpoint_state(path, stateful, step=step, ctx=ctx)
    if Path(path).suffix != ".pt":  # DCP: every rank writes its own shards (replicas once)
        tmp = fresh_tmp(path, ctx)
        dcp.save(state, checkpoint_id=tmp)
        publish(tmp, path, ctx)
    elif ctx.rank == 0:  # replicated: rank 0's copy is everyone's
        torch.save(state, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
    if dist.is_initialized():
        dist.barrier()  # nobody reads or rewrites the checkpoint before it is complete


def checkpoint_state(path, stateful, step, ctx):
    model, optimizer, scheduler = stateful
    extra = {"scheduler": scheduler.state_dict(), "step": step, **rng_states(ctx.device)}
    if Path(path).suffix != ".pt":  # DCP's form: keyed by parameter name, for any wrapper
        model_sd, optim_sd = get_state_dict(model, optimizer)
    else:
        model_sd = (model.module if isinstance(model, DDP) else model).state_dict()
        optim_sd = optimizer.state_dict()
    return {"model": model_sd, "optimizer": optim_sd, **extra}


def fresh_tmp(path, ctx):
    """path.tmp, emptied by rank 0 before any rank writes there (a collective)."""
    tmp = f"{path}.tmp"
    if ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return tmp


def publish(tmp, path, ctx):
    """Make the complete directory tmp the checkpoint (a collective): path is a symbolic link to
    path.N, switched by one rename (atomic in POSIX), so path always names a whole checkpoint and
    a crash loses at most one save. (A directory cannot be replaced by a rename in one step.)"""
    if dist.is_initialized():
        dist.barrier()  # every shard is on disk before the checkpoint moves to it
    if ctx.rank == 0:
        old, link = os.path.realpath(path) if os.path.islink(path) else None, f"{path}.link"
        new = f"{path}.{int(old.rsplit('.', 1)[1]) + 1 if old else 0}"
        shutil.rmtree(new, ignore_errors=True)  # left by a crash before a switch, as the link
        if os.path.lexists(link):
            os.remove(link)
        os.replace(tmp, new)
        os.symlink(os.path.basename(new), link)
        if os.path.isdir(path) and not old:  # a real directory (a copy, an older run)
            shutil.rmtree(path)
        os.replace(link, path)  # the switch
        if old:
            shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()  # no rank reads path before rank 0 has switched it


class Checkpointer:
    """save(step) checkpoints to path (a collective). asynchronous: DCP's async_save (torch 2.13:
    checkpoint/state_dict_saver.py) copies the state to CPU memory (_state_dict_stager.py) and
    returns; a thread writes the copy to path.tmp while training goes on. The next save, and the
    last (synchronous: nothing is left to train), first wait for it; only then is path moved to
    path.tmp's directory."""

    def __init__(self, path, stateful, ctx, asynchronous=False):
        self.path, self.ctx, self.asynchronous = path, ctx, asynchronous
        self.stateful = stateful  # (model, optimizer, scheduler)
        self.pending = None  # async_save's Future
        # The background write runs collectives of its own (it gathers the ranks' plans): they
        # get a group of their own, never interleaved with the training loop's on the default
        # one, and a CPU (Gloo) one, as async_save asserts (state_dict_saver.py).
        mine = asynchronous and dist.is_initialized()
        self.group = dist.new_group(backend="gloo") if mine else None

    def __call__(self, step, last=False):
        self.wait()  # one write in flight at most
        if self.asynchronous and not last:
            state = checkpoint_state(self.path, self.stateful, step=step, ctx=self.ctx)
            tmp = fresh_tmp(self.path, self.ctx)
            # returns once the state is staged: training may change the weights from here on
            self.pending = dcp.async_save(state, checkpoint_id=tmp, process_group=self.group)
        else:
            save_checkpoint(self.path, self.stateful, step=step, ctx=self.ctx)

    def wait(self):
        """Wait for the write in flight, if any, until this rank's share of it is on disk; only
        then move path to it (a collective)."""
        if self.pending is not None:
            self.pending.result()
            self.pending = None
            publish(f"{self.path}.tmp", self.path, self.ctx)


def find_checkpoint(out, needs_dcp, ctx):
    """--resume: the checkpoint in out, a DCP directory (checkpoint/) or a torch.save file
    (checkpoint.pt), whichever it holds. needs_dcp: this run reads DCP only (FSDP's shards,
    --async-save). Otherwise one line that says what to change, on every rank."""
    found = [p for p in (out / "checkpoint", out / "checkpoint.pt") if p.exists()]
    ctx.require(found, f"--resume: no checkpoint in {out} (neither checkpoint/ nor checkpoint.pt)")
    ctx.require(
        len(found) == 1,
        f"--resume: {out} holds two checkpoints, checkpoint/ and checkpoint.pt: move away the "
        "one not to resume from",
    )
    ctx.require(
        found[0].suffix != ".pt" or not needs_dcp,
        f"--resume: {found[0]} is a torch.save file (--parallel none or ddp wrote it), and "
        "--parallel fsdp and --async-save read checkpoint/ (DCP) only: resume with --parallel "
        "none or ddp, without --async-save",
    )
    return found[0]


def make_out_dir(path, ctx):
    """Make path and write a file in it, on every rank (each node may have its own disk; a probe
    that only asks os.access trusts root). Called after every refusal: a refused run writes
    nothing."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_test_{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as error:
        ctx.require(False, f"cannot write to {path} ({error.strerror}): pass another --out")


def load_checkpoint(path, stateful, ctx):
    """Restore everything save_checkpoint wrote into stateful (model, optimizer, scheduler);
    return the step to go on from."""
    model, optimizer, scheduler = stateful
    check_fits(path, model, ctx)
    if os.path.isdir(path):  # DCP's directory
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": scheduler.state_dict(),
            "step": 0,
            **saved_rng_slots(path),
        }
        dcp.load(state, checkpoint_id=path)  # fills state in place: each rank reads its shards
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)  # no pickled code runs
        (model.module if isinstance(model, DDP) else model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    # every rank draws the same numbers (same seed): rank 0's state is everyone's
    set_rng_states(state, ctx.device)
    return state["step"]


def export_full_model(model, cfg, path):
    """The unsharded state dict, gathered on rank 0 and written for generate.py (a collective)."""
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:
        torch.save({"config": asdict(cfg), "model": full}, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)  # a reader never sees half a file


# ---- the RNG state (docs: https://pytorch.org/docs/stable/random.html) ----


def rng_states(device):
    """The CPU generator's state and, on an accelerator, that device's own (dropout on a GPU draws
    from the GPU's generator): both are CPU uint8 tensors, whichever device they describe."""
    states = {"rng": torch.get_rng_state()}
    if device.type != "cpu":
        states[f"rng_{device.type}"] = torch.get_device_module(device).get_rng_state(device)
    return states


def set_rng_states(states, device):
    """Restore rng_states(). A checkpoint written on a GPU and resumed on the CPU holds a GPU state
    this run cannot use; one written on the CPU and resumed on a GPU lacks the GPU's. Neither stops
    the resume: one line says so (only dropout's masks then differ from an uninterrupted run's)."""
    torch.set_rng_state(states["rng"])
    mine = f"rng_{device.type}"
    if mine in states:
        torch.get_device_module(device).set_rng_state(states[mine], device)
    unused = ", ".join(sorted(k for k in states if k.startswith("rng_") and k != mine))
    gap = f"{unused} in the checkpoint not restored (this run is on {device.type})"
    if not unused and device.type != "cpu" and mine not in states:
        gap = unused = f"the checkpoint has no {mine} (written on the CPU?)"
    if unused:
        print0(f"resume: {gap}; dropout masks differ from the uninterrupted run's")


def saved_rng_slots(path):
    """dcp.load fills only the keys it is given, and fails on a key the checkpoint lacks: so ask
    the checkpoint's metadata which RNG states it holds, and make room for exactly those."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {
        key: torch.empty(meta.size, dtype=meta.properties.dtype, device="cpu")
        for key, meta in saved.items()
        if key == "rng" or key.startswith("rng_")
    }


# ---- does the checkpoint fit the model? One line, not a traceback, when it does not ----


def check_fits(path, model, ctx):
    """Every rank compares the checkpoint's tensor names and shapes (DCP's metadata, or the file
    memory-mapped) with this model's: not a checkpoint, a DCP shard missing, empty or cut short,
    or one of another model (--n-embd, --n-layer...; --n-head changes no shape), ends the run
    with one line naming the file."""
    try:
        if os.path.isdir(path):
            metadata = dcp.FileSystemReader(path).read_metadata()
            for info in metadata.storage_data.values():  # the file and place of every tensor
                file = os.path.join(path, info.relative_path)  # an empty or cut shard: refused
                if not os.path.isfile(file) or os.path.getsize(file) < info.offset + info.length:
                    raise ValueError(f"{file} is missing or shorter than its metadata says")
            meta = metadata.state_dict_metadata
            saved = {
                k.removeprefix("model."): tuple(m.size)
                for k, m in meta.items()
                if k.startswith("model.")
            }
        else:
            if not zipfile.is_zipfile(path):
                raise ValueError("not a zip archive, as torch.save writes")
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(state, dict) or "model" not in state:
                raise ValueError("it holds no model state")
            saved = {k: tuple(t.shape) for k, t in state["model"].items()}
    except Exception as error:  # whatever the file holds, the reader gets one line
        reason = (str(error).splitlines() or [type(error).__name__])[0][:200]
        ctx.require(False, f"--resume: {path} is not a checkpoint of this script ({reason})")
    here = {k: tuple(v.shape) for k, v in get_model_state_dict(model).items()}
    hint = "resume with the model flags of the run that wrote it"
    for name in sorted(here.keys() - saved.keys()):
        ctx.require(False, f"--resume: {path} has no {name}, which this model has: {hint}")
    for name in sorted(saved.keys() - here.keys()):
        ctx.require(False, f"--resume: {path} has {name}, which this model lacks: {hint}")
    for name, shape in here.items():
        ctx.require(
            saved[name] == shape,
            f"--resume: {path} holds {name} of shape {saved[name]}, this model {shape}: {hint}",
        )
