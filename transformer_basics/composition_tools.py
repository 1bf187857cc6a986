"""What transformer_basics/composition.py measures and checks against: the graphs compiled, the
bytes saved for backward, each rank's batch, and the plain model trained on one process, with
the check of the losses against it. Not a lesson: imported."""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from launch.dist_setup import print0


def counting(backend, graphs):
    """A torch.compile backend that notes each graph dynamo hands it, then compiles it with
    `backend` (torch._dynamo.lookup_backend: in torch/_dynamo/__init__.py's __all__, under a
    private package)."""

    def compile_graph(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    return compile_graph


def saved_tensors(model, storages):
    """Context manager: each tensor autograd saves for backward passes through pack
    (https://pytorch.org/docs/stable/autograd.html#hooks-for-saved-tensors);
    storages[data_ptr] = its bytes, so views count once; the weights are left out (they are kept
    anyway), also when saved as a view (linear saves weight.t()), by storage; a DTensor weight
    (FSDP2's sharded form) by its local tensor."""

    # a hook is a frame like any other: a compiled model would try to compile it
    @torch.compiler.disable
    def pack(t):
        # read at each save, not once: inside FSDP2's forward the module's parameters are the
        # all-gathered ones
        weights = {
            getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in model.parameters()
        }
        if t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def batch(args, step, rank, device):
    """Rank `rank`'s tokens at `step` (random bytes): a function of (seed, step, rank), so that
    one process can replay them."""
    generator = torch.Generator().manual_seed(args.seed + 7919 * step + 104729 * rank)
    shape = (args.batch_size, args.block_size + 1)
    tokens = torch.randint(256, shape, device="cpu", generator=generator)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def train_reference(model, args, ctx, dtype, dropout=True):
    """One process, plain eager model, no checkpoint, no compile: every rank's batch in turn (with
    that rank's dropout seed), the mean of their losses, one SGD step. The loss of each step."""
    model = copy.deepcopy(model).to(dtype)
    for m in model.modules() if not dropout else ():
        if isinstance(m, nn.Dropout) or hasattr(m, "dropout"):  # nn.Dropout's p, attention's
            m.p, m.dropout = 0.0, 0.0
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses = torch.zeros(args.steps, dtype=torch.float64, device="cpu")
    for step in range(args.steps):
        for rank in range(ctx.world_size):
            x, y = batch(args, step, rank, ctx.device)
            torch.manual_seed(args.seed + 1000 * step + rank)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / ctx.world_size
            loss.backward()
            losses[step] += loss.item()
        optimizer.step()
        optimizer.zero_grad()
    return losses


def check_losses(reference, losses, args, ctx):
    """The composed run's losses against the plain model trained on one process; raises if they
    differ, else returns what was run (for the OK line)."""
    # equal batches on every rank: the average is the global mean loss
    dist.all_reduce(losses, op=dist.ReduceOp.AVG)
    ref32 = train_reference(reference, args, ctx, torch.float32)
    # The composed run does the same float32 arithmetic in other orders (gradients summed across
    # ranks, fused or reordered by the compiler); each order is off the exact result by about
    # float32's own rounding, which we measure: float32 against float64, the same model without
    # dropout (float64 draws other masks). 16x that.
    no_dropout = [
        train_reference(reference, args, ctx, t, False) for t in (torch.float32, torch.float64)
    ]
    rounding = (no_dropout[0] - no_dropout[1]).abs().max().item()
    bound = 16 * max(rounding, torch.finfo(torch.float32).eps * ref32.abs().max().item())
    diff = (losses.double().cpu() - ref32).abs().max().item()
    compiled = f"compiled ({args.compile_backend})" if args.compile else "eager"
    what = f"{args.parallel}, {'checkpointed' if args.ac else 'no AC'}, {compiled}"
    print0(
        f"losses {', '.join(f'{v:.6f}' for v in losses.tolist())}; "
        f"one process {', '.join(f'{v:.6f}' for v in ref32.tolist())}\n"
        f"max difference {diff:.1e}, bound {bound:.1e} (16 x measured float32 rounding "
        f"{rounding:.1e})"
    )
    if not diff <= bound:
        raise RuntimeError(
            f"[rank {ctx.rank}] {what}: losses differ from one process's plain model by "
            f"{diff:.1e} (bound {bound:.1e})"
        )
    return f"{what}{' in another order' if args.other_order else ''} on {ctx.world_size} rank(s)"
