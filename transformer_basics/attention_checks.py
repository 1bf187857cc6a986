"""What ring_attention.py and ulysses.py check against: full causal attention on the whole
sequence in one process (float64), and a batch_isend_irecv held to its contract (a received
block is usable only once its wait() has returned). Not a lesson: imported."""

from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from launch.dist_setup import print_in_order


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
