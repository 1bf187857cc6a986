"""What the transformer_basics lessons measure with: the peak CUDA memory, the collectives a
profiled step ran, the state a rank holds, the activations saved for backward (benchmark.py,
train_cp.py). Not a lesson: imported."""

import collections

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


def synchronize(device):
    if device.type != "cpu":  # a GPU runs ahead of the host: time only what it has finished
        torch.accelerator.synchronize()


class PeakMemory:
    """On CUDA, the peak allocated memory from now on, above what was allocated now."""

    def __init__(self, device):
        self.device, self.cuda = device, device.type == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
            self.before = torch.cuda.memory_allocated(device)

    def peak(self):
        if not self.cuda:
            return None
        synchronize(self.device)
        return (torch.cuda.max_memory_allocated(self.device) - self.before) / 2**20


# part of a c10d op's name (c10d::allreduce_, c10d::_allgather_base_, ...) -> the collective it is
KINDS = {"allreduce": "all_reduce", "allgather": "all_gather", "alltoall": "all_to_all"}
KINDS |= {"reduce_scatter": "reduce_scatter", "broadcast": "broadcast"}


def collectives(prof):
    """'2 all_reduce', '9 all_gather, 5 reduce_scatter', ...: the c10d ops of one profiled step."""
    counts = collections.Counter(
        what
        for e in prof.events()
        if e.name.startswith("c10d::")
        for part, what in KINDS.items()
        if part in e.name
    )
    return ", ".join(f"{n} {what}" for what, n in sorted(counts.items())) or "-"


def state_bytes(model):
    """Parameters + gradients + two AdamW moments held by this rank, in bytes."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return 4 * sum(t.numel() * t.element_size() for t in local)


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
