"""The checkpoints of train.py and train_2d.py: complete, atomic, resumable on another machine.

A checkpoint holds everything a run needs to go on exactly: model, optimizer, scheduler, step
and RNG state. How it is written depends on what each rank holds:
  replicated (one process, DDP): every rank has the same model; rank 0 writes it with torch.save;
  sharded (FSDP, FSDP x TP): each rank writes its own shards with torch.distributed.checkpoint
    (DCP) into one directory, and reads back the shards it owns; nothing is gathered.
Either way it is written under a temporary name, then renamed: a crash never leaves half a
checkpoint. export_full_model() also gathers the unsharded weights for generate.py.

Docs: https://pytorch.org/docs/stable/distributed.checkpoint.html
"""

import os
import shutil
import zipfile
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.dist_setup import print0


def save_checkpoint(path, model, optimizer, scheduler, step, ctx):
    """A collective: every rank calls it."""
    extra = {"scheduler": scheduler.state_dict(), "step": step, **rng_states(ctx.device)}
    if isinstance(model, FSDPModule):  # sharded: every rank writes its own shards
        model_sd, optim_sd = get_state_dict(model, optimizer)
        tmp = f"{path}.tmp"
        if ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        dcp.save({"model": model_sd, "optimizer": optim_sd, **extra}, checkpoint_id=tmp)
        dist.barrier()  # every shard is on disk before the directory is renamed
        if ctx.rank == 0:
            if os.path.exists(path):
                os.replace(path, f"{path}.old")
            os.replace(tmp, path)
            shutil.rmtree(f"{path}.old", ignore_errors=True)
    elif ctx.rank == 0:  # replicated: rank 0's copy is everyone's
        raw = model.module if isinstance(model, DDP) else model
        state = {"model": raw.state_dict(), "optimizer": optimizer.state_dict(), **extra}
        torch.save(state, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
    if dist.is_initialized():
        dist.barrier()  # nobody reads or rewrites the checkpoint before it is complete


def load_checkpoint(path, model, optimizer, scheduler, ctx):
    """Restore everything save_checkpoint wrote; return the step to go on from."""
    check_fits(path, model, ctx)
    if isinstance(model, FSDPModule):
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


def export_full_model(model, cfg, path, rank):
    """The unsharded state dict, gathered on rank 0 and written for generate.py (a collective)."""
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save({"config": asdict(cfg), "model": full}, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)  # a reader never sees half a file


# ---- does the checkpoint fit the model? One line, not a traceback, when it does not ----


def check_fits(path, model, ctx):
    """Every rank reads the checkpoint's list of tensors (DCP's metadata, or the torch.save file
    memory-mapped: nothing is loaded yet) and compares the model's names and shapes with this
    model's. A file that is not a checkpoint, or one of another model (another --n-embd,
    --n-layer, --block-size...), ends the run on every rank with one line naming the file and the
    first difference. (--n-head changes no shape: a checkpoint cannot tell it.)"""
    try:
        if isinstance(model, FSDPModule):
            meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
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


# ---- RNG state: dropout must draw the same numbers after a resume ----


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
    unused = sorted(k for k in states if k.startswith("rng_") and k != mine)
    if unused:
        print0(
            f"resume: {', '.join(unused)} in the checkpoint not restored (this run is on "
            f"{device.type}); dropout masks differ from the uninterrupted run's"
        )
    elif device.type != "cpu" and mine not in states:
        print0(
            f"resume: the checkpoint has no {mine} (written on the CPU?); the {device.type} "
            "generator keeps this run's seed, dropout masks differ from the uninterrupted run's"
        )


def saved_rng_slots(path):
    """dcp.load fills only the keys it is given, and fails on a key the checkpoint lacks: so ask
    the checkpoint's metadata which RNG states it holds, and make room for exactly those."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {
        key: torch.empty(meta.size, dtype=meta.properties.dtype, device="cpu")
        for key, meta in saved.items()
        if key == "rng" or key.startswith("rng_")
    }
