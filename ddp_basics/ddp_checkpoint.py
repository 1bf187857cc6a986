"""A complete DDP checkpoint, an exact resume from it, and surviving a rank that dies.

Complete: model, optimizer (momentum), LR scheduler, epoch and step (the sampler's position) and
every rank's RNG state (each batch gets noise, different on each rank). Global rank 0 alone writes
it, to a temporary file renamed over the old one (os.replace is atomic: a crash never leaves a
torn checkpoint), then a barrier; each rank loads it with map_location (its own device) and
weights_only=True (tensors and plain data, no code). `train` is the job as you would write it.
The lesson stops it after epoch --resume-after, resumes it in fresh objects, and compares with a
run never interrupted: bit-identical. --save-every N: a job that checkpoints every N steps in
--out and resumes from there; --fail-at-step S kills the last rank once; under `torchrun
--max-restarts=1` the restarted workers resume and end as a run that never failed. Restarts in
this torch need --standalone and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (pytorch#135712, explained
in launch/elastic.py).

    torchrun --nproc_per_node=2 ddp_basics/ddp_checkpoint.py
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 \\
        --max-restarts=1 ddp_basics/ddp_checkpoint.py --out /tmp/ddp_ckpt --save-every 10 \\
        --fail-at-step 25

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/tutorials/intermediate/ddp_tutorial.html#save-and-load-checkpoints
      https://pytorch.org/docs/stable/elastic/run.html (fault-tolerant torchrun)
"""

import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_rank, run
from toy import MLP, flat, make_data


def train(args, ctx, save_to=None, resume=False, stop_after=None):
    """The job: from scratch or from the checkpoint at save_to, to the end (or to the end of epoch
    stop_after)."""
    x, y = make_data(args.train, seed=0)  # every rank builds the same data, on the CPU
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)  # this rank's 1/N
    # generator=: the loader's iterators draw their seed from it, not from the global RNG that the
    # checkpoint restores
    loader = DataLoader(dataset, args.batch, sampler=sampler, generator=torch.Generator())
    torch.manual_seed(0)
    model = MLP(args.width).to(ctx.device)
    model = DDP(model, device_ids=None if ctx.device.type == "cpu" else [ctx.device])
    fix_bucket_order(model, ctx)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    torch.manual_seed(1000 + ctx.rank)  # each rank's own noise stream
    start_epoch, start_step = load(save_to, model, opt, sched, sampler, ctx) if resume else (0, 0)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch
        for step, (xb, yb) in enumerate(loader):
            if epoch == start_epoch and step < start_step:
                continue  # done before the checkpoint
            done = epoch * len(loader) + step
            die_if_asked(done, args, ctx)  # --fail-at-step
            xb, yb = xb.to(ctx.device), yb.to(ctx.device)
            xb = xb + args.noise * torch.randn(xb.shape, device=ctx.device)  # uses the RNG
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if save_to and args.save_every and (done + 1) % args.save_every == 0:
                save(save_to, model, opt, sched, sampler, epoch, step + 1, ctx)
        if save_to and not args.save_every:
            save(save_to, model, opt, sched, sampler, epoch + 1, 0, ctx)  # once per epoch
        if epoch + 1 == stop_after:
            break
    return flat(model).cpu()


def save(path, model, opt, sched, sampler, epoch, step, ctx):
    rng = {"cpu": gathered(torch.get_rng_state(), ctx)}  # a collective: every rank takes part
    if ctx.device.type == "cuda":  # the GPU's generator is another state (dropout on the GPU)
        rng["cuda"] = gathered(torch.cuda.get_rng_state(ctx.device), ctx)
    if ctx.rank == 0:
        ckpt = {
            "model": model.module.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "epoch": epoch,
            "step": step,
            "sampler_seed": sampler.seed,
            "world_size": ctx.world_size,
            "rng": rng,
        }
        torch.save(ckpt, path + ".tmp")  # same directory, so the rename stays on one file system
        os.replace(path + ".tmp", path)
    dist.barrier()  # nobody reads (or exits) before the file is complete


def load(path, model, opt, sched, sampler, ctx):
    ckpt = torch.load(path, map_location=ctx.device, weights_only=True)
    model.module.load_state_dict(ckpt["model"])  # every rank loads the same weights
    opt.load_state_dict(ckpt["optimizer"])
    sched.load_state_dict(ckpt["scheduler"])
    # clone(): set_rng_state reads a row of the stacked tensor from the start of its storage
    # (without it torch 2.13 crashes)
    torch.set_rng_state(ckpt["rng"]["cpu"][ctx.rank].cpu().clone())
    if ctx.device.type == "cuda":
        torch.cuda.set_rng_state(ckpt["rng"]["cuda"][ctx.rank].cpu().clone(), ctx.device)
    sampler.seed = ckpt["sampler_seed"]
    print0(f"loaded {', '.join(ckpt)} (map_location={ctx.device}, weights_only=True)")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's restarts
    print0(f"attempt {attempt}: resumed from {path} at epoch {ckpt['epoch']} step {ckpt['step']}")
    return ckpt["epoch"], ckpt["step"]


def gathered(state, ctx):
    """Every rank's copy of `state` (an RNG state, a ByteTensor), stacked on CPU."""
    out = [torch.empty_like(state, device=ctx.device) for _ in range(ctx.world_size)]
    dist.all_gather(out, state.to(ctx.device))
    return torch.stack(out).cpu()


def fix_bucket_order(model, ctx):
    """DDP's first backward sums its gradient bucket with parameters in registration order, later
    ones in the order gradients arrived. At 3+ ranks a float sum depends on the order, so a run
    resumed in a new DDP would differ by rounding. A backward on an empty batch sets the order
    before the first real step, in every run (it sends zeros and changes nothing else)."""
    model(torch.zeros(0, 2, device=ctx.device)).sum().backward()
    model.zero_grad(set_to_none=True)


def main(args, ctx):
    ctx.require(
        args.save_every or args.resume_after < args.epochs,
        f"--resume-after {args.resume_after} must be below --epochs {args.epochs}",
    )
    ctx.require(args.fail_at_step is None or args.save_every, "--fail-at-step needs --save-every N")
    ctx.require(can_write_in(args.out), f"cannot write to {args.out}: pass another --out")
    path = os.path.join(args.out, "ddp_checkpoint.pt")
    if args.save_every:  # a job: resume if an earlier attempt left a checkpoint
        resume = os.path.exists(path)
        if resume:
            require_checkpoint_fits(path, args, ctx)  # else one line, not a traceback
        else:
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            print0(f"attempt {attempt}: no checkpoint in {args.out}, starting from scratch")
        final = train(args, ctx, path, resume=resume)
    else:  # the demonstration: interrupted after epoch k, then resumed in fresh objects
        train(args, ctx, path, stop_after=args.resume_after)
        size = os.path.getsize(path) / 1024
        print0(f"stopped after epoch {args.resume_after}: {path} holds {size:.1f} KiB")
        final = train(args, ctx, path, resume=True)
    check_matches_uninterrupted_run(final, args, ctx)


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


def die_if_asked(done, args, ctx):
    """--fail-at-step: the last rank dies before step `done`, on the first attempt only."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if done == args.fail_at_step and ctx.rank == ctx.world_size - 1 and first_attempt:
        print_rank(f"dying at step {done} (--fail-at-step) at unix time {time.time():.3f}")
        os._exit(1)  # abrupt, like a lost machine: no cleanup, no exception


KEYS = ["model", "optimizer", "scheduler", "epoch", "step", "sampler_seed", "world_size", "rng"]


def require_checkpoint_fits(path, args, ctx):
    """Job mode, before resuming from `path`: it must be one of this job's checkpoints (torch.load
    reads it with weights_only=True, it has KEYS, a model of this --width, as many ranks); else
    every rank stops with one line that names the file and what differs."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # not a torch.save file, torn, or holding code (weights_only)
        ckpt = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:120]}"
    ctx.require(isinstance(ckpt, dict), f"{path} is not a checkpoint: torch.load fails ({ckpt})")
    missing = [key for key in KEYS if key not in ckpt]
    ctx.require(not missing, f"{path} is not a ddp_checkpoint.py checkpoint: it has no {missing}")
    with torch.device("meta"):  # only the shapes are read
        want = {k: tuple(v.shape) for k, v in MLP(args.width).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in ckpt["model"].items()}
    differ = sorted(k for k in want | got if got.get(k) != want.get(k))
    shapes = "; ".join(f"{k} {got.get(k)}, here {want.get(k)}" for k in differ[:2])
    ctx.require(not differ, f"{path} holds another model than --width {args.width}: {shapes}")
    ctx.require(
        ckpt["world_size"] == ctx.world_size,
        f"{path} was written by {ckpt['world_size']} ranks, not {ctx.world_size}: resume with as "
        "many (sampler shards and RNG states are per rank)",
    )


def check_matches_uninterrupted_run(final, args, ctx):
    """Independent: the same job, never interrupted, no checkpoint. Bit-identical, not close."""
    reference = train(args, ctx)
    diff = (final - reference).abs().max().item()
    digest = hashlib.sha256(final.numpy().tobytes()).hexdigest()[:16]
    print0(
        f"final params: float64 sum {final.double().sum().item():+.12f}, sha256 {digest}; "
        f"max |resumed - uninterrupted| {diff:.3g}"
    )
    if not torch.equal(final, reference):
        raise RuntimeError(f"the resumed run differs from the uninterrupted run by {diff:.3g}")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    how = f"resume after epoch {args.resume_after}"
    if args.save_every:
        how = f"checkpoints every {args.save_every} steps, attempt {attempt}"
    print0(
        f"OK: {ctx.world_size} ranks, {args.epochs} epochs, {how}: final params bit-identical to "
        f"an uninterrupted run (sha256 {digest})"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--out", default="checkpoints/ddp_basics", help="checkpoint directory")
    parser.add_argument("--train", type=int_in(1, 10**7), default=480, help="training examples")
    parser.add_argument("--batch", type=int_in(1, 10**6), default=16, help="rank's examples/step")
    parser.add_argument("--epochs", type=int_in(1, 1000), default=3)
    parser.add_argument("--width", type=int_in(1, 16384), default=32, help="hidden width")
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.2)
    parser.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0, help="sampler's seed")
    parser.add_argument("--noise", type=float_in(0, 100), default=0.05, help="batch noise std")
    parser.add_argument(
        "--resume-after", type=int_in(1, 999), default=1, help="epoch the demonstration stops at"
    )
    parser.add_argument(
        "--save-every", type=int_in(0, 10**6), default=0, help="job mode: checkpoint every N steps"
    )
    parser.add_argument(
        "--fail-at-step", type=int_in(0, 10**6), help="job mode: the last rank dies here, once"
    )
    args = parser.parse_args()
    # before init: fail now, not at the restart
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0"
    if restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        sys.exit(
            f"[rank {os.environ.get('RANK')}] error: restarts in this torch need torchrun "
            "--standalone (or --rdzv-backend=c10d) and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "(pytorch#135712)"
        )
    run(main, args)
