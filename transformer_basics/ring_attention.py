"""Context parallelism by hand: causal ring attention over a sequence split across ranks.

Each rank keeps the queries of its part of the sequence and passes key/value blocks around a ring
(batch_isend_irecv: the next block travels while this one is computed, and is read only after its
wait()). A block gives each query a partial softmax: its output o_b and the log-sum-exp lse_b of its
scores; lse = logaddexp(lse_1, lse_2), o = o_1 exp(lse_1 - lse) + o_2 exp(lse_2 - lse) merges two
exactly (flash attention's online softmax; an average would be wrong). Zig-zag: of 2N chunks rank r
takes r and 2N-1-r, so after the first step every rank computes half a block per step. Backward
passes K, V around again, dK, dV travelling beside them to their owner. Checked in float64 against
F.scaled_dot_product_attention(is_causal=True) on the whole sequence. torch's own context_parallel
(a prototype in torch 2.13) runs only CUDA SDPA kernels this way: see the README.

    torchrun --nproc_per_node=3 transformer_basics/ring_attention.py
    python transformer_basics/ring_attention.py --nproc 4 --seq 64 --heads 4

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.batch_isend_irecv
      https://pytorch.org/docs/stable/notes/extending.html#extending-torch-autograd
      Ring attention: https://arxiv.org/abs/2310.01889
      Online softmax: https://arxiv.org/abs/2205.14135
"""

from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run


def ring_pass(t, group=None):
    """Start sending t to the next rank of group (default: every rank) and receiving the previous
    rank's into a new buffer, which holds it once the requests' wait() returned. group_peer is a
    rank within the group (P2POp, torch/distributed/distributed_c10d.py, torch 2.13)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    got = torch.empty_like(t)
    send = dist.P2POp(dist.isend, t, group=group, group_peer=(rank + 1) % world)
    recv = dist.P2POp(dist.irecv, got, group=group, group_peer=(rank - 1) % world)
    return dist.batch_isend_irecv([send, recv]), got


def zigzag_positions(rank, world, seq):
    """Rank r's positions (train_cp.py's too): chunks r and 2N-1-r of 2N, one from each end."""
    c = seq // (2 * world)
    chunks = (rank, 2 * world - 1 - rank)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device="cpu") for i in chunks])


def block(step, rank, world, c):
    """(query rows, key columns, causal?) of our 2c rows and the 2c columns held at this step. Ours
    (step 0): chunks r < 2N-1-r against themselves, causal. From a rank s < r: its chunk s precedes
    both of ours, its chunk 2N-1-s follows both. From s > r: both of its chunks lie between our two,
    seen only by our second."""
    src, whole = (rank - step) % world, slice(0, 2 * c)
    if src == rank:
        return whole, whole, True
    return (whole, slice(0, c), False) if src < rank else (slice(c, 2 * c), whole, False)


def scores(q, k, causal):
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return s


class RingAttention(torch.autograd.Function):
    """apply(q, k, v, group=None), each (B, H, 2c, D): this rank's two chunks in sequence order; the
    ring runs over group's ranks (default: every rank)."""

    @staticmethod
    def forward(ctx, q, k, v, group=None):
        rank, world, c = dist.get_rank(group), dist.get_world_size(group), q.shape[2] // 2
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.stack([k, v])
        for step in range(world):
            reqs, nxt = ring_pass(kv, group) if step < world - 1 else ([], None)
            rows, cols, causal = block(step, rank, world, c)
            s = scores(q[:, :, rows], kv[0][:, :, cols], causal)
            lse_b = s.logsumexp(-1)
            o_b = (s - lse_b[..., None]).exp() @ kv[1][:, :, cols]
            # Rescale both partial results to the merged normaliser (at step 0, lse is -inf: o_b).
            new = torch.logaddexp(lse[:, :, rows], lse_b)
            old_part = out[:, :, rows] * (lse[:, :, rows] - new).exp()[..., None]
            out[:, :, rows] = old_part + o_b * (lse_b - new).exp()[..., None]
            lse[:, :, rows] = new
            for req in reqs:
                req.wait()  # nxt holds the next block only from here on
            kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        rank, world, c = dist.get_rank(ctx.group), dist.get_world_size(ctx.group), q.shape[2] // 2
        delta = (dout * out).sum(-1, keepdim=True)  # sum_j p_ij dp_ij: the softmax's backward
        dq = torch.zeros_like(q)
        kvd = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])  # dK, dV travel along
        for step in range(world):
            rows, cols, causal = block(step, rank, world, c)
            kb, vb = kvd[0][:, :, cols], kvd[1][:, :, cols]
            p = (scores(q[:, :, rows], kb, causal) - lse[:, :, rows, None]).exp()  # the softmax
            dp = dout[:, :, rows] @ vb.transpose(-2, -1) - delta[:, :, rows]
            ds = p * dp * q.shape[-1] ** -0.5
            dq[:, :, rows] += ds @ kb
            kvd[2][:, :, cols] += ds.transpose(-2, -1) @ q[:, :, rows]
            kvd[3][:, :, cols] += p.transpose(-2, -1) @ dout[:, :, rows]
            if world > 1:  # pass K, V, dK, dV on; after the last step one hop brings dK, dV home
                reqs, kvd = ring_pass(kvd if step < world - 1 else kvd[2:].contiguous(), ctx.group)
                for req in reqs:
                    req.wait()  # kvd holds the received block only from here on
        return dq, kvd[-2], kvd[-1], None


def main(args, ctx):
    two_n = 2 * ctx.world_size
    ctx.require(
        args.seq % two_n == 0,
        f"--seq {args.seq} must divide into 2 x {ctx.world_size} chunks: use a multiple of {two_n}",
    )
    # Gloo's send and recv take CPU tensors only (docs: distributed.html#backends)
    ctx.require(
        ctx.backend != "gloo" or ctx.device.type == "cpu",
        "point-to-point on gloo needs CPU tensors: use --backend nccl or --device cpu",
    )
    mine = zigzag_positions(ctx.rank, ctx.world_size, args.seq)  # CPU: it indexes CPU tensors
    q_all, k_all, v_all, dout_all = inputs(args)  # the whole sequence, the same on every rank

    q, k, v = (t[:, :, mine].to(ctx.device).requires_grad_() for t in (q_all, k_all, v_all))
    out = RingAttention.apply(q, k, v)
    out.backward(dout_all[:, :, mine].to(ctx.device))

    print_layout(ctx, args.seq, mine)
    full, grads = (q_all, k_all, v_all, dout_all), (q.grad, k.grad, v.grad)
    check_blocks_read_after_wait(RingAttention, args, ctx, mine, full, out, grads)
    check_against_full_attention(args, ctx, "ring attention", mine, full, out, grads)
    print0(
        f"OK: causal ring attention over {ctx.world_size} rank(s) (zig-zag, "
        f"{args.seq // (2 * ctx.world_size)} tokens per chunk) equals full attention on one "
        "process: output and the gradients of q, k, v"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def print_layout(ctx, seq, mine):
    """This rank's chunks and the query-key scores it computed, against a contiguous split's."""
    rank, world, c = ctx.rank, ctx.world_size, seq // (2 * ctx.world_size)
    n, blocks = range(2 * c), [block(step, rank, world, c) for step in range(world)]
    work = sum(len(n[rows]) * len(n[cols]) for rows, cols, _ in blocks)
    print_in_order(
        f"chunks {rank} and {2 * world - 1 - rank}: positions {mine[0]}..{mine[c - 1]} and "
        f"{mine[c]}..{mine[-1]}; {world} ring step(s), {work} query-key scores computed "
        f"(a contiguous split would give it {(rank + 1) * (2 * c) ** 2})"
    )


# ---- what it checks against: full causal attention on the whole sequence in one process
# (float64), and a batch_isend_irecv held to its contract (a received block is usable only once
# its wait() has returned) ----


def inputs(args):
    """q, k, v and the output's gradient on the whole sequence, float64, from one seed (CPU)."""
    gen = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    return [torch.randn(shape, generator=gen, dtype=torch.float64, device="cpu") for _ in range(4)]


def bound(args):
    # float64 on every device (TF32 replaces float32 matmuls only: the docs' notes/cuda.html). A sum
    # of n terms errs by at most about n*eps of their sizes (Higham, Accuracy and Stability of
    # Numerical Algorithms, 2nd ed., 4.2): the longest run over seq or head_dim, a few chained.
    return 8 * (args.seq + args.head_dim) * 2.0**-52


def relative_errors(got, want):
    """{name: max |got - want| / max |want|} for the output and the q, k, v gradients (NaN: nan)."""
    return {
        name: ((g.detach().cpu() - w.detach().cpu()).abs().max() / w.abs().max()).item()
        for name, g, w in zip(["output", "dq", "dk", "dv"], got, want)
    }


def check_against_full_attention(args, ctx, name, mine, full, out, grads):
    """This rank's output and q, k, v gradients (positions `mine` of the
    sequence) against F.scaled_dot_product_attention on the whole sequence, one process."""
    q_all, k_all, v_all, dout_all = (t.clone().requires_grad_(i < 3) for i, t in enumerate(full))
    ref = F.scaled_dot_product_attention(q_all, k_all, v_all, is_causal=True)
    ref.backward(dout_all)
    want = [t[:, :, mine] for t in (ref, q_all.grad, k_all.grad, v_all.grad)]
    errors, limit = relative_errors([out, *grads], want), bound(args)
    listed = ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
    print_in_order(
        f"max error vs full attention, relative to the largest entry: {listed} (bound {limit:.1e})"
    )
    bad = [n for n, e in errors.items() if not e <= limit]
    if bad:
        raise RuntimeError(
            f"rank {ctx.rank}: {name}'s {', '.join(bad)} differ from full causal attention "
            f"(max error {max(errors.values()):.1e} > bound {limit:.1e})"
        )


def check_blocks_read_after_wait(attention, args, ctx, mine, full, out, grads):
    """The ring (attention: ring_attention.py's RingAttention) again, each received block NaN
    until its wait(): the same results, or a block is read before its wait() (the run above then
    read it or not, as timing fell). ring_pass looks up dist.batch_isend_irecv at every call, so
    replacing it meanwhile is enough."""
    q, k, v = (t[:, :, mine].to(ctx.device).requires_grad_() for t in full[:3])
    real = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: held_until_wait(real, ops)
    try:
        strict = attention.apply(q, k, v)
        strict.backward(full[3][:, :, mine].to(ctx.device))
    finally:
        dist.batch_isend_irecv = real
    errors = relative_errors([strict, q.grad, k.grad, v.grad], [out, *grads])
    bad = [n for n, e in errors.items() if not e <= bound(args)]
    if bad:
        raise RuntimeError(
            f"rank {ctx.rank}: ring attention reads a received block before its wait(): with "
            f"each receive buffer NaN until wait() returns, its {', '.join(bad)} change"
        )


def held_until_wait(batch_isend_irecv, ops):
    """batch_isend_irecv held to its contract (a request's data is usable once its wait() returned):
    each irecv lands in a buffer of its own, the caller's buffer is NaN until wait() copies it over.
    One request stands for the batch (as NCCL's coalesced batch does): wait() waits for them all."""
    ops, copies = list(ops), []
    for i, op in enumerate(ops):
        if op.op is dist.irecv:
            copies.append((op.tensor.fill_(float("nan")), torch.empty_like(op.tensor)))
            ops[i] = dist.P2POp(dist.irecv, copies[-1][1], group=op.group, group_peer=op.group_peer)
    works = batch_isend_irecv(ops)

    def wait():
        for work in works:
            work.wait()
        for buffer, landing in copies:
            buffer.copy_(landing)

    return [SimpleNamespace(wait=wait)]


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--seq", type=int_in(1, 65_536), default=48, help="a multiple of 2 x ranks")
    parser.add_argument("--batch", type=int_in(1, 1024), default=2)
    parser.add_argument("--heads", type=int_in(1, 1024), default=2)
    parser.add_argument("--head-dim", type=int_in(1, 4096), default=8)
    parser.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0, help="q, k, v, dout")
    run(main, parser.parse_args())
