"""Which device and backend each rank uses, and how many ranks `python lesson.py` starts
(launch/dist_setup.py calls these; tests/test_foundation.py tests them with mocked GPU counts)."""

import os

import torch
import torch.distributed as dist


class UsageError(Exception):
    """The lesson was started wrongly: each rank prints one line and exits with code 2."""


def choose_device(local_rank, local_world_size, backend=None, device=None):
    """Return (torch.device, backend name) for this rank, or raise UsageError."""
    # The accelerator torch was built for: cuda with PyPI's CUDA build even on a machine without a
    # GPU, None with a CPU build (torch 2.13's current_accelerator docstring: without
    # check_available=True it checks the build only). device_count() is 0 without a usable device,
    # so n_accel, not accel, says whether this machine has GPUs.
    accel = torch.accelerator.current_accelerator()
    n_accel = torch.accelerator.device_count() if accel is not None else 0
    asked = f"--device {device}" if device else f"--backend {backend}"
    if device is None:
        if backend is None:
            device = accel.type if accel is not None and n_accel >= local_world_size else "cpu"
        else:
            device = "cpu" if backend == "gloo" else (accel.type if accel is not None else "cuda")
    try:
        device_type = torch.device(device).type
    except RuntimeError:
        raise UsageError(f"unknown device {device!r}: use cpu or cuda") from None
    if device_type != "cpu" and (accel is None or accel.type != device_type or n_accel == 0):
        raise UsageError(
            f"{asked} needs a {device_type} device and this machine has none: "
            "use --backend gloo (CPU)"
        )
    backend = backend or dist.get_default_backend_for_device(device_type)
    if not dist.is_backend_available(backend):
        raise UsageError(
            f"backend {backend!r} is not available in this build of torch: use --backend gloo"
        )
    if device_type == "cpu":
        return torch.device("cpu"), backend
    if backend != "gloo" and n_accel < local_world_size:
        raise UsageError(
            f"{local_world_size} ranks on this node but only {n_accel} {device_type} device(s): "
            f"{backend} needs one per rank; start at most {n_accel} per node or use --backend gloo"
        )
    return torch.device(device_type, local_rank % n_accel), backend


def cores():
    """The cores this process may run on (its affinity mask, under Slurm or taskset), else all."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def default_nproc(args):
    """`python lesson.py` without --nproc: one rank per GPU, else 2, and at least the lesson's
    min_ranks (a lesson that needs a peer still runs on a 1-GPU machine: its 2 ranks fall back to
    CPU + Gloo)."""
    wants_cpu = args.backend == "gloo" or args.device == "cpu"
    gpus = torch.accelerator.device_count() if not wants_cpu else 0
    return max(gpus or 2, getattr(args, "min_ranks", 1))
