"""Tensor parallelism (Megatron-style) of the GPT with parallelize_module on a 1-D mesh.

Every rank holds a slice of every block's matrices and sees the same batch:
  attn.q/k/v   ColwiseParallel: weight split by output features, so each rank computes
               n_head / tp whole heads, and attention itself needs no communication;
  attn.proj    RowwiseParallel: weight split by input features; the partial outputs are
               summed with one all_reduce (forward) per attention;
  mlp.fc       ColwiseParallel: each rank computes 1/tp of the 4x hidden units;
  mlp.proj     RowwiseParallel: one all_reduce, as above.
--sequence-parallel also splits the LayerNorms (and the residual stream between blocks)
along the sequence: the all_reduce becomes a reduce_scatter + all_gather pair, same bytes,
but activations outside the matmuls are 1/tp as large. Embeddings and the (tied) head stay
whole on every rank here; train_2d.py adds FSDP on a second mesh dimension.
The check: the sharded model's logits and gradients equal those of the unsharded model.

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

    torchrun --nproc_per_node=2 transformer_basics/tensor_parallel.py
    python transformer_basics/tensor_parallel.py --nproc 4 --sequence-parallel

Docs: https://pytorch.org/docs/stable/distributed.tensor.parallel.html
"""

import copy

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import data
from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run
from model import GPT, config_from_args


def block_plan(sequence_parallel):
    """How each Linear (and, with sequence parallel, each LayerNorm) of a Block is cut."""
    # the residual stream between the blocks: split by sequence, or whole
    between = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=between),  # all_reduce, or reduce_scatter
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=between),
    }
    if sequence_parallel:  # norms on 1/tp of the tokens; attention and MLP gather the sequence
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update(ln_1=SequenceParallel(), ln_2=SequenceParallel(), attn=gather, mlp=gather)
    return plan


def model_plan():
    """With sequence parallel: cut the residual stream by sequence as it enters block 0, and
    gather it back for the (whole, tied) head after the final norm."""
    return {
        "blocks.0": PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        ),
        "ln_f": SequenceParallel(),
        "lm_head": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
    }


def apply_tensor_parallel(model, mesh, sequence_parallel):
    for block in model.blocks.values():
        parallelize_module(block, mesh, block_plan(sequence_parallel))
    if sequence_parallel:
        parallelize_module(model, mesh, model_plan())
    return model


def main(args, ctx):
    tp = ctx.world_size
    ctx.require(
        args.n_head % tp == 0,
        f"--n-head {args.n_head} must be a multiple of the {tp} ranks: each computes whole heads",
    )
    ctx.require(args.n_embd % args.n_head == 0, "--n-embd must be a multiple of --n-head")
    ctx.require(
        not args.sequence_parallel or args.block_size % tp == 0,
        f"--sequence-parallel splits --block-size {args.block_size} into {tp} equal parts: "
        f"use a multiple of {tp}",
    )
    torch.manual_seed(args.seed)
    reference = GPT(config_from_args(args)).to(ctx.device)  # the unsharded model, whole everywhere
    model = copy.deepcopy(reference)  # the same weights, about to be cut
    mesh = init_device_mesh(ctx.device.type, (tp,), mesh_dim_names=("tp",))
    apply_tensor_parallel(model, mesh, args.sequence_parallel)
    print_shards(model, reference)

    # Plain SGD for both: parameters then agree whenever the gradients do (Adam would turn the
    # float noise of the key bias, whose exact gradient is 0, into full-size steps).
    # foreach=False: the parameter list mixes DTensors and plain tensors.
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, foreach=False)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=args.lr)
    tokens = data.encode(data.generate_corpus(2000))
    ctx.require(not (problem := data.check_tokens(tokens, args.block_size, None)), str(problem))
    windows = data.ShardedWindows(tokens, args.block_size, 0, 1, args.seed)
    worst = []
    for step in range(args.steps):
        x, y = (t.to(ctx.device) for t in windows.batch(step, 0, args.batch_size))  # same on all
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        worst.append(check_step_matches_unsharded(step, x, y, logits, model, reference, args))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        print0(f"step {step}: loss {loss.item():.4f}")
    logits_diff, grad_diff = map(max, zip(*worst))
    sp = ", sequence parallel" if args.sequence_parallel else ""
    print0(
        f"OK: tensor parallel on {tp} rank(s){sp}: logits and gradients of {args.steps} SGD steps "
        f"equal the unsharded GPT's (max diff {logits_diff:.1e} logits, {grad_diff:.1e} gradients)"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t  # all_gather of the shards


def print_shards(model, reference):
    attn_q, mlp_fc = model.blocks["0"].attn.q.weight, model.blocks["0"].mlp.fc.weight
    mine = sum(
        p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters()
    )
    print_in_order(
        f"attn.q.weight {tuple(attn_q.to_local().shape)} of {tuple(attn_q.shape)}, "
        f"mlp.fc.weight {tuple(mlp_fc.to_local().shape)} of {tuple(mlp_fc.shape)}; "
        f"{mine:,} of {reference.num_params(False):,} parameters on this rank"
    )


def check_step_matches_unsharded(step, x, y, logits, model, reference, args):
    """The unsharded model on the same batch: its logits and gradients must equal the sharded
    model's (gathered). Returns the largest difference of each."""
    ref_logits = reference(x)
    F.cross_entropy(ref_logits.flatten(0, 1), y.flatten()).backward()
    logits_diff = (full(logits) - ref_logits).abs().max().item()
    if logits_diff > args.tol:
        raise RuntimeError(
            f"step {step}: logits differ from the unsharded model's by {logits_diff:.2e}"
        )
    worst_grad = 0.0
    for (name, p), ref_p in zip(model.named_parameters(), reference.parameters()):
        worst_grad = max(worst_grad, (full(p.grad) - ref_p.grad).abs().max().item())
        if worst_grad > args.tol:
            raise RuntimeError(
                f"step {step}: gradient of {name} differs from the unsharded model's by "
                f"{worst_grad:.2e}"
            )
    return logits_diff, worst_grad


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="also split norms and activations by sequence",
    )
    parser.add_argument("--steps", type=int_in(1, 10_000), default=3)
    parser.add_argument("--batch-size", type=int_in(1, 4096), default=4)
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.2)
    parser.add_argument(
        "--tol", type=float_in(0, 1), default=2e-5, help="largest difference accepted (float32)"
    )
    parser.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0)
    # 24 heads, 24 tokens: 1, 2, 3, 4, 6, 8 ranks
    # the GPT of model.py
    parser.add_argument("--n-layer", type=int_in(1, 256), default=2)
    parser.add_argument("--n-head", type=int_in(1, 1024), default=24)
    parser.add_argument("--n-embd", type=int_in(1, 65_536), default=192)
    parser.add_argument(
        "--block-size", type=int_in(1, 1_048_576), default=24, help="context length"
    )
    parser.add_argument("--dropout", type=float_in(0, 0.9), default=0.0)
    run(main, parser.parse_args())
