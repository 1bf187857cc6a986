"""Context parallelism by hand: causal ring attention over a sequence split across ranks.

Each rank keeps the queries of its part of the sequence and passes key/value blocks around a ring
(dist.batch_isend_irecv, the next block in flight while this one is computed). A block gives each
query a partial softmax over some keys: its output o_b and the log-sum-exp lse_b of its scores. Two
partial results merge exactly by lse = logaddexp(lse_1, lse_2), o = o_1 exp(lse_1 - lse) + o_2
exp(lse_2 - lse) (the online softmax of flash attention); an average of o_1 and o_2 is wrong.
Causal load balance (zig-zag): the sequence is cut into 2N chunks and rank r takes chunks r and
2N-1-r, so after the first step every rank computes exactly half a block at every step.
Backward passes K, V around the ring again, with dK, dV travelling beside them to reach their owner.
Checked in float64 against F.scaled_dot_product_attention(is_causal=True) on the whole sequence.

    torchrun --nproc_per_node=3 transformer_basics/ring_attention.py
    python transformer_basics/ring_attention.py --nproc 4 --seq 64 --heads 4

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.batch_isend_irecv
      https://pytorch.org/docs/stable/notes/extending.html#extending-torch-autograd
      Ring attention: https://arxiv.org/abs/2310.01889 ; online softmax: https://arxiv.org/abs/2205.14135
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch.dist_setup import lesson_parser, print0, print_in_order, run, test_flags


def ring_pass(t, group=None):
    """Start sending t to the next rank of group (default: every rank) and receiving the previous rank's into
    a new buffer. group_peer is a rank within the group (P2POp, torch/distributed/distributed_c10d.py, 2.13)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    got = torch.empty_like(t)
    return dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, t, group=group, group_peer=(rank + 1) % world),
            dist.P2POp(dist.irecv, got, group=group, group_peer=(rank - 1) % world),
        ]
    ), got


def zigzag_positions(rank, world, seq):
    """The positions rank r holds (train_cp.py too): chunks r and 2N-1-r of 2N, one from each end."""
    c = seq // (2 * world)
    return torch.cat(
        [torch.arange(i * c, (i + 1) * c, device="cpu") for i in (rank, 2 * world - 1 - rank)]
    )


def block(step, rank, world, c):
    """Which of our 2c query rows meet which of the 2c key columns held at this step, and whether the
    causal mask applies. Ours (step 0): chunks r < 2N-1-r against themselves, lower-triangular. From a rank
    s < r: its chunk s precedes both of ours, its chunk 2N-1-s follows both. From s > r: both of its chunks
    lie between our two, seen only by our second."""
    src = (rank - step) % world
    whole = slice(0, 2 * c)
    return (
        (whole, whole, True)
        if src == rank
        else (whole, slice(0, c), False)
        if src < rank
        else (slice(c, 2 * c), whole, False)
    )


def scores(q, k, causal):
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    return (
        s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf")) if causal else s
    )


class RingAttention(torch.autograd.Function):
    """apply(q, k, v, group=None): the ring runs over group's ranks (default: every rank); the last two
    arguments exist for the tests (lse_merge=False: --average-merge, home_hop=False: --no-home-hop)."""

    @staticmethod
    def forward(
        ctx, q, k, v, group=None, lse_merge=True, home_hop=True
    ):  # (B, H, 2c, D): our 2 chunks in order
        rank, world, c = dist.get_rank(group), dist.get_world_size(group), q.shape[2] // 2
        out, lse = (
            torch.zeros_like(q),
            torch.full(q.shape[:3], float("-inf"), dtype=q.dtype, device=q.device),
        )
        kv = torch.stack([k, v])
        for step in range(world):
            reqs, nxt = (
                ring_pass(kv, group) if step < world - 1 else ([], None)
            )  # in flight while we compute
            rows, cols, causal = block(step, rank, world, c)
            s = scores(q[:, :, rows], kv[0][:, :, cols], causal)
            lse_b = s.logsumexp(-1)
            o_b = (s - lse_b[..., None]).exp() @ kv[1][:, :, cols]
            if step == 0:
                out[:, :, rows], lse[:, :, rows] = o_b, lse_b
            elif (
                lse_merge
            ):  # the taught step: rescale both partial results to the merged normaliser
                new = torch.logaddexp(lse[:, :, rows], lse_b)
                out[:, :, rows] = (
                    out[:, :, rows] * (lse[:, :, rows] - new).exp()[..., None]
                    + o_b * (lse_b - new).exp()[..., None]
                )
                lse[:, :, rows] = new
            else:  # --average-merge: what the lse merge replaces
                out[:, :, rows] = (out[:, :, rows] + o_b) / 2
            for req in reqs:
                req.wait()
            kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.home_hop = group, home_hop
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        rank, world, c = dist.get_rank(group), dist.get_world_size(group), q.shape[2] // 2
        delta = (dout * out).sum(
            -1, keepdim=True
        )  # sum_j p_ij dp_ij: the softmax's backward, per row
        dq = torch.zeros_like(q)
        kvd = torch.stack(
            [k, v, torch.zeros_like(k), torch.zeros_like(v)]
        )  # dK, dV travel with K, V
        for step in range(world):
            rows, cols, causal = block(step, rank, world, c)
            kb, vb = kvd[0][:, :, cols], kvd[1][:, :, cols]
            p = (
                scores(q[:, :, rows], kb, causal) - lse[:, :, rows, None]
            ).exp()  # the forward's softmax
            ds = (
                p
                * (dout[:, :, rows] @ vb.transpose(-2, -1) - delta[:, :, rows])
                * q.shape[-1] ** -0.5
            )
            dq[:, :, rows] += ds @ kb
            kvd[2][:, :, cols] += ds.transpose(-2, -1) @ q[:, :, rows]
            kvd[3][:, :, cols] += p.transpose(-2, -1) @ dout[:, :, rows]
            if world > 1 and (
                step < world - 1 or ctx.home_hop
            ):  # after the last step one hop brings dK, dV home
                reqs, kvd = ring_pass(kvd if step < world - 1 else kvd[2:].contiguous(), group)
                for req in reqs:
                    req.wait()
        return dq, kvd[-2], kvd[-1], None, None, None


def main(args, ctx):
    rank, world = ctx.rank, ctx.world_size
    ctx.require(
        min(args.batch, args.heads, args.head_dim, args.seq) >= 1,
        "--batch, --heads, --head-dim, --seq must be at least 1",
    )
    ctx.require(
        args.seq % (2 * world) == 0,
        f"--seq {args.seq} must divide into 2 x {world} chunks: use a multiple of {2 * world}",
    )
    ctx.require_point_to_point()
    c = args.seq // (2 * world)
    chunks = (
        rank,
        2 * world - 1 - rank,
    )  # zig-zag: one chunk from each end, so causal work is even
    mine = zigzag_positions(rank, world, args.seq)  # on the CPU: it indexes CPU tensors
    q_all, k_all, v_all, dout_all = inputs(
        args
    )  # the whole sequence, the same on every rank (one seed)

    q, k, v = (t[:, :, mine].to(ctx.device).requires_grad_() for t in (q_all, k_all, v_all))
    out = RingAttention.apply(q, k, v, None, not args.average_merge, not args.no_home_hop)
    out.backward(dout_all[:, :, mine].to(ctx.device))

    work = sum(
        len(range(2 * c)[rows]) * len(range(2 * c)[cols])
        for rows, cols, _ in (block(step, rank, world, c) for step in range(world))
    )
    print_in_order(
        f"chunks {chunks[0]} and {chunks[1]}: positions {mine[0]}..{mine[c - 1]} and "
        f"{mine[c]}..{mine[-1]}; {world} ring step(s), {work} query-key scores computed "
        f"(a contiguous split would give it {(rank + 1) * (2 * c) ** 2})"
    )
    torch_context_parallel_note(ctx)
    check_against_full_attention(
        args,
        ctx,
        "ring attention",
        mine,
        (q_all, k_all, v_all, dout_all),
        out,
        (q.grad, k.grad, v.grad),
    )
    print0(
        f"OK: causal ring attention over {world} rank(s) (zig-zag, {c} tokens per chunk) equals full attention "
        f"on one process: output and the gradients of q, k, v"
    )


def torch_context_parallel_note(ctx):
    # torch 2.13, torch/distributed/tensor/experimental/_context_parallel/_attention.py (a prototype): with
    # context_parallel(mesh, buffers=..., buffer_seq_dims=...) the buffers are cut head-tail (this zig-zag) and
    # SDPA's flash, efficient and cuDNN kernels (CUDA) run as ring attention (K, V by all_gather by default).
    why = (
        "on CPU it raises NotImplementedError (aten._scaled_dot_product_flash_attention_for_cpu has no sharding "
        "strategy), skipped"
        if ctx.device.type == "cpu"
        else "not run by this lesson (see README)"
    )
    print0(
        f"torch's own context_parallel needs a CUDA SDPA kernel (flash, efficient or cuDNN): {why}"
    )


def inputs(args):
    gen = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    return [torch.randn(shape, generator=gen, dtype=torch.float64, device="cpu") for _ in range(4)]


def check_against_full_attention(args, ctx, name, mine, full, out, grads):
    """Shared with ulysses.py: this rank's output and q, k, v gradients (positions `mine` of the sequence)
    against F.scaled_dot_product_attention on the whole sequence, one process; raises on a mismatch."""
    q_all, k_all, v_all, dout_all = (t.clone().requires_grad_(i < 3) for i, t in enumerate(full))
    ref = F.scaled_dot_product_attention(
        q_all, k_all, v_all, is_causal=True
    )  # one process, whole sequence
    ref.backward(dout_all)
    # float64 (eps 2**-52) on every device: TF32 only ever replaces float32 matmuls (https://pytorch.org/docs/
    # stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices). A sum of n terms errs by at most
    # about n*eps of their sizes (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., 4.2); the
    # longest sums run over the sequence (seq) or a head (head_dim), a few are chained: 8 * (seq + head_dim) * eps.
    bound = 8 * (args.seq + args.head_dim) * 2.0**-52
    errors = {}
    for what, got, want in zip(
        ["output", "dq", "dk", "dv"], [out, *grads], [ref, q_all.grad, k_all.grad, v_all.grad]
    ):
        want = want[:, :, mine]
        errors[what] = ((got.detach().cpu() - want).abs().max() / want.abs().max()).item()
    print_in_order(
        "max error vs full attention, relative to the largest entry: "
        + ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
        + f" (bound {bound:.1e})"
    )
    bad = [n for n, e in errors.items() if not e <= bound]
    if bad:
        raise RuntimeError(
            f"rank {ctx.rank}: {name}'s {', '.join(bad)} differ from full causal attention "
            f"(max error {max(errors.values()):.1e} > bound {bound:.1e})"
        )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--seq", type=int, default=48, help="sequence length, a multiple of 2 x the world size"
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="q, k, v and the output gradient")
    broken = test_flags(parser)
    broken.add_argument(
        "--average-merge",
        action="store_true",
        help="merge the blocks' partial outputs by a plain average, not by their lse",
    )
    broken.add_argument(
        "--no-home-hop",
        action="store_true",
        help="in backward, skip the last hop that brings dK, dV to the rank that owns K, V",
    )
    run(main, parser.parse_args())
