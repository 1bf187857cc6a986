"""loss_parallel: cross-entropy on logits sharded by class, without gathering them.

Under tensor parallelism the output layer's logits come out split by class: Shard(1) of (batch, classes),
each rank holding some classes' columns. F.cross_entropy on that DTensor would all_gather the whole
(batch, classes) tensor onto every rank (for an LLM's vocabulary, the largest activation there is).
Inside torch.distributed.tensor.parallel.loss_parallel() the same call computes the log-sum-exp from
per-rank pieces with all_reduces of (batch,)-sized tensors, and backward gives each rank the gradient
of its own columns; the backward must run inside the context too. Checked against one float64 process.

    torchrun --nproc_per_node=3 primitives/dtensor_loss_parallel.py       # 16 classes over 3: 6, 6, 4
    python primitives/dtensor_loss_parallel.py --nproc 4 --batch 32 --classes 1000

Docs: https://pytorch.org/docs/stable/distributed.tensor.parallel.html#torch.distributed.tensor.parallel.loss_parallel
"""

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel
from launch.dist_setup import lesson_parser, print0, print_in_order, run, test_flags


def main(args, ctx):
    ctx.require(args.batch >= 1 and args.classes >= 1, "--batch and --classes must be at least 1")
    full_logits, full_targets = batch(args)  # the same on every rank: one seed
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    logits = distribute_tensor(
        full_logits.to(ctx.device), mesh, [Shard(1)]
    ).requires_grad_()  # my classes
    targets = distribute_tensor(
        full_targets.to(ctx.device), mesh, [Replicate()]
    )  # every rank: all targets

    with CommDebugMode() as comms:
        if (
            args.without_loss_parallel
        ):  # the same call outside the context: DTensor gathers the logits first
            loss = F.cross_entropy(logits, targets)
            loss.backward()
        else:
            with loss_parallel():
                loss = F.cross_entropy(
                    logits, targets
                )  # a Replicate scalar: the mean over the whole batch
                loss.backward()  # inside the context too, or it raises

    mine = logits.to_local()
    print_in_order(
        f"logits {tuple(logits.shape)} split by class: local logits {tuple(mine.shape)}, "
        f"local gradient {tuple(logits.grad.to_local().shape)}"
    )
    counted = {
        getattr(op, "__name__", str(op)).rstrip("_"): k for op, k in comms.get_comm_counts().items()
    }
    print0(f"collectives on each rank, forward and backward: {counted or 'none'}")
    check_loss_and_gradient(args, ctx, loss.full_tensor(), logits.grad.full_tensor())
    check_logits_never_gathered(ctx, counted)
    print0(
        f"OK: cross-entropy on logits sharded by class over {ctx.world_size} rank(s) ({args.batch} x "
        f"{args.classes}) matches the plain loss and gradient; the logits were never gathered"
    )


def batch(args):
    gen = torch.Generator().manual_seed(args.seed)
    logits = 3 * torch.randn(args.batch, args.classes, generator=gen, device="cpu")
    return logits, torch.randint(0, args.classes, (args.batch,), generator=gen, device="cpu")


def check_loss_and_gradient(args, ctx, loss, grad):
    """Against plain F.cross_entropy in float64 on one process. Bound, relative: float32 ranks (eps = 2**-23);
    a log-sum-exp over C classes and a mean over B rows are sums of C and B terms, each off by at most about
    n * eps of the sum of their sizes (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., 4.2):
    8 * (C + B) * eps leaves room for the exp/log and the all_reduce's order of addition."""
    full_logits, targets = batch(args)
    ref = full_logits.double().requires_grad_()
    ref_loss = F.cross_entropy(ref, targets)
    ref_loss.backward()
    bound = 8 * (args.classes + args.batch) * 2.0**-23
    loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    grad_err = ((grad.cpu().double() - ref.grad).abs().max() / ref.grad.abs().max()).item()
    print0(
        f"loss {loss.item():.6f} (plain torch {ref_loss.item():.6f}): relative error {loss_err:.1e}, "
        f"gradient {grad_err:.1e} (bound {bound:.1e})"
    )
    if max(loss_err, grad_err) > bound:
        raise RuntimeError(
            f"rank {ctx.rank}: loss error {loss_err:.1e}, gradient error {grad_err:.1e} > {bound:.1e}"
        )


def check_logits_never_gathered(ctx, counted):
    """loss_parallel's forward is all_reduces of (batch,)-sized tensors (torch/distributed/tensor/parallel/loss.py);
    an all_gather here means some rank built the whole (batch, classes) logits."""
    gathers = {name: k for name, k in counted.items() if "gather" in name}
    if ctx.world_size > 1 and gathers:
        raise RuntimeError(
            f"rank {ctx.rank}: the logits were gathered ({gathers}): run cross_entropy and "
            "backward inside loss_parallel()"
        )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--batch", type=int, default=8, help="rows of logits")
    parser.add_argument("--classes", type=int, default=16, help="classes (16: uneven at 3 ranks)")
    parser.add_argument("--seed", type=int, default=0, help="logits and targets")
    test_flags(parser).add_argument(
        "--without-loss-parallel",
        action="store_true",
        help="F.cross_entropy on the sharded logits outside loss_parallel()",
    )
    run(main, parser.parse_args())
