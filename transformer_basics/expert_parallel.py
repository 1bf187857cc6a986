"""Expert parallelism: a mixture-of-experts MLP whose experts are spread over the ranks.

Each rank holds its own tokens and E/N of the E experts (rank r: experts r*E/N .. (r+1)*E/N - 1); the
router is replicated. Top-k routing, dropless (every token reaches its k experts, no capacity limit):
  1. all_to_all_single of the per-expert token counts: routing is data-dependent, so a rank learns how
     many rows each rank will send it only from the senders (the split sizes must agree pairwise);
  2. all_to_all_single of the token rows, uneven splits, then each local expert runs on its rows;
  3. the reverse all_to_all brings the results home, combined with the router's weights.
Both token exchanges are the differentiable functional all_to_all, so backward sends the gradients the
same way back (steps 1 to 3: dispatch_to_experts, above main; train_moe.py calls it on its ep group).
Load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4), on each rank's tokens:
  aux = E * sum_e f_e * P_e,  f_e = share of the T*k (token, choice) pairs routed to e (no gradient),
                              P_e = mean router probability of e over the T tokens;  1 when uniform.
The ranks compute in float32 (no TF32), checked against the same MoE on one process (float64, the global
batch): output, aux loss, the gradients of the input, the router and every expert's weights on its owner.

    torchrun --nproc_per_node=2 transformer_basics/expert_parallel.py
    python transformer_basics/expert_parallel.py --nproc 4 --experts 16 --tokens 64 --dim 64

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_to_all_single
      https://arxiv.org/abs/2101.03961 (Switch Transformer: the load-balancing loss)
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from launch.dist_setup import lesson_parser, print0, print_in_order, run, test_flags

# torch 2.13, torch/distributed/_functional_collectives.py: all_to_all_single_autograd is the functional
# all_to_all_single, whose backward (registered with torch.library.register_autograd) is all_to_all_single
# with the split sizes swapped. Private module (leading underscore); torch.distributed.nn.functional.
# all_to_all_single is the public autograd one but warns FutureWarning (deprecated) in 2.13.
import torch.distributed._functional_collectives as funcol


def dispatch_to_experts(x, expert, w1, w2, group, count_exchange=True, exchange=None, unsort=True):
    """Steps 1 to 3 for the rows x (T, dim), each routed to the k experts of expert (T, k), over the ranks of
    group; each rank holds len(w1) of them (the group's rank r: experts r*len(w1) ..). Returns the experts'
    outputs per (token, choice), (T, k, dim), and the splits: rows sent to and received from each rank of
    group, rows each local expert ran on. count_exchange, exchange, unsort: the tests' broken steps."""
    N, local, k, me = dist.get_world_size(group), w1.shape[0], expert.shape[1], dist.get_rank(group)
    order = expert.flatten().argsort(stable=True)  # the T*k (token, choice) rows, grouped by expert
    send_counts = torch.bincount(
        expert.flatten(), minlength=N * local
    )  # rows for each expert, in expert order
    recv_counts = torch.empty_like(send_counts)  # [source rank][local expert], from step 1
    if count_exchange:
        dist.all_to_all_single(
            recv_counts, send_counts, group=group
        )  # step 1: `local` counts to each rank
    else:  # for the tests: guess that every rank routes to my experts as I do; the splits disagree
        recv_counts = send_counts[me * local : (me + 1) * local].repeat(N)
    send_splits = (
        send_counts.view(N, local).sum(1).tolist()
    )  # rows to each rank (host ints: a sync)
    recv_splits = recv_counts.view(N, local).sum(1).tolist()  # rows from each rank
    exchange = exchange or funcol.all_to_all_single_autograd
    received = exchange(x[order // k], recv_splits, send_splits, group)  # step 2
    which = torch.arange(local, device=x.device).repeat(N).repeat_interleave(recv_counts)
    done = torch.zeros((len(received), w2.shape[-1]), dtype=x.dtype, device=x.device)
    for j in range(local):  # a real MoE sorts the rows by expert and runs one grouped GEMM
        rows = (which == j).nonzero().squeeze(1)
        done = done.index_copy(0, rows, F.gelu(received[rows] @ w1[j]) @ w2[j])
    back = exchange(done, send_splits, recv_splits, group)  # step 3: rows in `order`
    per_choice = (
        torch.zeros_like(back).index_copy(0, order, back) if unsort else back
    )  # (token, choice) order
    return per_choice.view(len(x), k, -1), (
        send_splits,
        recv_splits,
        recv_counts.view(N, local).sum(0).tolist(),
    )


def main(args, ctx):
    N, E, k, local = ctx.world_size, args.experts, args.top_k, args.experts // ctx.world_size
    ctx.require(
        E % N == 0,
        f"--experts {E} must be a multiple of the {N} ranks: pick --experts {E // N * N or N} "
        f"or {E // N * N + N}, or a number of ranks that divides {E}",
    )
    ctx.require(1 <= k <= E, f"--top-k must be between 1 and --experts ({E}), got {k}")
    ctx.require(
        min(args.tokens, args.dim, args.hidden) >= 1, "--tokens, --dim, --hidden must be at least 1"
    )
    torch.backends.cuda.matmul.fp32_precision = (
        "ieee"  # float32 matmuls, never TF32 (the bound assumes it)
    )
    router, w1, w2, x_all = init(
        args, N
    )  # the same full MoE and global batch on every rank (one seed)
    router = router.to(ctx.device).requires_grad_()  # replicated, like a data-parallel parameter
    mine = slice(ctx.rank * local, (ctx.rank + 1) * local)
    w1, w2 = (w[mine].to(ctx.device).requires_grad_() for w in (w1, w2))  # only this rank's experts
    x = x_all[ctx.rank * args.tokens : (ctx.rank + 1) * args.tokens].to(ctx.device).requires_grad_()

    probs = F.softmax(x @ router.T, dim=-1)  # (T, E)
    weights, expert = probs.topk(k, dim=-1)  # (T, k) each
    weights = weights / weights.sum(-1, keepdim=True)  # renormalised over the k chosen
    per_choice, (send_splits, recv_splits, ran) = (
        dispatch_to_experts(  # steps 1 to 3, on this group's ranks
            x,
            expert,
            w1,
            w2,
            dist.group.WORLD,
            count_exchange=not args.no_count_exchange,
            exchange=plain_all_to_all if args.plain_all_to_all else None,
            unsort=not args.no_unsort,
        )
    )
    out = (weights.unsqueeze(-1) * per_choice).sum(1)  # (T, dim)
    f = torch.bincount(expert.flatten(), minlength=E).to(probs.dtype) / (args.tokens * k)
    P = (
        probs.mean(0) if not args.aux_detached else probs.detach().mean(0)
    )  # for the tests: P_e without gradient
    aux = (
        E * (f * P).sum()
    )  # Switch eq. 4, on this rank's tokens; its gradient reaches the router through P

    # This rank's part of the global loss: MSE summed over the global batch, plus the aux losses' mean.
    target = torch.randn(
        x_all.shape, generator=torch.Generator().manual_seed(args.seed + 2), device="cpu"
    )
    y = target[ctx.rank * args.tokens : (ctx.rank + 1) * args.tokens].to(ctx.device)
    loss = ((out - y) ** 2).sum() / (N * args.tokens * args.dim) + args.aux_weight * aux / N
    loss.backward()  # every rank: the backward all_to_alls are collectives too
    dist.all_reduce(router.grad)  # SUM, as DDP would (DDP averages: scale the loss by N there)
    print_in_order(
        f"experts {mine.start}..{mine.stop - 1}: sends {send_splits} rows to ranks 0..{N - 1}, "
        f"receives {recv_splits}; its experts run on {ran} rows; aux loss {aux.item():.4f}"
    )
    check(args, ctx, probs.detach(), out, aux, x.grad, router.grad, w1.grad, w2.grad, mine)


def plain_all_to_all(inp, recv_splits, send_splits, group):
    """The tests' broken exchange: dist.all_to_all_single has no autograd, its output is a constant."""
    out = inp.new_empty((sum(recv_splits), *inp.shape[1:]))
    dist.all_to_all_single(out, inp.contiguous(), recv_splits, send_splits, group=group)
    return out


def init(args, N):
    """Router (E, dim), experts' W1 (E, dim, hidden) and W2 (E, hidden, dim), the global batch (N*T, dim)."""
    g = torch.Generator().manual_seed(args.seed)
    E, d, h = args.experts, args.dim, args.hidden
    rand = lambda *shape, scale: torch.randn(shape, generator=g, device="cpu") * scale  # noqa: E731
    return (
        rand(E, d, scale=d**-0.5),
        rand(E, d, h, scale=d**-0.5),
        rand(E, h, d, scale=h**-0.5),
        rand(N * args.tokens, d, scale=1.0),
    )


def reference(args, N):
    """Plain torch, one process, float64: every expert on every token, then pick the k chosen."""
    router, w1, w2, x = (t.double().requires_grad_() for t in init(args, N))
    probs = F.softmax(x @ router.T, dim=-1)
    weights, expert = probs.topk(args.top_k, dim=-1)
    all_out = F.gelu(torch.einsum("td,edh->eth", x, w1)) @ w2  # (E, N*T, dim)
    chosen = all_out[expert, torch.arange(len(x), device="cpu").unsqueeze(1)]  # (N*T, k, dim)
    out = (weights.unsqueeze(-1) / weights.sum(-1, keepdim=True).unsqueeze(-1) * chosen).sum(1)
    auxes = []
    for p, e in zip(
        probs.split(args.tokens), expert.split(args.tokens)
    ):  # rank by rank, as the ranks do
        f = torch.bincount(e.flatten(), minlength=args.experts).double() / e.numel()
        auxes.append(args.experts * (f * p.mean(0)).sum())
    aux = torch.stack(auxes)
    y = torch.randn(
        x.shape, generator=torch.Generator().manual_seed(args.seed + 2), device="cpu"
    ).double()
    (((out - y) ** 2).mean() + args.aux_weight * aux.mean()).backward()
    return out.detach(), aux.detach(), x.grad, router.grad, w1.grad, w2.grad, probs.detach()


def check(args, ctx, probs, out, aux, x_grad, router_grad, w1_grad, w2_grad, mine):
    ref_out, ref_aux, ref_x, ref_router, ref_w1, ref_w2, ref_probs = reference(args, ctx.world_size)
    rows = slice(ctx.rank * args.tokens, (ctx.rank + 1) * args.tokens)
    # The routing is discrete: where the k-th and (k+1)-th probabilities (float64) lie closer than twice
    # the measured float32 error, float32 may pick the other expert, legitimately (not at the defaults).
    top = ref_probs[rows].topk(min(args.top_k + 1, args.experts)).values
    margin = (top[:, -2] - top[:, -1]).min().item() if args.top_k < args.experts else 1.0
    tie = 2 * (probs.cpu().double() - ref_probs[rows]).abs().max().item()
    if margin <= tie:
        raise RuntimeError(
            f"[rank {ctx.rank}] a token's top-{args.top_k} routing is a near-tie in float32 "
            f"({margin:.1e} <= {tie:.1e}): pick another --seed"
        )
    # float32 against float64, relative to the largest entry: a float32 sum of n terms errs by at most about
    # n * 2**-23 of the sum of their sizes (Higham, Accuracy and Stability, 2nd ed., 4.2); the longest sums
    # here are dim or hidden long (matmuls) or N*T (the router's gradient), a few chained: 8 * n * eps.
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
        got = (
            torch.zeros_like(ref) if got is None else got.detach().cpu().double()
        )  # None: no gradient came
        errors[name] = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()
    print_in_order("max relative error: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    bad = [f"{n} {e:.1e}" for n, e in errors.items() if not e <= bound]
    dist.barrier()  # every rank has printed before any raises
    if bad:
        raise RuntimeError(
            f"[rank {ctx.rank}] differs from one process beyond {bound:.1e}: {', '.join(bad)}"
        )
    print0(
        f"OK: expert parallelism over {ctx.world_size} rank(s), {args.experts} experts, top-{args.top_k} "
        f"dropless: output, aux loss and every gradient equal one process's (bound {bound:.1e})"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--experts", type=int, default=8, help="E; a multiple of the world size (8: 1, 2, 4, 8)"
    )
    parser.add_argument("--top-k", type=int, default=2, help="experts per token")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per rank")
    parser.add_argument("--dim", type=int, default=16, help="model width")
    parser.add_argument("--hidden", type=int, default=32, help="each expert's hidden width")
    parser.add_argument(
        "--aux-weight", type=float, default=0.01, help="weight of the load-balancing loss"
    )
    parser.add_argument("--seed", type=int, default=0, help="weights, tokens and targets")
    broken = test_flags(parser)
    broken.add_argument(
        "--no-count-exchange",
        action="store_true",
        help="skip step 1 and guess the receive splits: Gloo aborts (NCCL: undefined)",
    )
    broken.add_argument(
        "--plain-all-to-all",
        action="store_true",
        help="dist.all_to_all_single for the tokens (no autograd): the gradient checks fail",
    )
    broken.add_argument(
        "--no-unsort",
        action="store_true",
        help="combine the returned rows without putting them back in token order",
    )
    broken.add_argument(
        "--aux-detached",
        action="store_true",
        help="P_e of detached probabilities: the aux loss keeps its value, loses its gradient",
    )
    run(main, parser.parse_args())
