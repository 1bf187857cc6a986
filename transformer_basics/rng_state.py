"""The RNG state a checkpoint of train.py or train_2d.py holds: dropout must draw the same numbers
after a resume as the uninterrupted run would. Imported by checkpointing.py.

Docs: https://pytorch.org/docs/stable/random.html (get_rng_state, set_rng_state)
"""

import torch
import torch.distributed.checkpoint as dcp

from launch.dist_setup import print0


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
