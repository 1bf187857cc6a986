"""The GPT of model.py with mixture-of-experts MLPs, trained with expert and data parallelism.

The ranks form a dp x ep grid (a 2-D DeviceMesh), each rank reading its own windows. Each block's
MLP is a top-k dropless MoE of E experts; the ep ranks of a mesh row (neighbours in rank order:
keep them in a node, they all_to_all in every layer) hold E/ep experts each, and
dispatch_to_experts (expert_parallel.py) takes each token to its experts inside the row and back.
The loss: the mean over ranks of each rank's cross-entropy + aux weight x the sum over layers of
its Switch aux loss (on its own tokens). So the gradients:
  dense parts (embeddings, attention, norms, routers, head): each rank's copy saw its own windows
    only: all_reduce over all N ranks, / N, as DDP does;
  an expert: the copy on one row got the tokens of every rank of that row, so its backward already
    summed those ep ranks' parts; the other rows' parts are on its other copies, down the mesh
    column: all_reduce over dp, and / N as well (/ dp would be ep times too much). Over all ranks
    would add other experts'.
Checked against the same MoE GPT trained on one process, every rank's windows a micro-batch (each
aux loss over the same tokens), float32: each step's loss and the final parameters. With SGD:
AdamW divides each gradient by its own size (an ep-times gradient would barely move it) and blows
up the float noise of the key bias's exactly-zero gradient (README); the state printed counts
AdamW's two moments all the same.

    torchrun --nproc_per_node=2 transformer_basics/train_moe.py                 # dp 1 x ep 2
    python transformer_basics/train_moe.py --nproc 4 --ep 2                     # dp 2 x ep 2

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_to_all_single
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

import data
from expert_parallel import dispatch_to_experts
from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run
from model import GPT, config_from_args


class MoE(nn.Module):
    """A block's MLP: a router over E experts (replicated), `local` experts from `first` on."""

    def __init__(self, router, w1, w2, first, local, top_k, group):
        super().__init__()
        self.router = nn.Parameter(router.clone())  # (E, C)
        self.w1 = nn.Parameter(w1[first : first + local].clone())  # (local, C, hidden)
        self.w2 = nn.Parameter(w2[first : first + local].clone())  # (local, hidden, C)
        self.top_k, self.group, self.aux, self.splits = top_k, group, None, []

    def forward(self, x):  # (B, T, C)
        flat = x.flatten(0, 1)
        probs = F.softmax(flat @ self.router.T, dim=-1)
        weights, expert = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        E = len(self.router)
        f = torch.bincount(expert.flatten(), minlength=E).to(probs.dtype) / expert.numel()
        self.aux = E * (f * probs.mean(0)).sum()  # Switch eq. 4, on this rank's tokens
        return (weights.unsqueeze(-1) * self.experts(flat, expert)).sum(1).view_as(x)

    def experts(self, flat, expert):  # the all_to_alls over self.group; splits kept for the report
        per_choice, splits = dispatch_to_experts(flat, expert, self.w1, self.w2, self.group)
        self.splits.append(splits)
        return per_choice


def main(args, ctx):
    N, E = ctx.world_size, args.experts
    ep = args.ep = args.ep or (2 if N % 2 == 0 else 1)
    ctx.require(N % ep == 0, f"--ep {ep} must divide the {N} ranks: pick a divisor of {N}")
    ctx.require(
        E % ep == 0,
        f"--experts {E} must be a multiple of --ep {ep}: pick --experts {ep * max(1, E // ep)}",
    )
    ctx.require(args.top_k <= E, f"--top-k must be between 1 and --experts ({E}), got {args.top_k}")
    ctx.require(args.n_embd % args.n_head == 0, "--n-embd must be a multiple of --n-head")
    corpus = data.encode(data.generate_corpus(2000))
    ctx.require(not (problem := data.check_tokens(corpus, args.block_size, None)), str(problem))
    torch.backends.cuda.matmul.fp32_precision = "ieee"  # never TF32 (the check's bound)

    mesh = init_device_mesh(ctx.device.type, (N // ep, ep), mesh_dim_names=("dp", "ep"))
    shard = dict(rank=ctx.rank, world_size=N, seed=args.seed)  # each rank its own windows
    windows = data.ShardedWindows(corpus, args.block_size, **shard)
    torch.manual_seed(args.seed)
    model = GPT(config_from_args(args)).to(ctx.device)
    reference = copy.deepcopy(model)  # for the check: the same dense weights
    ep_row, local = mesh["ep"].get_group(), E // ep  # the all_to_alls: within my ep row
    first = mesh["ep"].get_local_rank() * local  # my experts: first .. first + local - 1
    for layer, block in model.blocks.items():
        moe = MoE(*init_moe(args, layer), first=first, local=local, top_k=args.top_k, group=ep_row)
        block.mlp = moe.to(ctx.device)
    experts = [p for name, p in model.named_parameters() if name.endswith((".w1", ".w2"))]
    dense = [p for name, p in model.named_parameters() if not name.endswith((".w1", ".w2"))]
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # for the report: the collectives
        for step in range(args.steps):
            optimizer.zero_grad()
            x, y = (t.to(ctx.device) for t in windows.batch(step, 0, args.batch_size))
            logits = model(x)  # each MoE layer: 3 all_to_all (counts, tokens, results back)
            aux = sum(block.mlp.aux for block in model.blocks.values())
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) + args.aux_weight * aux
            loss.backward()  # each MoE layer: 2 all_to_all (the token exchanges' gradients)
            # dense: summed over the world; experts: over the dp column (routers are dense)
            for params, group in ((dense, dist.group.WORLD), (experts, mesh["dp"].get_group())):
                flat = torch.cat([p.grad.flatten() for p in params])  # one all_reduce each
                dist.all_reduce(flat, group=group)
                flat /= N  # both / N: the loss is the mean over all N ranks
                for p, g in zip(params, flat.split([p.numel() for p in params])):
                    p.grad.copy_(g.view_as(p))
            optimizer.step()
            losses.append(loss.detach())

    report(model, prof, mesh=mesh, args=args, ctx=ctx)
    check_against_one_process(reference, model, losses, corpus=corpus, args=args, ctx=ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


class OneProcessMoE(MoE):
    """The check's MoE: all E experts in one process, every expert on every token, then the k
    chosen picked."""

    def experts(self, flat, expert):
        every = F.gelu(torch.einsum("tc,ech->eth", flat, self.w1)) @ self.w2  # (E, T, C)
        return every[expert, torch.arange(len(flat), device=flat.device).unsqueeze(1)]  # (T, k, C)


def check_against_one_process(reference, model, losses, corpus, args, ctx):
    """The same MoE GPT, same start, trained in this process on every rank's windows (one
    micro-batch per rank, each loss / N): every step's loss and the final parameters must match the
    ranks'. Both float32, so only rounding differs (the experts' kernels, the order of the
    gradients' sums): each loss by about one ulp (4.8e-7 at 4 to 8), each parameter by a few of its
    own (< 1: ulp <= 6e-8), compounding over the steps; --tol 2e-5 is 40 ulps of the loss, and a
    wrong gradient sum is off by 1e-2 (tests/test_mutations.py). A token whose k-th and (k+1)-th
    router probabilities tie within rounding could pick another expert: pick another --seed."""
    N, local, losses = ctx.world_size, args.experts // args.ep, torch.stack(losses)
    first = ctx.rank % args.ep * local  # the mesh is (dp, ep) in rank order: its ep index, x local
    for layer, block in reference.blocks.items():
        moe = OneProcessMoE(*init_moe(args, layer), 0, args.experts, args.top_k, None)
        block.mlp = moe.to(ctx.device)
    optimizer = torch.optim.SGD(reference.parameters(), lr=args.lr)
    every_rank = [data.ShardedWindows(corpus, args.block_size, r, N, args.seed) for r in range(N)]
    ref_losses = torch.zeros(args.steps, device=ctx.device)
    for step in range(args.steps):
        optimizer.zero_grad()
        for windows in every_rank:
            x, y = (t.to(ctx.device) for t in windows.batch(step, 0, args.batch_size))
            ce = F.cross_entropy(reference(x).flatten(0, 1), y.flatten())
            aux = sum(block.mlp.aux for block in reference.blocks.values())
            loss = (ce + args.aux_weight * aux) / N
            loss.backward()
            ref_losses[step] += loss.detach()
        optimizer.step()
    dist.all_reduce(losses)  # SUM: the global loss is the mean of the ranks'
    losses /= N
    loss_error = (losses - ref_losses).abs().max().item()
    ref_params = dict(reference.named_parameters())
    mine = {  # this rank's experts of each layer, every other parameter whole
        name: p[first : first + local] if name.endswith((".w1", ".w2")) else p
        for name, p in ref_params.items()
    }
    param_error = max((p - mine[n]).abs().max().item() for n, p in model.named_parameters())
    pairs = zip(losses.tolist(), ref_losses.tolist())
    print0("loss per step: " + ", ".join(f"{a:.6f} (one process {b:.6f})" for a, b in pairs))
    print_in_order(
        f"largest difference from one process: loss {loss_error:.1e}, parameters {param_error:.1e}"
    )
    dist.barrier()  # every rank has printed before any raises
    if not max(loss_error, param_error) <= args.tol:
        raise RuntimeError(
            f"[rank {ctx.rank}] differs from one process beyond --tol {args.tol:g}: "
            f"loss {loss_error:.1e}, parameters {param_error:.1e}"
        )
    print0(
        f"OK: MoE GPT on a {N // args.ep}x{args.ep} (dp x ep) mesh, {args.experts} experts "
        f"top-{args.top_k}: the losses of {args.steps} steps and the parameters equal one "
        f"process's (max diff {max(loss_error, param_error):.1e})"
    )


# ---- the experts' initial weights (the same on every rank and in the one-process check), and
# per rank its experts, the rows it exchanged, its state and the collectives of a step ----


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


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--ep",
        type=int_in(1, 4096),
        help="expert-parallel size (a row of the mesh); dp = ranks / ep (default: 2 on an even "
        "world size, else 1)",
    )
    parser.add_argument(
        "--experts", type=int_in(1, 4096), default=8, help="E per layer; a multiple of --ep"
    )
    parser.add_argument("--top-k", type=int_in(1, 64), default=2, help="experts per token")
    parser.add_argument("--hidden", type=int_in(1, 65_536), default=64, help="an expert's width")
    parser.add_argument(
        "--aux-weight", type=float_in(0, 100), default=0.01, help="the load-balancing loss's weight"
    )
    parser.add_argument("--steps", type=int_in(1, 1000), default=3)
    parser.add_argument(
        "--batch-size", type=int_in(1, 1024), default=2, help="windows per rank per step"
    )
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.2)
    parser.add_argument(
        "--tol",
        type=float_in(0, 1, low_open=True),
        default=2e-5,
        help="largest difference accepted (float32, see the check)",
    )
    parser.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0)
    # the GPT of model.py
    parser.add_argument("--n-layer", type=int_in(1, 256), default=2)
    parser.add_argument("--n-head", type=int_in(1, 1024), default=2)
    parser.add_argument("--n-embd", type=int_in(1, 65_536), default=32)
    parser.add_argument(
        "--block-size", type=int_in(1, 1_048_576), default=32, help="context length"
    )
    parser.add_argument("--dropout", type=float_in(0, 0.9), default=0.0)
    run(main, parser.parse_args())
