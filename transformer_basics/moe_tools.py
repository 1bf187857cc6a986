"""What transformer_basics/train_moe.py starts from and reports: the experts' initial weights (the
same on every rank and in the one-process check), and per rank its experts, the rows it exchanged,
its state and the collectives of a step. Not a lesson: imported."""

import torch

from launch.dist_setup import print_in_order


def init_moe(args, layer):
    """Router (E, C), W1 (E, C, hidden), W2 (E, hidden, C) of all E experts, the same on every rank
    (CPU)."""
    g = torch.Generator().manual_seed(args.seed * 1000 + int(layer))
    E, C, H = args.experts, args.n_embd, args.hidden
    rand = lambda *shape, std: torch.randn(shape, generator=g, device="cpu") * std  # noqa: E731
    w2_std = 0.02 / (2 * args.n_layer) ** 0.5
    return rand(E, C, std=C**-0.5), rand(E, C, H, std=C**-0.5), rand(E, H, C, std=w2_std)


def report(model, prof, mesh, args, ctx):
    """Per rank: its experts, (token, choice) rows to and from the other ep ranks (forward, all
    layers: backward sends as many), state bytes, collectives per step."""
    me, mlps = mesh["ep"].get_local_rank(), [block.mlp for block in model.blocks.values()]
    local = args.experts // args.ep
    first = me * local  # this rank's experts: first .. first + local - 1
    steps = list(zip(*(mlp.splits for mlp in mlps)))  # [step][layer] -> (sent, received, ran)
    sent, received = ([sum(sum(s[i]) - s[i][me] for s in step) for step in steps] for i in (0, 1))
    nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    params = list(model.parameters())
    expert_bytes = nbytes(w for mlp in mlps for w in (mlp.w1, mlp.w2))
    # AdamW keeps exp_avg and exp_avg_sq, each zeros_like(param) (torch/optim/adam.py, _init_group)
    state = nbytes(params) + nbytes(p.grad for p in params) + 2 * nbytes(params)
    counts = {e.key: e.count for e in prof.key_averages()}  # c10d's ops, whatever the backend
    all_to_all, all_reduce = (
        counts.get(f"c10d::{op}", 0) / args.steps for op in ("alltoall_base_", "allreduce_")
    )
    print_in_order(
        f"dp {mesh['dp'].get_local_rank()}, ep {me}: experts {first}..{first + local - 1} of each "
        f"layer; rows sent to / received from the other ep ranks per step: {sent} / {received}\n"
        f"state {state:,} B = parameters {nbytes(params):,} (experts {expert_bytes:,}) + "
        f"gradients + AdamW's 2 moments; per step: {all_to_all:g} all_to_all, {all_reduce:g} "
        "all_reduce"
    )
