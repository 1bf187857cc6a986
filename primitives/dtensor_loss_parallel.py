"""loss_parallel: cross-entropy on logits sharded by class, without gathering them.

Under tensor parallelism the output layer's logits come out split by class: Shard(1) of (batch,
classes), each rank holding some classes' columns. F.cross_entropy on that DTensor would all_gather
the whole (batch, classes) tensor onto every rank (for an LLM's vocabulary, the largest activation
there is). Inside torch.distributed.tensor.parallel.loss_parallel() the same call computes the
log-sum-exp from per-rank pieces with all_reduces of (batch,)-sized tensors, and backward gives
each rank the gradient of its own columns, Shard(1) like the logits. Checked against one float64
process: the loss, the gradient's values, its placement and local shape, and no gather.

    torchrun --nproc_per_node=3 primitives/dtensor_loss_parallel.py   # 16 classes over 3: 6, 6, 4
    python primitives/dtensor_loss_parallel.py --nproc 4 --batch 32 --classes 1000

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.
Docs: https://pytorch.org/docs/stable/distributed.tensor.parallel.html#torch.distributed.tensor.parallel.loss_parallel
"""

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel
from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def main(args, ctx):
    per_rank = -(-args.classes // ctx.world_size)  # torch.chunk's split: ceil(classes / N) each
    ctx.require(
        per_rank * (ctx.world_size - 1) < args.classes,
        f"--classes {args.classes} over {ctx.world_size} ranks leaves the last rank no class "
        "(torch.chunk's split): give every rank at least one",
    )
    full_logits, full_targets = batch(args)  # the same on every rank: one seed
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    logits = distribute_tensor(full_logits.to(ctx.device), mesh, [Shard(1)]).requires_grad_()
    targets = distribute_tensor(full_targets.to(ctx.device), mesh, [Replicate()])  # all targets

    with loss_parallel():
        with CommDebugMode() as forward:  # counts the collectives each rank makes
            loss = F.cross_entropy(logits, targets)  # a Replicate scalar: the mean over the batch
        with CommDebugMode() as backward:
            # Inside the context too, as loss_parallel's docstring asks (torch/distributed/tensor/
            # parallel/loss.py). Tried in torch 2.13, a backward outside it does not raise with
            # these DTensor targets: it gathers, and the gradient comes back Replicate, the whole
            # (batch, classes) on every rank (check_gradient_placement catches it); with a plain
            # tensor as the target it raises "got mixed torch.Tensor and DTensor".
            loss.backward()

    print_in_order(
        f"logits {tuple(logits.shape)} split by class: local logits "
        f"{tuple(logits.to_local().shape)}, local gradient {tuple(logits.grad.to_local().shape)}"
    )
    print0(f"collectives on each rank, forward and backward: {count(forward, backward) or 'none'}")
    check_loss_and_gradient(args, ctx, loss.full_tensor(), logits.grad.full_tensor())
    check_logits_never_gathered(ctx, count(forward))
    check_gradient_placement(args, ctx, logits)
    print0(
        f"OK: cross-entropy on logits sharded by class over {ctx.world_size} rank(s) ({args.batch} "
        f"x {args.classes}) matches the plain loss and gradient, Shard(1) like the logits; the "
        "logits were never gathered"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def batch(args):
    gen = torch.Generator().manual_seed(args.seed)
    logits = 3 * torch.randn(args.batch, args.classes, generator=gen, device="cpu")
    return logits, torch.randint(0, args.classes, (args.batch,), generator=gen, device="cpu")


def count(*modes):
    """{collective: calls} over the CommDebugModes given, each named as its Python function."""
    total = {}
    for mode in modes:
        for op, k in mode.get_comm_counts().items():
            name = getattr(op, "__name__", str(op)).rstrip("_")
            total[name] = total.get(name, 0) + k
    return total


def check_loss_and_gradient(args, ctx, loss, grad):
    """Against plain F.cross_entropy in float64 on one process. Bound, relative: float32 ranks
    (eps = 2**-23); a log-sum-exp over C classes and a mean over B rows are sums of C and B terms,
    each off by at most about n * eps of the sum of their sizes (Higham, Accuracy and Stability of
    Numerical Algorithms, 2nd ed., 4.2): 8 * (C + B) * eps leaves room for the exp/log and the
    all_reduce's order of addition."""
    full_logits, targets = batch(args)
    ref = full_logits.double().requires_grad_()
    ref_loss = F.cross_entropy(ref, targets)
    ref_loss.backward()
    bound = 8 * (args.classes + args.batch) * 2.0**-23
    loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    grad_err = ((grad.cpu().double() - ref.grad).abs().max() / ref.grad.abs().max()).item()
    print0(
        f"loss {loss.item():.6f} (plain torch {ref_loss.item():.6f}): relative error "
        f"{loss_err:.1e}, gradient {grad_err:.1e} (bound {bound:.1e})"
    )
    if max(loss_err, grad_err) > bound:
        raise RuntimeError(
            f"rank {ctx.rank}: loss error {loss_err:.1e}, gradient error {grad_err:.1e} > "
            f"{bound:.1e}"
        )


def check_logits_never_gathered(ctx, counted):
    """loss_parallel's forward is all_reduces of (batch,)-sized tensors (torch/distributed/tensor/
    parallel/loss.py); an all_gather here means some rank built the whole (batch, classes)."""
    gathers = {name: k for name, k in counted.items() if "gather" in name}
    if ctx.world_size > 1 and gathers:
        raise RuntimeError(
            f"rank {ctx.rank}: the logits were gathered ({gathers}): run cross_entropy and "
            "backward inside loss_parallel()"
        )


def check_gradient_placement(args, ctx, logits):
    """The gradient is laid out as the logits are: Shard(1), this rank's torch.chunk of the classes
    (read from the DTensors built, and against the split computed here)."""
    size = -(-args.classes // ctx.world_size)
    mine = max(0, min(size, args.classes - ctx.rank * size))
    grad, want = logits.grad, (args.batch, mine)
    got = tuple(grad.to_local().shape)
    if grad.placements != (Shard(1),) or grad.placements != logits.placements or got != want:
        raise RuntimeError(
            f"rank {ctx.rank}: the gradient of the logits is {grad.placements[0]!r} with local "
            f"shape {got}, not Shard(1) with {want} like the logits: the backward ran outside "
            "loss_parallel() and gathered"
        )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--batch", type=int_in(1, 4096), default=8, help="rows of logits")
    parser.add_argument(
        "--classes", type=int_in(1, 1 << 17), default=16, help="classes (16: uneven at 3 ranks)"
    )
    parser.add_argument(
        "--seed", type=int_in(0, 2**31 - 1), default=0, help="seed of the logits and targets"
    )
    run(main, parser.parse_args())
