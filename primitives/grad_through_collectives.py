"""Gradients through collectives, on a global-batch contrastive loss (CLIP/SimCLR style).

Each rank embeds its pairs (a_i, b_i) with a shared Linear encoder, all-gathers every rank's
b-embeddings and scores its a's against the whole global batch: rank s's loss uses rank r's rows,
so rank r's gradient must include what rank s's loss sends back through the gather. dist.all_gather
has no autograd (those terms are lost: the classic bug); the functional all_gather_single is
differentiable (backward: reduce-scatter, SUM); so is an autograd.Function by hand (backward:
all_reduce SUM, keep this rank's slice). --nn-functional adds torch.distributed.nn.functional's
all_gather (deprecated in torch 2.13). Float32 (no TF32), checked against float64 on one process.

    torchrun --nproc_per_node=3 primitives/grad_through_collectives.py
    python primitives/grad_through_collectives.py --nproc 4 --batch 32 --dim-in 64 --dim-out 32
run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.
Docs: https://pytorch.org/docs/stable/distributed.html#autograd-enabled-communication-primitives
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run

# Private in torch 2.13 (the docs' torch.distributed.functional_collectives is not in 2.13); the
# deprecated torch/distributed/nn/functional.py points to it (its FutureWarning, torch 2.13).
import torch.distributed._functional_collectives as funcol


class AllGatherWithGrad(torch.autograd.Function):
    """all_gather whose backward sends each rank the gradient of every rank's loss for its rows."""

    @staticmethod
    def forward(ctx, z):
        parts = [torch.empty_like(z) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, z.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # ours to reduce in place
        # SUM, not AVG: each rank's loss is a term of its own; the 1/world of the global mean comes
        # when DDP averages the gradients. (reduce_scatter_single: the same slice, less traffic.)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad.chunk(dist.get_world_size())[dist.get_rank()]


def main(args, ctx):
    rank, world = ctx.rank, ctx.world_size

    def plain_all_gather(z):  # the bug
        parts = [torch.empty_like(z) for _ in range(world)]
        dist.all_gather(parts, z)  # no autograd: parts are detached copies
        return torch.cat(parts[:rank] + [z] + parts[rank + 1 :])  # the usual patch: only our slot

    # all_gather_single is the torch 2.13 name; 2.12 has the same op as all_gather_tensor_autograd
    functional = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor_autograd
    gathers = {
        "plain dist.all_gather": plain_all_gather,
        "functional all_gather_single": lambda z: functional(z, 0, dist.group.WORLD),
        "autograd.Function by hand": AllGatherWithGrad.apply,
    }
    if args.nn_functional:  # FutureWarning in torch 2.13 (torch/distributed/nn/functional.py)
        from torch.distributed.nn.functional import all_gather as nn_gather

        gathers["torch.distributed.nn.functional.all_gather"] = lambda z: torch.cat(nn_gather(z))
    torch.backends.cuda.matmul.fp32_precision = "ieee"  # float32, never TF32: the bound assumes it
    torch.manual_seed(args.seed)  # the same weights on every rank, as DDP's first broadcast makes
    encoder = torch.nn.Linear(args.dim_in, args.dim_out).to(ctx.device)
    a, b, labels = local_batch(args, ctx)  # labels: a_i's partner is b_i, at its global row
    grads = {}
    for name, gather in gathers.items():
        encoder.zero_grad()
        za, zb = (F.normalize(encoder(t), dim=1) for t in (a, b))
        zb_all = gather(zb)  # (world * B, dim_out): every rank's b-embeddings, in rank order
        loss = F.cross_entropy(za @ zb_all.T / args.temperature, labels)  # mean over my rows
        loss.backward()
        g = torch.cat([p.grad.flatten() for p in encoder.parameters()])
        dist.all_reduce(g)  # what DDP does: sum the ranks' gradients, divide by the world size
        grads[name] = g / world
    check_gradients(args, ctx, grads, loss.detach())  # the loss: the same whichever gather


# ---- The lesson ends here. What follows is how it checks itself. ----


def local_batch(args, ctx):
    """This rank's rows of the global batch, and the global row of each one's partner."""
    rank, B = ctx.rank, args.batch
    a, b = (t[rank * B : (rank + 1) * B].to(ctx.device) for t in global_batch(args, ctx.world_size))
    return a, b, rank * B + torch.arange(B, device=ctx.device)


def global_batch(args, world):
    """The whole global batch, the same on every rank (one seed): pairs (a_i, b_i), b near a."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    a = torch.randn(world * args.batch, args.dim_in, generator=gen, device="cpu")
    return a, a + 0.5 * torch.randn(a.shape, generator=gen, device="cpu")


def single_process_gradient(args, world):
    """Plain torch, one process, float64, the whole global batch: L = mean over all world*B rows =
    (1/world) sum_r L_r, L_r the mean over rank r's rows. With a correct gather, rank r's gradient
    g_r is L_r's own gradient plus (the gather's backward) every other L_s's gradient through rank
    r's embeddings, so sum_r g_r = d(sum_r L_r)/dtheta = world * dL/dtheta: the DDP average of the
    g_r is dL/dtheta."""
    torch.manual_seed(args.seed)
    encoder = torch.nn.Linear(args.dim_in, args.dim_out, device="cpu").double()  # the ranks' own
    a, b = (t.double() for t in global_batch(args, world))
    za, zb = F.normalize(encoder(a), dim=1), F.normalize(encoder(b), dim=1)
    loss = F.cross_entropy(
        za @ zb.T / args.temperature, torch.arange(world * args.batch, device="cpu")
    )
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in encoder.parameters()])


def check_gradients(args, ctx, grads, loss):
    rank, B = ctx.rank, args.batch
    print_in_order(
        f"rows {rank * B}..{(rank + 1) * B - 1} of {ctx.world_size * B}, local loss {loss:.4f}"
    )
    ref_loss, ref = single_process_gradient(args, ctx.world_size)
    # Bound, relative to the largest entry: float32 ranks (eps = 2**-23) against a float64
    # reference. A float32 sum of n terms errs by at most about n*eps of the sum of their sizes
    # (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., 4.2); the longest sums have
    # n = world*B (softmax over the global batch) or dim_in (encoder), and a few are chained
    # (encoder, normalise, similarity, softmax, then back): 8 * n * eps.
    bound = 8 * (ctx.world_size * args.batch + args.dim_in) * 2.0**-23
    dist.all_reduce(loss)
    if abs(loss.item() / ctx.world_size - ref_loss.item()) > bound * ref_loss.item():
        raise RuntimeError(
            f"mean of the ranks' losses {loss.item() / ctx.world_size} != {ref_loss.item()}"
        )
    for name, g in grads.items():
        err = ((g.cpu().double() - ref).abs().max() / ref.abs().max()).item()
        if name == "plain dist.all_gather":  # a demonstration: wrong once another rank uses us
            why = "the other ranks' terms are missing"
            why = "nothing crosses ranks at 1 rank" if ctx.world_size == 1 else why
            print0(f"with {name}: max gradient error {err:.2e} (expected: {why})")
            if (err > bound) != (ctx.world_size > 1):
                raise RuntimeError(
                    f"{name}: error {err:.2e}, bound {bound:.1e}: the demonstration did not show it"
                )
            continue
        print0(f"with {name}: max gradient error {err:.2e} (bound {bound:.1e})")
        if err > bound:
            raise RuntimeError(
                f"rank {ctx.rank}: {name}: max gradient error {err:.2e} > bound {bound:.1e} "
                f"against the single-process gradient"
            )
    print0(
        f"OK: a global-batch contrastive loss over {ctx.world_size} rank(s) gets the "
        f"single-process gradient through a differentiable all_gather ({len(grads) - 1} ways); "
        f"plain dist.all_gather {'does too at 1 rank' if ctx.world_size == 1 else 'does not'}"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--batch", type=int_in(1, 4096), default=8, help="pairs per rank (global: world x this)"
    )
    parser.add_argument("--dim-in", type=int_in(1, 16384), default=16, help="input features")
    parser.add_argument("--dim-out", type=int_in(1, 16384), default=8, help="embedding size")
    parser.add_argument(
        "--temperature",
        type=float_in(0.01, 100),
        default=0.1,
        help="divides the cosine similarities",
    )
    parser.add_argument(
        "--seed", type=int_in(0, 2**31 - 1), default=0, help="seed of the weights and data"
    )
    parser.add_argument(
        "--nn-functional",
        action="store_true",
        help="also use torch.distributed.nn.functional.all_gather (FutureWarning in torch 2.13)",
    )
    run(main, parser.parse_args())
