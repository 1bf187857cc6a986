"""Expert parallelism: a mixture-of-experts MLP whose experts are spread over the ranks.

Each rank holds its own tokens and E/N of the E experts; the router is replicated. Top-k routing,
dropless, in dispatch_to_experts (train_moe.py's too): all_to_all_single of the per-expert token
counts (a rank learns how many rows it gets only from the senders), then of the rows (uneven
splits) to their experts and back, differentiable: backward sends the gradients back the same way.
Load balancing: Switch's aux loss. Checked against one float64 process: output, aux loss, gradients.

    torchrun --nproc_per_node=2 transformer_basics/expert_parallel.py
    python transformer_basics/expert_parallel.py --nproc 4 --experts 16 --tokens 64 --dim 64

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_to_all_single
      Switch Transformer (the load-balancing loss, eq. 4): https://arxiv.org/abs/2101.03961
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run

# torch 2.13, torch/distributed/_functional_collectives.py (private): all_to_all_single_autograd's
# backward is all_to_all_single with the splits swapped (torch.distributed.nn's is deprecated).
import torch.distributed._functional_collectives as funcol


def dispatch_to_experts(x, expert, w1, w2, group):
    """Rows x (T, dim) to their experts `expert` (T, k) on group's ranks (rank r holds experts
    r*len(w1)..) and back: (T, k, dim); rows sent to, received from each rank, per local expert."""
    N, local, k = dist.get_world_size(group), w1.shape[0], expert.shape[1]
    order = expert.flatten().argsort(stable=True)  # the T*k (token, choice) rows, by expert
    send_counts = torch.bincount(expert.flatten(), minlength=N * local)  # rows per expert
    recv_counts = torch.empty_like(send_counts)  # [source rank][local expert]
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # `local` counts to each rank
    send_splits = send_counts.view(N, local).sum(1).tolist()  # rows to each rank (a host sync)
    recv_splits = recv_counts.view(N, local).sum(1).tolist()  # rows from each rank
    received = funcol.all_to_all_single_autograd(x[order // k], recv_splits, send_splits, group)
    which = torch.arange(local, device=x.device).repeat(N).repeat_interleave(recv_counts)
    done = torch.zeros((len(received), w2.shape[-1]), dtype=x.dtype, device=x.device)
    for j in range(local):  # a real MoE sorts the rows by expert and runs one grouped GEMM
        rows = (which == j).nonzero().squeeze(1)
        done = done.index_copy(0, rows, F.gelu(received[rows] @ w1[j]) @ w2[j])
    back = funcol.all_to_all_single_autograd(done, send_splits, recv_splits, group)  # home
    per_choice = torch.zeros_like(back).index_copy(0, order, back)  # back in (token, choice) order
    ran = recv_counts.view(N, local).sum(0).tolist()  # rows per local expert
    return per_choice.view(len(x), k, -1), (send_splits, recv_splits, ran)


def main(args, ctx):
    N, E, k, local = ctx.world_size, args.experts, args.top_k, args.experts // ctx.world_size
    ctx.require(
        E % N == 0,
        f"--experts {E} must be a multiple of the {N} ranks: pick --experts {E // N * N or N} "
        f"or {E // N * N + N}",
    )
    ctx.require(k <= E, f"--top-k must be between 1 and --experts ({E}), got {k}")
    torch.backends.cuda.matmul.fp32_precision = "ieee"  # never TF32 (the check's bound)
    router, w1, w2, x_all, y_all = init(args, N)  # the whole MoE and global batch, on every rank
    router = router.to(ctx.device).requires_grad_()  # replicated, like a data-parallel parameter
    mine, rows = slice(ctx.rank * local, (ctx.rank + 1) * local), rows_of(ctx.rank, args)
    w1, w2 = (w[mine].to(ctx.device).requires_grad_() for w in (w1, w2))  # this rank's experts
    x, y = x_all[rows].to(ctx.device).requires_grad_(), y_all[rows].to(ctx.device)

    probs = F.softmax(x @ router.T, dim=-1)  # (T, E)
    weights, expert = probs.topk(k, dim=-1)  # (T, k) each
    weights = weights / weights.sum(-1, keepdim=True)  # renormalised over the k chosen
    per_choice, (sent, received, ran) = dispatch_to_experts(x, expert, w1, w2, dist.group.WORLD)
    out = (weights.unsqueeze(-1) * per_choice).sum(1)  # (T, dim)
    # the share of (token, choice) pairs per expert (no gradient) and its mean router probability
    f = torch.bincount(expert.flatten(), minlength=E).to(probs.dtype) / (args.tokens * k)
    aux = E * (f * probs.mean(0)).sum()  # Switch Transformer's eq. 4; 1 when uniform
    # This rank's part of the global loss: MSE summed over the global batch, plus the aux mean.
    loss = ((out - y) ** 2).sum() / (N * args.tokens * args.dim) + args.aux_weight * aux / N
    loss.backward()  # every rank: the backward all_to_alls are collectives too
    dist.all_reduce(router.grad)  # SUM, as DDP would (DDP averages: scale the loss by N there)
    print_routing(mine, sent, received, ran, aux)
    check(args, ctx, probs.detach(), out, aux, x.grad, router.grad, w1.grad, w2.grad, mine)


# ---- The lesson ends here. What follows is how it checks itself. ----


def rows_of(rank, args):
    """This rank's tokens in the global batch."""
    return slice(rank * args.tokens, (rank + 1) * args.tokens)


def init(args, N):
    """Router (E, dim), experts' W1 (E, dim, hidden) and W2 (E, hidden, dim), the global batch and
    its targets (N*T, dim), the same on every rank (one seed, CPU)."""
    g = torch.Generator().manual_seed(args.seed)
    E, d, h = args.experts, args.dim, args.hidden
    rand = lambda *shape, scale: torch.randn(shape, generator=g, device="cpu") * scale  # noqa: E731
    router, w1, w2 = (
        rand(E, d, scale=d**-0.5),
        rand(E, d, h, scale=d**-0.5),
        rand(E, h, d, scale=h**-0.5),
    )
    x = rand(N * args.tokens, d, scale=1.0)
    targets = torch.Generator().manual_seed(args.seed + 2)
    target = torch.randn(x.shape, generator=targets, device="cpu")
    return router, w1, w2, x, target


def print_routing(mine, sent, received, ran, aux):
    print_in_order(
        f"experts {mine.start}..{mine.stop - 1}: sends {sent} rows to ranks 0..{len(sent) - 1}, "
        f"receives {received}; its experts run on {ran} rows; aux loss {aux.item():.4f}"
    )


def reference(args, N):
    """Plain torch, one process, float64: every expert on every token, then pick the k chosen."""
    router, w1, w2, x, y = (t.double() for t in init(args, N))
    router, w1, w2, x = (t.requires_grad_() for t in (router, w1, w2, x))
    probs = F.softmax(x @ router.T, dim=-1)
    weights, expert = probs.topk(args.top_k, dim=-1)
    all_out = F.gelu(torch.einsum("td,edh->eth", x, w1)) @ w2  # (E, N*T, dim)
    chosen = all_out[expert, torch.arange(len(x), device="cpu").unsqueeze(1)]  # (N*T, k, dim)
    out = (weights.unsqueeze(-1) / weights.sum(-1, keepdim=True).unsqueeze(-1) * chosen).sum(1)
    auxes = []
    for p, e in zip(probs.split(args.tokens), expert.split(args.tokens)):  # rank by rank
        f = torch.bincount(e.flatten(), minlength=args.experts).double() / e.numel()
        auxes.append(args.experts * (f * p.mean(0)).sum())
    aux = torch.stack(auxes)
    (((out - y) ** 2).mean() + args.aux_weight * aux.mean()).backward()
    return out.detach(), aux.detach(), x.grad, router.grad, w1.grad, w2.grad, probs.detach()


def check(args, ctx, probs, out, aux, x_grad, router_grad, w1_grad, w2_grad, mine):
    ref_out, ref_aux, ref_x, ref_router, ref_w1, ref_w2, ref_probs = reference(args, ctx.world_size)
    rows = rows_of(ctx.rank, args)
    # The routing is discrete: where the k-th and (k+1)-th probabilities (float64) lie closer than
    # twice the measured float32 error, float32 may pick the other expert, legitimately (not at the
    # defaults).
    top = ref_probs[rows].topk(min(args.top_k + 1, args.experts)).values
    margin = (top[:, -2] - top[:, -1]).min().item() if args.top_k < args.experts else 1.0
    tie = 2 * (probs.cpu().double() - ref_probs[rows]).abs().max().item()
    if margin <= tie:
        raise RuntimeError(
            f"[rank {ctx.rank}] a token's top-{args.top_k} routing is a near-tie in float32 "
            f"({margin:.1e} <= {tie:.1e}): pick another --seed"
        )
    # float32 against float64, relative to the largest entry: a float32 sum of n terms errs by at
    # most about n * 2**-23 of the sum of their sizes (Higham, Accuracy and Stability, 2nd ed.,
    # 4.2); the longest sums here are dim or hidden long (matmuls) or N*T (the router's gradient),
    # a few chained: 8 * n * eps.
    bound = 8 * (args.dim + args.hidden + ctx.world_size * args.tokens) * 2.0**-23
    pairs = {
        "output": (out, ref_out[rows]),
        "aux loss": (aux, ref_aux[ctx.rank]),
        "input gradient": (x_grad, ref_x[rows]),
        "router gradient": (router_grad, ref_router),
        "W1 gradient": (w1_grad, ref_w1[mine]),
        "W2 gradient": (w2_grad, ref_w2[mine]),
    }
    errors = {}
    for name, (got, ref) in pairs.items():
        # None: no gradient came
        got = torch.zeros_like(ref) if got is None else got.detach().cpu().double()
        errors[name] = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()
    print_in_order("max relative error: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    bad = [f"{n} {e:.1e}" for n, e in errors.items() if not e <= bound]
    dist.barrier()  # every rank has printed before any raises
    if bad:
        raise RuntimeError(
            f"[rank {ctx.rank}] differs from one process beyond {bound:.1e}: {', '.join(bad)}"
        )
    print0(
        f"OK: expert parallelism over {ctx.world_size} rank(s), {args.experts} experts, "
        f"top-{args.top_k} dropless: output, aux loss and every gradient equal one process's "
        f"(bound {bound:.1e})"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--experts", type=int_in(1, 4096), default=8, help="E; a multiple of ranks (8: 1, 2, 4, 8)"
    )
    parser.add_argument("--top-k", type=int_in(1, 64), default=2, help="experts per token")
    parser.add_argument("--tokens", type=int_in(1, 65_536), default=16, help="tokens per rank")
    parser.add_argument("--dim", type=int_in(1, 16_384), default=16, help="model width")
    parser.add_argument("--hidden", type=int_in(1, 65_536), default=32, help="an expert's width")
    parser.add_argument(
        "--aux-weight", type=float_in(0, 100), default=0.01, help="the load-balancing loss's weight"
    )
    parser.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0, help="weights, tokens")
    run(main, parser.parse_args())
