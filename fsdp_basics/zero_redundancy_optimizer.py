"""ZeRO-1 from torch: ZeroRedundancyOptimizer with DDP; its state consolidated, saved, resumed at M.

ZeroRedundancyOptimizer wraps Adam so that each rank keeps the state of about 1/N of the
parameters and, after its step, broadcasts its updated parameters to the others. Unlike
zero_stages.py it splits by whole parameters (the largest first, each to the rank with the fewest
elements so far), so at 3 ranks the shares are uneven. DDP still all_reduces the full gradient.
consolidate_state_dict (every rank calls it) collects the shards on rank 0, whose state_dict()
is then a plain Adam state dict: it is saved atomically and loaded at another world size, where
each rank keeps the part it owns now.

    torchrun --nproc_per_node=2 fsdp_basics/zero_redundancy_optimizer.py --stop-at 5
    torchrun --nproc_per_node=3 fsdp_basics/zero_redundancy_optimizer.py --resume

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.optim.html (ZeroRedundancyOptimizer; experimental)
      https://pytorch.org/tutorials/recipes/zero_redundancy_optimizer.html
"""

import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# torch.distributed.optim's import compiles its functional optimizers with @torch.jit.script
# (torch/distributed/optim/functional_*.py), deprecated in 2.13 (torch/jit/_script.py): torch's
# DeprecationWarning, not this lesson's call; Python hides it unless asked (-W default; see
# https://docs.python.org/3/library/warnings.html#default-warning-filter)
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", r"`torch\.jit\.", DeprecationWarning)
    from torch.distributed.optim import ZeroRedundancyOptimizer

from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run
from toy import BlockMLP, make_data, rank_batch, storage_bytes


def main(args, ctx):
    ctx.require(
        args.batch % ctx.world_size == 0,
        f"--batch {args.batch} must divide by {ctx.world_size} ranks",
    )
    ctx.require(
        args.stop_at <= args.steps, f"--stop-at must be between 0 and --steps ({args.steps})"
    )
    end = args.stop_at or args.steps
    folder = os.path.dirname(args.checkpoint) or "."
    ctx.require(can_write_in(folder), f"cannot write to {folder}: pass another --checkpoint")
    x, y = (t.to(ctx.device) for t in make_data(args.batch * args.steps))
    torch.manual_seed(0)  # the same initial model on every rank (drawn on the CPU, then moved)
    model = BlockMLP(args.width, args.depth).to(ctx.device)
    ddp = DDP(model, device_ids=None if ctx.device.type == "cpu" else [ctx.device])
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=args.lr)
    start = load(args.checkpoint, model, opt, args, ctx) if args.resume else 0
    ctx.require(start <= end, f"the checkpoint is at step {start}, past --stop-at/--steps {end}")
    for step in range(start, end):
        xb, yb = rank_batch(x, y, step, args.batch, ctx)
        loss = F.cross_entropy(ddp(xb), yb)
        loss.backward()  # DDP: every rank gets the whole averaged gradient
        opt.step()  # Adam on the parameters this rank owns, then each owner broadcasts them
        opt.zero_grad()
    opt.consolidate_state_dict(to=0)  # a collective: every rank sends its shard to rank 0
    if ctx.rank == 0:
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        save(args.checkpoint, {**state, "step": end, "world_size": ctx.world_size})
    dist.barrier()  # nobody reads the file (or exits) before it is complete
    print0(f"saved {args.checkpoint} at step {end} on {ctx.world_size} ranks")

    check_sharded_state(opt, model, ctx)
    worst = check_matches_one_process(model, opt, x, y, end, args, ctx)
    print0(
        f"OK: ZeroRedundancyOptimizer on {ctx.world_size} ranks (steps {start}..{end - 1}"
        f"{f', resumed from {start}' if start else ''}) matches plain Adam in one process "
        f"(max diff {worst:.1e})"
    )


def save(path, checkpoint):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(checkpoint, path + ".tmp")
    os.replace(path + ".tmp", path)  # atomic (POSIX rename): a crash leaves the previous file whole


def load(path, model, opt, args, ctx):
    ctx.require(
        os.path.exists(path), f"no checkpoint at {path}: run with --stop-at first, or drop --resume"
    )
    check_checkpoint_fits(path, model, ctx)  # a one-line error if it does not
    ckpt = torch.load(path, map_location=ctx.device, weights_only=True)  # tensors, no code
    model.load_state_dict(ckpt["model"])  # the same weights on every rank
    opt.load_state_dict(ckpt["optim"])  # each rank keeps the state of what it owns at this N
    print0(
        f"resumed from {path} (step {ckpt['step']}, written by {ckpt['world_size']} ranks) on "
        f"{ctx.world_size} ranks"
    )
    return ckpt["step"]


# ---- The lesson ends here. What follows is how it checks itself. ----


def can_write_in(folder):
    """Make folder if it is missing; True if this rank can create a file in it. Every rank
    asks: each machine may have a disk of its own."""
    probe = os.path.join(folder, f".write_test_{os.getpid()}")
    try:  # a file made and removed: os.access is no test, it allows everything to root
        os.makedirs(folder, exist_ok=True)
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY))
        os.remove(probe)
        return True
    except OSError:
        return False


def check_checkpoint_fits(path, model, ctx):
    """One line on every rank, before load() reads `path`, when it is no checkpoint of this lesson
    or holds a model of other names or shapes (torch.load would raise an UnpicklingError, or
    load_state_dict a size mismatch, on every rank). It reads the file once more: small here."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # not a torch.save file: UnpicklingError, RuntimeError, EOFError...
        ctx.require(False, f"--resume: {path} is not a checkpoint ({type(error).__name__})")
    keys = ["model", "optim", "step", "world_size"]
    ctx.require(
        isinstance(ckpt, dict) and set(keys) <= ckpt.keys(),
        f"--resume: {path} is not a checkpoint of this lesson (a dict of {', '.join(keys)})",
    )
    here = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    there = {k: tuple(getattr(v, "shape", ())) for k, v in ckpt["model"].items()}
    differ = [
        f"{k} {there.get(k, 'missing')} there, {here.get(k, 'missing')} here"
        for k in sorted(here.keys() | there.keys())
        if here.get(k) != there.get(k)
    ]
    ctx.require(
        not differ,
        f"--resume: {path} holds another model: {'; '.join(differ[:2])}"
        + (f" (and {len(differ) - 2} more)" if len(differ) > 2 else ""),
    )


def check_sharded_state(opt, model, ctx):
    """Each parameter's Adam state lives on exactly one rank; together they are one Adam's state."""
    names = {p: n for n, p in model.named_parameters()}
    local = opt.optim.state  # `optim`: the wrapped local Adam (an attribute, not documented API)
    mine = [names[p] for p in local]
    numel = sum(p.numel() for p in local)
    held = storage_bytes(t for s in local.values() for t in s.values())
    print_in_order(
        f"owns {len(mine)} of {len(names)} tensors ({numel:,} parameters): {', '.join(mine)}; "
        f"Adam state {held:,} B"
    )
    counts = torch.tensor([len(mine), numel], device=ctx.device)
    dist.all_reduce(counts)
    total = sum(p.numel() for p in model.parameters())
    if counts.tolist() != [len(names), total]:
        raise RuntimeError(
            f"the ranks' optimizer shards hold {counts.tolist()} tensors/elements, "
            f"not {[len(names), total]}"
        )


def check_matches_one_process(model, opt, x, y, end, args, ctx):
    """Plain Adam in one process, never interrupted, each step on the whole global batch."""
    torch.manual_seed(0)
    reference = BlockMLP(args.width, args.depth).to(ctx.device)
    plain = torch.optim.Adam(reference.parameters(), lr=args.lr)
    for step in range(end):
        F.cross_entropy(
            reference(x[step * args.batch : (step + 1) * args.batch]),
            y[step * args.batch : (step + 1) * args.batch],
        ).backward()
        plain.step()
        plain.zero_grad()
    diff = torch.stack(
        [(p - r).abs().max() for p, r in zip(model.parameters(), reference.parameters())]
    ).max()
    if ctx.rank == 0:  # only rank 0 has the consolidated state: plain Adam's, same indices
        ours, ref = opt.state_dict()["state"], plain.state_dict()["state"]
        diffs = [
            (ours[i][k].to(ctx.device) - ref[i][k].to(ctx.device)).abs().max()
            for i in ref
            for k in ref[i]
        ]
        diff = torch.stack([diff, *diffs]).max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)  # every rank's model copy, and rank 0's state
    print0(
        f"max |param or Adam state - uninterrupted plain Adam, one process| after {end} steps: "
        f"{diff.item():.2e} (tolerance {args.tol:g})"
    )
    # Only the order of float32 sums differs (each rank's share, then the average), ~1e-7,
    # amplified by training (see zero_by_hand.py); TF32 is off by default on GPUs (docs
    # notes/cuda.html). A resume without the optimizer state restarts Adam's moments, and its
    # `step` counters lag by the steps before.
    if diff.item() > args.tol:
        raise RuntimeError(f"ZeroRedundancyOptimizer differs from plain Adam by {diff.item():.2e}")
    return diff.item()


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--checkpoint", default="runs/zero_redundancy_optimizer.pt", help="file to save / resume"
    )
    parser.add_argument(
        "--resume", action="store_true", help="go on from --checkpoint (any world size)"
    )
    parser.add_argument(
        "--steps", type=int_in(1, 10_000), default=10, help="steps of the whole training"
    )
    parser.add_argument(
        "--stop-at",
        type=int_in(0, 10_000),
        default=0,
        help="stop after this step, as if interrupted (0: --steps)",
    )
    parser.add_argument("--width", type=int_in(1, 4096), default=30)
    parser.add_argument("--depth", type=int_in(1, 64), default=2)
    parser.add_argument(
        "--batch", type=int_in(1, 65536), default=48, help="global batch, divisible by N"
    )
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=1e-2)
    parser.add_argument(
        "--tol",
        type=float_in(0, 1, low_open=True),
        default=1e-4,
        help="largest |ZeRO - one process| (params, state)",
    )
    run(main, parser.parse_args())
