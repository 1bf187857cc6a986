"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save at N ranks, resume at M.

get_state_dict(model, optimizer) gives each rank's shards (DTensors) under plain names;
dcp.save writes them, every rank its own, plus metadata saying which slice of which tensor
each file holds, so dcp.load can reshard: 2 ranks read what 4 wrote, each rank the slices it
now owns, and set_state_dict puts them in place. A save goes to step_N.tmp, is renamed
step_N once every rank has written, and only then is `latest` switched to it (os.replace:
atomic), so a crash during a save leaves the previous checkpoint usable. At the end rank 0
exports the full state dict, which a plain model loads with torch.load(weights_only=True).

    torchrun --nproc_per_node=4 fsdp_basics/fsdp_checkpoint.py --stop-at 4    # save, stop
    torchrun --nproc_per_node=2 fsdp_basics/fsdp_checkpoint.py --resume       # reshard, go on

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.checkpoint.html
"""

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from launch.dist_setup import float_in, int_in, lesson_parser, print0, run
from toy import BlockMLP, make_data, rank_batch, train_one_process


def save(model, opt, step, root, ctx):
    """Write step_<step> next to the previous checkpoints, then point `latest` at it (a
    collective)."""
    name, latest = f"step_{step:06d}", root / "latest"
    tmp = root / f"{name}.tmp"
    if ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # what a crashed save left behind
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, opt)  # my shards, under the model's plain names
    dcp.save(
        {"model": model_sd, "optim": optim_sd, "step": step, "world_size": ctx.world_size},
        checkpoint_id=tmp,
    )
    dist.barrier()  # every rank's files are complete before the directory is published
    if ctx.rank == 0:
        shutil.rmtree(root / name, ignore_errors=True)  # a stale copy, never the one `latest` names
        os.replace(tmp, root / name)
        (root / "latest.tmp").write_text(name)
        os.replace(root / "latest.tmp", latest)  # the commit point: before it, the old one counts
        for old in sorted(root.glob("step_??????"))[:-2]:  # keep this one and the one before
            shutil.rmtree(old)
    dist.barrier()
    print0(f"saved {name} at {ctx.world_size} ranks")


def load(model, opt, root, ctx):
    """Read the checkpoint `latest` names into this rank's shards, whatever N wrote it; return
    its step."""
    name = (root / "latest").read_text().strip()
    model_sd, optim_sd = get_state_dict(model, opt)  # the shards to fill, at this world size
    check_checkpoint_fits(root / name, model_sd, ctx)  # a one-line error if it does not
    state = {"model": model_sd, "optim": optim_sd, "step": 0, "world_size": 0}
    dcp.load(state, checkpoint_id=root / name)  # each rank reads the slices it owns now, in place
    # The tensors above are the model's own shards, already filled; set_state_dict is still the
    # documented last step (post-processing, non-tensor values: dcp.load's docstring, torch 2.13).
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    print0(
        f"resumed from {name} (written by {state['world_size']} ranks) at step {state['step']} "
        f"on {dist.get_world_size()} ranks"
    )
    return state["step"]


def start_fresh(root, ctx):
    """No checkpoint of an earlier run in `root` may be mistaken for this run's."""
    if ctx.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        (root / "latest").unlink(missing_ok=True)  # first: no pointer names a deleted directory
        for old in root.glob("step_*"):
            shutil.rmtree(old)
    dist.barrier()
    return 0


def main(args, ctx):
    ctx.require(
        args.batch % ctx.world_size == 0,
        f"--batch {args.batch} must divide by {ctx.world_size} ranks",
    )
    stop, root = args.stop_at or args.steps, Path(args.dir)
    ctx.require(0 < stop <= args.steps, f"--stop-at must be between 1 and --steps {args.steps}")
    ctx.require(not args.resume or (root / "latest").exists(), f"--resume: no checkpoint in {root}")
    ctx.require(can_write_in(root), f"cannot write to {root}: pass another --dir")
    x, y = (t.to(ctx.device) for t in make_data(args.batch * args.steps))
    torch.manual_seed(0)  # the same initial model on every rank (drawn on the CPU, then moved)
    model = BlockMLP(args.width, args.depth).to(ctx.device)

    # Without a mesh FSDP builds one for the accelerator, even when this run is on the CPU.
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)  # its parameters become DTensors, Shard(0) (fsdp_minimal.py)
    fully_shard(model, mesh=mesh)  # the root: inp and head
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)  # after fully_shard: it sees the shards
    start = load(model, opt, root, ctx) if args.resume else start_fresh(root, ctx)
    ctx.require(
        start < stop,
        f"--resume: the checkpoint is at step {start}, nothing left before step {stop}",
    )
    for step in range(start, stop):
        xb, yb = rank_batch(x, y, step, args.batch, ctx)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()  # per block, last to first: all_gather, gradients, reduce_scatter
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.save_every == 0 or step + 1 == stop:
            save(model, opt, step + 1, root, ctx)
    # The full model on rank 0 only, in CPU memory: what a plain single-process user loads.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    if ctx.rank == 0:
        torch.save(full, root / "model.pt.tmp")
        os.replace(root / "model.pt.tmp", root / "model.pt")  # a reader never sees half a file

    diff = check_export_matches_one_process(root / "model.pt", x, y, stop, args, ctx)
    print0(
        f"OK: trained steps {start}..{stop - 1} on {ctx.world_size} ranks"
        + " after resuming" * args.resume
        + "; the exported full state dict loads into a plain model and matches an uninterrupted "
        f"run (max diff {diff:.1e})"
    )


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


def check_checkpoint_fits(path, model_sd, ctx):
    """Stop every rank with one line when `path` is no DCP checkpoint, a shard file is missing or
    cut short, or it holds a model of other shapes (dcp.load would raise a CheckpointException
    from every rank, or an error in the read): its .metadata file lists
    each saved tensor's global size under its flattened name ("model.blocks.0.fc.weight")."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as error:  # no .metadata (FileNotFoundError), or not one of DCP's
        ctx.require(False, f"--resume: {path} is not a DCP checkpoint ({type(error).__name__})")
    for info in metadata.storage_data.values():  # each tensor's file, offset and length
        file = path / info.relative_path  # missing, empty or cut short: dcp.load would raise
        ok = file.is_file() and file.stat().st_size >= info.offset + info.length
        ctx.require(ok, f"--resume: {path} is damaged: {file} is shorter than its metadata says")
    saved = metadata.state_dict_metadata
    here = {f"model.{k}": tuple(v.shape) for k, v in model_sd.items()}
    there = {k: tuple(v.size) for k, v in saved.items() if k in here or k.startswith("model.")}
    differ = [
        f"{k[6:]} {there.get(k, 'missing')} there, {here.get(k, 'missing')} here"
        for k in sorted(here.keys() | there.keys())
        if here.get(k) != there.get(k)
    ]
    ctx.require(
        not differ,
        f"--resume: {path} holds another model: {'; '.join(differ[:2])}"
        + (f" (and {len(differ) - 2} more)" if len(differ) > 2 else ""),
    )


def check_export_matches_one_process(export, x, y, stop, args, ctx):
    """Rank 0 loads the export into a plain model and compares it with one process trained `stop`
    steps without a stop. Same device: only the order of float32 sums differs (N per-rank batches
    averaged by reduce_scatter against one full batch), ~1e-7 after the default 8 steps, hence
    --tol 1e-5."""
    diff = torch.zeros(1, device=ctx.device)  # broadcast below: on the device the backend takes
    if ctx.rank == 0:
        # load_state_dict copies the CPU tensors in
        plain = BlockMLP(args.width, args.depth).to(ctx.device)
        plain.load_state_dict(torch.load(export, map_location="cpu", weights_only=True))
        torch.manual_seed(0)
        reference = BlockMLP(args.width, args.depth).to(ctx.device)
        train_one_process(reference, x, y, args.batch, stop, args.lr)
        diff[0] = max(
            (p - q).abs().max().item() for p, q in zip(plain.parameters(), reference.parameters())
        )
        checksum = sum(p.double().abs().sum().item() for p in plain.parameters())
        print(
            f"exported {export} ({export.stat().st_size:,} B); step {stop} params checksum "
            f"{checksum:.6f}; max |param - uninterrupted single process| {diff.item():.2e} "
            f"(tolerance {args.tol:g})",
            flush=True,
        )
    dist.broadcast(diff, src=0)  # every rank fails together if the check fails
    if diff.item() > args.tol:
        raise RuntimeError(
            f"the resumed training differs from an uninterrupted one by {diff.item():.2e}"
        )
    return diff.item()


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--dir", default="runs/fsdp_checkpoint", help="checkpoint directory")
    parser.add_argument(
        "--resume", action="store_true", help="go on from the checkpoint `latest` names"
    )
    parser.add_argument(
        "--steps", type=int_in(1, 10_000), default=8, help="steps of the whole training"
    )
    parser.add_argument(
        "--stop-at",
        type=int_in(0, 10_000),
        default=0,
        help="stop after this step, as if interrupted (0: --steps)",
    )
    parser.add_argument(
        "--save-every",
        type=int_in(1, 10_000),
        default=2,
        help="save every N steps (and at the stop)",
    )
    parser.add_argument("--width", type=int_in(1, 4096), default=64)
    parser.add_argument("--depth", type=int_in(1, 64), default=2)
    parser.add_argument(
        "--batch", type=int_in(1, 65536), default=48, help="global batch, divisible by N"
    )
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=1e-2)
    parser.add_argument(
        "--tol",
        type=float_in(0, 1, low_open=True),
        default=1e-5,
        help="largest |param - uninterrupted one process|",
    )
    run(main, parser.parse_args())
