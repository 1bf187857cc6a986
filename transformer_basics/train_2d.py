"""Train the GPT with FSDP and tensor parallelism together, on a 2-D device mesh (dp x tp).

    torchrun --nproc_per_node=4 transformer_basics/train_2d.py                  # 2 x 2 on CPU
    python transformer_basics/train_2d.py --nproc 4 --tp 2 --sequence-parallel
    torchrun --nnodes=2 --nproc_per_node=8 ... transformer_basics/train_2d.py --tp 4 --gpt2-small   # TP in a node, FSDP across

The ranks form a dp x tp grid. Along tp (ranks of one row, best within one node: TP talks
in every layer) each block's matrices are split as in tensor_parallel.py; along dp (the
columns) FSDP shards what each rank holds and every row reads different data. This file is
train.py with these changes (`diff train.py train_2d.py`): the mesh, the two parallelize
calls, data sharded by dp rank, gradient clipping over two meshes, and a check that the first
step's loss and gradients equal those of the unsharded model on the whole global batch.

Docs: https://pytorch.org/tutorials/intermediate/TP_tutorial.html
      https://pytorch.org/docs/stable/distributed.tensor.parallel.html
"""
import argparse
import copy
import math
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import data
from launch.dist_setup import lesson_parser, print0, run
from model import GPT, add_model_args, config_from_args
from tensor_parallel import apply_tensor_parallel

# Dense bf16 peak FLOP/s by device name, for MFU; the first name found in the device's name wins.
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("H800", 989e12), ("B200", 2250e12),
             ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10", 125e12)]


def lr_factor(step, args):
    """Linear warm-up to 1, then a cosine down to min_lr/lr at the last step."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    floor = args.min_lr / args.lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def make_optimizer(model, args):
    # Weight decay on matrices (Linear weights, embeddings) only, never on biases and norms.
    params = [p for p in model.parameters() if p.requires_grad]  # parameters() yields a tied weight once
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # fused: one kernel updates every parameter (CUDA, and CPU since torch 2.4), no Python loop
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=True)


def clip_grad_norm_2d(model, max_norm):
    """clip_grad_norm_ across two meshes: TP'd parameters live on dp x tp, the rest on dp alone,
    and DTensor ops cannot mix meshes. So: one norm per mesh, combined, then one scale."""
    by_mesh = {}
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in ps]).full_tensor() for ps in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for ps in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total


def check_first_step(model, reference, local_batches, global_batches, tol):
    """Before training, on every rank and device: the 2-D model on this rank's windows and the
    unsharded model on the whole global batch (every dp row's) must produce the same gradients.
    In float32 without dropout (eval mode), whatever --dtype and --dropout train with: both models
    are then the same function, so only the order of sums differs (reduce-scatter over dp, TP's
    all_reduce, matmul splits), a few float32 ulps of each gradient, far below --tol 2e-5."""
    model.eval(), reference.eval()
    for x, y in local_batches:
        (F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / len(local_batches)).backward()
    for x, y in global_batches:
        (F.cross_entropy(reference(x).flatten(0, 1), y.flatten()) / len(global_batches)).backward()
    worst = 0.0
    for (name, p), ref_p in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, (grad - ref_p.grad).abs().max().item())
        if worst > tol:
            raise RuntimeError(f"first step: gradient of {name} differs from the unsharded model's by {worst:.2e}")
    model.zero_grad(set_to_none=True)
    model.train()
    return worst


def export_full_model(model, cfg, path, rank):
    """The unsharded state dict, gathered on rank 0 and written for generate.py (a collective)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"config": asdict(cfg), "model": full}, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)  # a reader never sees half a file


def rng_states(device):
    """The CPU generator's state and, on an accelerator, that device's own (dropout on a GPU draws
    from the GPU's generator): both are CPU uint8 tensors, whichever device they describe."""
    states = {"rng": torch.get_rng_state()}
    if device.type != "cpu":
        states[f"rng_{device.type}"] = torch.get_device_module(device).get_rng_state(device)
    return states


def set_rng_states(states, device):
    torch.set_rng_state(states["rng"])
    if device.type != "cpu":
        torch.get_device_module(device).set_rng_state(states[f"rng_{device.type}"], device)


def save_checkpoint(model, optimizer, scheduler, step, args, ctx, path):
    extra = {"scheduler": scheduler.state_dict(), "step": step, **rng_states(ctx.device)}
    if "fsdp" in args.parallel:  # every rank writes its own shards: nothing is gathered
        model_sd, optim_sd = get_state_dict(model, optimizer)
        tmp = f"{path}.tmp"
        if ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        dcp.save({"model": model_sd, "optimizer": optim_sd, **extra}, checkpoint_id=tmp)
        dist.barrier()  # every shard is on disk before the directory is renamed
        if ctx.rank == 0:
            if os.path.exists(path):
                os.replace(path, f"{path}.old")
            os.replace(tmp, path)
            shutil.rmtree(f"{path}.old", ignore_errors=True)
    elif ctx.rank == 0:  # none, ddp: every rank holds the same model, rank 0 writes it
        raw = model.module if args.parallel == "ddp" else model
        torch.save({"model": raw.state_dict(), "optimizer": optimizer.state_dict(), **extra}, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
    if dist.is_initialized():
        dist.barrier()  # nobody reads or rewrites the checkpoint before it is complete


def load_checkpoint(model, optimizer, scheduler, args, ctx, path):
    if "fsdp" in args.parallel:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd, "scheduler": scheduler.state_dict(),
                 "step": 0, **rng_states(ctx.device)}
        dcp.load(state, checkpoint_id=path)  # each rank reads the shards it owns
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)  # no pickled code runs
        (model.module if args.parallel == "ddp" else model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_states(state, ctx.device)  # every rank draws the same numbers (same seed), so rank 0's state is everyone's
    return state["step"]


def main(args, ctx):
    args.tp = args.tp or (2 if ctx.world_size % 2 == 0 else 1)  # the default: 1 x 1, 2 x 1, 2 x 2, 4 x 2 ...
    ctx.require(ctx.world_size % args.tp == 0, f"{ctx.world_size} ranks do not form a grid with --tp {args.tp}: "
                                               f"the world size must be a multiple of --tp")
    dp = ctx.world_size // args.tp
    ctx.require(args.n_head % args.tp == 0, f"--n-head {args.n_head} must be a multiple of --tp {args.tp}")
    ctx.require(not args.sequence_parallel or args.block_size % args.tp == 0,
                f"--sequence-parallel needs --block-size {args.block_size} to be a multiple of --tp {args.tp}")
    ctx.require(args.steps > args.warmup >= 0, "--steps must be larger than --warmup")
    try:
        text = data.load_text(args.data)
    except ValueError as error:
        ctx.require(False, str(error))
    tokens = data.encode(text)
    problem = data.check_tokens(tokens, args.block_size, args.data)
    ctx.require(problem is None, problem)
    out = Path(args.out)
    ckpt_path = out / ("checkpoint" if "fsdp" in args.parallel else "checkpoint.pt")
    ctx.require(not args.resume or ckpt_path.exists(), f"--resume: no checkpoint at {ckpt_path}")
    train_tokens, val_tokens = data.split(tokens)
    mesh = init_device_mesh(ctx.device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()  # the ranks of one tp row read the same windows
    train_data = data.ShardedWindows(train_tokens, args.block_size, dp_rank, dp, args.seed)
    val_data = data.ShardedWindows(val_tokens, args.block_size, dp_rank, dp, args.seed)

    torch.manual_seed(args.seed)  # the same initial model on every rank: each keeps its part
    cfg = config_from_args(args)
    model = GPT(cfg).to(ctx.device)
    n_params, flops_per_token = model.num_params(), model.flops_per_token()
    if args.compile:
        model.compile()  # in place: parameter names (and so checkpoints) stay the same
    reference = copy.deepcopy(model) if not args.resume and args.check else None
    # ---- the parallelism: these lines are what train_2d.py changes ----
    apply_tensor_parallel(model, mesh["tp"], args.sequence_parallel)  # first TP within each row...
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh["dp"])  # ...then FSDP shards each rank's slices along dp
    fully_shard(model, mesh=mesh["dp"])
    # --------------------------------------------------------------------
    optimizer = make_optimizer(model, args)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, args))
    start = load_checkpoint(model, optimizer, scheduler, args, ctx, ckpt_path) if args.resume else 0
    ctx.require(start < args.steps, f"--resume: the checkpoint is at step {start}, nothing left of --steps {args.steps}")
    print0(f"model: {n_params / 1e6:.2f}M parameters, {cfg}; {args.parallel} on {ctx.world_size} rank(s)"
           + (f", resumed at step {start}" if args.resume else ""))

    use_bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and ctx.device.type == "cuda"
                                            and torch.cuda.is_bf16_supported())
    autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=use_bf16)
    tokens_per_step = args.batch_size * args.accum * args.block_size * dp

    def get_batch(windows, step, micro):
        x, y = windows.batch(step, micro, args.batch_size, args.accum)
        return data.to_device(x, ctx.device), data.to_device(y, ctx.device)

    def loss_of(x, y):
        with autocast:
            logits = model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    @torch.no_grad()
    def evaluate():
        model.eval()
        total = torch.zeros((), device=ctx.device)
        for i in range(args.eval_batches):
            total += loss_of(*get_batch(val_data, i, 0))
        if dist.is_initialized():
            dist.all_reduce(total, op=dist.ReduceOp.AVG)  # each rank saw different windows
        model.train()
        return total.item() / args.eval_batches

    def sync():
        if ctx.device.type != "cpu":
            torch.accelerator.synchronize()

    if reference is not None:
        local = [get_batch(train_data, 0, micro) for micro in range(args.accum)]
        whole = [get_batch(data.ShardedWindows(train_tokens, args.block_size, d, dp, args.seed), 0, micro)
                 for d in range(dp) for micro in range(args.accum)]
        worst = check_first_step(model, reference, local, whole, args.tol)
        print0(f"check: step 0's gradients (float32) equal the unsharded model's on the global batch "
               f"(max diff {worst:.1e})")
        del reference
    stop = min(args.steps, start + args.stop_after) if args.stop_after else args.steps
    val_first = evaluate()
    train_losses, val_last = [], val_first
    bar = tqdm(range(start, stop), disable=ctx.rank != 0, desc=f"{args.parallel} x{ctx.world_size}",
               unit="step", dynamic_ncols=True, file=sys.stdout if args.bar_stdout else None)
    sync()
    t0, t_timed = time.perf_counter(), None
    for step in bar:
        if step == start + 1:  # time from the second step on: the first one warms up (and compiles)
            sync()
            t_timed = time.perf_counter()
        loss_sum = torch.zeros((), device=ctx.device)
        for micro in range(args.accum):
            last = micro == args.accum - 1
            # Gradients are reduce-scattered over dp on the last micro-batch only.
            model.set_requires_gradient_sync(last)
            loss = loss_of(*get_batch(train_data, step, micro)) / args.accum
            loss.backward()
            loss_sum += loss.detach()  # stays on the device: no host sync per step
        clip_grad_norm_2d(model, args.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == stop - 1:  # the only host syncs: when logging
            if dist.is_initialized():
                dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
            train_losses.append((step, loss_sum.item()))
            elapsed = time.perf_counter() - t0
            bar.set_postfix(loss=f"{train_losses[-1][1]:.3f}", lr=f"{scheduler.get_last_lr()[0]:.1e}",
                            tok_s=f"{(step - start + 1) * tokens_per_step / elapsed:,.0f}")
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < stop:
            out.mkdir(parents=True, exist_ok=True)
            save_checkpoint(model, optimizer, scheduler, step + 1, args, ctx, ckpt_path)  # a collective
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < stop:
            val_last = evaluate()
            if ctx.rank == 0:
                bar.write(f"step {step + 1}: val loss {val_last:.3f}")
    sync()
    timed_steps = stop - start - 1
    step_time = (time.perf_counter() - t_timed) / timed_steps if timed_steps > 0 else float("nan")
    bar.close()
    val_last = evaluate()

    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, optimizer, scheduler, stop, args, ctx, ckpt_path)
    export_full_model(model, cfg, out / "model.pt", ctx.rank)

    tok_s = tokens_per_step / step_time
    name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    peak = next((f for key, f in PEAK_BF16 if key in name), None)
    mfu = f"{flops_per_token * tok_s / ctx.world_size / peak:.1%} of {name} bf16 peak" if peak else \
        f"unknown (no peak FLOP/s known for {name})"
    first, final = train_losses[0][1], train_losses[-1][1]
    print0(f"summary: {args.parallel} {dp}x{args.tp}, {stop - start} steps, {tok_s:,.0f} tokens/s, "
           f"{step_time * 1e3:.1f} ms/step, MFU {mfu}, train loss {first:.3f} -> {final:.3f}, "
           f"val loss {val_first:.3f} -> {val_last:.3f}, bf16 {'on' if use_bf16 else 'off'}")
    if ctx.rank == 0 and args.sample_tokens:  # the exported model, in this process alone (as generate.py)
        sampler = GPT(cfg)
        sampler.load_state_dict(torch.load(out / "model.pt", map_location="cpu", weights_only=True)["model"])
        prompt = data.encode("the ")[None].to(ctx.device)
        sample = sampler.to(ctx.device).eval().generate(prompt, args.sample_tokens, temperature=0.8, top_k=10)
        text = data.decode(sample[0].tolist())
        print("sample:\n  " + text.replace("\n", "\n  "))
    if val_last >= val_first:
        raise RuntimeError(f"the validation loss did not fall: {val_first:.3f} -> {val_last:.3f}")
    print0(f"OK: {args.parallel} on a {dp}x{args.tp} mesh trained steps {start}..{stop - 1}, "
           f"val loss {val_first:.3f} -> {val_last:.3f}; checkpoint {ckpt_path}, model {out / 'model.pt'}")


def parse_args(argv=None):
    parser = lesson_parser(__doc__)
    parser.add_argument("--parallel", choices=["fsdp+tp"], default="fsdp+tp", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=0,
                        help="tensor-parallel size (a row of the mesh); dp = ranks / tp (default: 2 on an even world size, else 1)")
    parser.add_argument("--sequence-parallel", action="store_true", help="also split norms and activations by sequence")
    parser.add_argument("--check", type=int, default=1, help="1: check step 0 against the unsharded model")
    parser.add_argument("--tol", type=float, default=2e-5,
                        help="largest gradient difference the check accepts (float32, see check_first_step)")
    parser.add_argument("--data", help="a UTF-8 text file (default: the corpus data.py generates)")
    parser.add_argument("--out", default="runs/gpt_2d", help="checkpoint directory (default: runs/gpt_2d)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    parser.add_argument("--steps", type=int, default=250, help="optimizer steps in all (sets the LR schedule)")
    parser.add_argument("--stop-after", type=int, default=0, help="stop after this many steps, as if interrupted")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per micro-batch per rank")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per step (gradient accumulation)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--min-lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="autocast dtype; auto: bf16 on a GPU that has it, float32 on CPU (bf16 is slower there)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (off by default)")
    parser.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps (0: at the end only)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--sample-tokens", type=int, default=200, help="tokens to sample at the end (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bar-stdout", action="store_true", help="tqdm bar on stdout instead of stderr")
    parser.add_argument("--gpt2-small", action="store_true",
                        help="GPT-2 small: 12 layers, 12 heads, 768 wide, 1024 context, batch 8 x accum 8, lr 6e-4")
    add_model_args(parser, n_head=12, n_embd=96, block_size=48)  # 12 heads, 48 tokens: tp = 1, 2, 3, 4, 6
    args = parser.parse_args(argv)
    if args.gpt2_small:
        args.n_layer, args.n_head, args.n_embd, args.block_size = 12, 12, 768, 1024
        args.batch_size, args.accum, args.lr, args.min_lr, args.warmup = 8, 8, 6e-4, 6e-5, 100
    return args


if __name__ == "__main__":
    run(main, parse_args())
