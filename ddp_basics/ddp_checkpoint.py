"""A complete DDP checkpoint, an exact resume from it, and surviving a rank that dies.

Complete: model, optimizer (momentum), LR scheduler, epoch and step (the sampler's position),
and every rank's RNG state (each batch gets noise, different on each rank). Global rank 0
alone writes it, to a temporary file renamed over the old one (os.replace is atomic: a crash
never leaves a torn checkpoint), then a barrier; each rank loads it with map_location (its own
device) and weights_only=True (tensors and plain data, no code). `train` is the job as you would
write it: build everything, resume if asked, train, checkpoint as it goes. The lesson runs it
stopped after epoch --resume-after, resumed in fresh objects, and never interrupted: the final
parameters must be bit-identical. --save-every N: one job that checkpoints every N steps in --out
and resumes from there; --fail-at-step S kills the last rank once; under `torchrun
--max-restarts=1` the restarted workers resume and end as a run that never failed (checked).
Restarts in this torch need --standalone (c10d rendezvous) and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
(pytorch#135712, explained in launch/elastic.py).

    torchrun --nproc_per_node=2 ddp_basics/ddp_checkpoint.py
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=1 \\
        ddp_basics/ddp_checkpoint.py --out /tmp/ddp_ckpt --save-every 10 --fail-at-step 25

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

from launch.dist_setup import lesson_parser, print0, print_rank, run, test_flags
from toy import MLP, flat, make_data


def train(args, ctx, save_to=None, resume=False, stop_after=None):
    """The job: from scratch or from the checkpoint at save_to, to the end (or the end of epoch stop_after)."""
    x, y = make_data(args.train, seed=0)  # every rank builds the same data, on the CPU
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(
        dataset, shuffle=True, seed=args.seed
    )  # this rank's 1/N (rank, N from the group)
    # generator=: the loader's iterators draw their seed from it, not from the global RNG the checkpoint restores
    loader = DataLoader(
        dataset, batch_size=args.batch, sampler=sampler, generator=torch.Generator()
    )
    torch.manual_seed(0)
    model = MLP(args.width).to(ctx.device)
    model = DDP(model, device_ids=None if ctx.device.type == "cpu" else [ctx.device])
    fix_bucket_order(model, ctx)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    torch.manual_seed(1000 + ctx.rank)  # each rank's own noise stream
    start_epoch, start_step = (
        load(save_to, model, opt, sched, sampler, args, ctx) if resume else (0, 0)
    )
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch
        for step, (xb, yb) in enumerate(loader):
            if epoch == start_epoch and step < start_step:
                continue  # done before the checkpoint
            die_if_asked(epoch * len(loader) + step, args, ctx)
            xb, yb = xb.to(ctx.device), yb.to(ctx.device)
            xb = xb + args.noise * torch.randn(
                xb.shape, device=ctx.device
            )  # augmentation: uses the RNG
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if (
                save_to
                and args.save_every
                and (epoch * len(loader) + step + 1) % args.save_every == 0
            ):
                save(save_to, model, opt, sched, sampler, epoch, step + 1, ctx)
        if save_to and not args.save_every:
            save(save_to, model, opt, sched, sampler, epoch + 1, 0, ctx)  # once per epoch
        if epoch + 1 == stop_after:
            break
    return flat(model).cpu()


def save(path, model, opt, sched, sampler, epoch, step, ctx):
    rng = {"cpu": gathered(torch.get_rng_state(), ctx)}  # a collective: every rank takes part
    if ctx.device.type == "cuda":
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


def load(path, model, opt, sched, sampler, args, ctx):
    ckpt = torch.load(path, map_location=ctx.device, weights_only=True)
    ctx.require(
        ckpt["world_size"] == ctx.world_size,
        f"the checkpoint was written by {ckpt['world_size']} "
        "ranks: resume with as many (sampler shards and RNG states are per rank)",
    )
    model.module.load_state_dict(ckpt["model"])  # every rank loads the same weights
    if args.forget != "optimizer":
        opt.load_state_dict(ckpt["optimizer"])
    if args.forget != "scheduler":
        sched.load_state_dict(ckpt["scheduler"])
    if args.forget != "rng":
        # clone(): set_rng_state reads a row of the stacked tensor from its storage's start (torch 2.13 crashes)
        torch.set_rng_state(ckpt["rng"]["cpu"][ctx.rank].cpu().clone())
        if ctx.device.type == "cuda":
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"][ctx.rank].cpu().clone(), ctx.device)
    sampler.seed = ckpt["sampler_seed"]
    print0(f"loaded {', '.join(ckpt)} (map_location={ctx.device}, weights_only=True)")
    print0(
        f"attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}: resumed from {path} at epoch "
        f"{ckpt['epoch']} step {ckpt['step']}"
        + (f", without the {args.forget} state (--forget)" * bool(args.forget))
    )
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


def die_if_asked(done, args, ctx):
    """--fail-at-step: the last rank dies before step `done`, on the first attempt only."""
    if (
        done == args.fail_at_step
        and ctx.rank == ctx.world_size - 1
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    ):
        print_rank(f"dying at step {done} (--fail-at-step) at unix time {time.time():.3f}")
        os._exit(1)  # abrupt, like a lost machine: no cleanup, no exception


def main(args, ctx):
    ctx.require(
        args.save_every or 0 < args.resume_after < args.epochs,
        f"--resume-after must be between 1 and --epochs - 1 = {args.epochs - 1}",
    )
    ctx.require(args.fail_at_step < 0 or args.save_every > 0, "--fail-at-step needs --save-every N")
    ctx.require_writable_dir(args.out)
    path = os.path.join(args.out, "ddp_checkpoint.pt")
    if args.save_every:  # a job: resume if an earlier attempt left a checkpoint
        if not os.path.exists(path):
            print0(
                f"attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}: no checkpoint in {args.out}, "
                "starting from scratch"
            )
        final = train(args, ctx, path, resume=os.path.exists(path))
    else:  # the demonstration: interrupted after epoch k, then resumed in fresh objects
        train(args, ctx, path, stop_after=args.resume_after)
        print0(
            f"stopped after epoch {args.resume_after}: {path} holds {os.path.getsize(path) / 1024:.1f} KiB"
        )
        final = train(args, ctx, path, resume=True)
    check_matches_uninterrupted_run(final, args, ctx)


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
        raise RuntimeError(
            f"the resumed run differs from the uninterrupted run by up to {diff:.3g}"
        )
    how = (
        f"resume after epoch {args.resume_after}"
        if not args.save_every
        else f"checkpoints every "
        f"{args.save_every} steps, attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    )
    print0(
        f"OK: {ctx.world_size} ranks, {args.epochs} epochs, {how}: final params bit-identical to "
        f"an uninterrupted run (sha256 {digest})"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--out", default="checkpoints/ddp_basics", help="checkpoint directory")
    parser.add_argument("--train", type=int, default=480, help="training examples")
    parser.add_argument("--batch", type=int, default=16, help="examples per rank per step")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0, help="DistributedSampler's shuffle seed")
    parser.add_argument(
        "--noise", type=float, default=0.05, help="std of the noise added to each batch"
    )
    parser.add_argument(
        "--resume-after", type=int, default=1, help="epoch after which the demo run stops"
    )
    parser.add_argument(
        "--save-every", type=int, default=0, help="job mode: checkpoint every N steps, resume"
    )
    parser.add_argument(
        "--fail-at-step", type=int, default=-1, help="job mode: the last rank dies here, once"
    )
    test_flags(parser).add_argument(
        "--forget",
        choices=["optimizer", "scheduler", "rng"],
        help="leave this part out of the resume: the exact comparison fails",
    )
    args = parser.parse_args()
    if (
        os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
        != "0"  # before init: fail now, not at the restart
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    ):
        sys.exit(
            f"[rank {os.environ.get('RANK')}] error: restarts in this torch need torchrun --standalone "
            "(or --rdzv-backend=c10d) and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (pytorch#135712)"
        )
    run(main, args)
