"""Context parallelism with all_to_all (DeepSpeed-Ulysses): trade a sequence split for a head split.

Every rank holds q, k, v for its contiguous 1/N of the sequence and all H heads. One all_to_all per
tensor hands each rank all T positions of H/N heads; attention is then ordinary (causal, the whole
sequence, local heads: no ring, no merge, no load imbalance); one more all_to_all brings the output
back to a sequence split. The all_to_all of torch.distributed._functional_collectives is
differentiable, so backward runs the same exchanges in reverse. Heads must divide by N.
Checked in float64 against F.scaled_dot_product_attention(is_causal=True) on the whole sequence.

    torchrun --nproc_per_node=2 transformer_basics/ulysses.py
    python transformer_basics/ulysses.py --nproc 4 --seq 64 --heads 8

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_to_all_single
      https://docs.pytorch.org/docs/main/distributed.functional_collectives.html
      DeepSpeed-Ulysses: https://arxiv.org/abs/2309.14509
"""

import torch.distributed as dist
import torch.nn.functional as F

from launch.dist_setup import int_in, lesson_parser, print0, print_in_order, run
from ring_attention import check_against_full_attention, inputs  # the same inputs and check

# torch 2.13, torch/distributed/_functional_collectives.py: all_to_all_single has autograd
# registered (register_autograd on _c10d_functional::all_to_all_single; its backward is all_to_all
# with the split sizes swapped). Private (leading underscore) in 2.13; dist.all_to_all_single has
# no autograd.
import torch.distributed._functional_collectives as funcol


def main(args, ctx):
    rank, world = ctx.rank, ctx.world_size
    B, H, T, D = args.batch, args.heads, args.seq, args.head_dim
    ctx.require(
        H % world == 0,
        f"--heads {H} must divide by the world size {world}: Ulysses gives each rank "
        f"H/N whole heads (use a multiple of {world})",
    )
    ctx.require(
        T % world == 0,
        f"--seq {T} must divide by the world size {world} (use a multiple of {world})",
    )
    h, t = H // world, T // world  # heads per rank after the exchange, positions per rank before
    q_all, k_all, v_all, dout_all = inputs(args)  # the whole sequence, the same on every rank

    def seq_to_heads(x):  # (B, H, T/N, D) -> (B, H/N, T, D)
        # all_to_all_single splits dim 0: put first the rank that gets these heads
        x = x.reshape(B, world, h, t, D).transpose(0, 1).contiguous()
        x = funcol.all_to_all_single(x, None, None, dist.group.WORLD)  # dim 0: whose positions
        return x.permute(1, 2, 0, 3, 4).reshape(B, h, T, D)

    def heads_to_seq(x):  # (B, H/N, T, D) -> (B, H, T/N, D)
        # the transpose back: put first the rank whose positions these are
        x = x.reshape(B, h, world, t, D).permute(2, 0, 1, 3, 4).contiguous()
        x = funcol.all_to_all_single(x, None, None, dist.group.WORLD)  # dim 0: whose heads
        return x.transpose(0, 1).reshape(B, H, t, D)

    mine = slice(rank * t, (rank + 1) * t)
    q, k, v = (a[:, :, mine].to(ctx.device).requires_grad_() for a in (q_all, k_all, v_all))
    qh, kh, vh = (seq_to_heads(a) for a in (q, k, v))
    out = heads_to_seq(F.scaled_dot_product_attention(qh, kh, vh, is_causal=True))
    out.backward(dout_all[:, :, mine].to(ctx.device))

    print_in_order(
        f"positions {rank * t}..{(rank + 1) * t - 1} of all {H} heads {tuple(q.shape)} -> "
        f"heads {rank * h}..{(rank + 1) * h - 1} at all {T} positions {tuple(qh.shape)} -> back"
    )
    full, grads = (q_all, k_all, v_all, dout_all), (q.grad, k.grad, v.grad)
    check_against_full_attention(args, ctx, "Ulysses attention", mine, full, out, grads)
    print0(
        f"OK: Ulysses attention over {world} rank(s) ({h} head(s) each between two all_to_alls) "
        "equals full attention on one process: output and the gradients of q, k, v"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


# Its check is ring_attention.py's, imported above: full causal attention on the whole sequence
# in one process (float64), against this rank's output and q, k, v gradients.


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--seq", type=int_in(1, 65_536), default=48, help="a multiple of ranks")
    parser.add_argument("--batch", type=int_in(1, 1024), default=2)
    parser.add_argument("--heads", type=int_in(1, 1024), default=8, help="a multiple of ranks")
    parser.add_argument("--head-dim", type=int_in(1, 4096), default=8)
    parser.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0, help="q, k, v, dout")
    run(main, parser.parse_args())
