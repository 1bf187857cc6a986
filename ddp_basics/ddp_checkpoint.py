"""A complete DDP checkpoint, an exact resume from it, and surviving a rank that dies.

Complete means everything the next step depends on: the model, the optimizer (momentum
buffers), the LR scheduler, the epoch and the step within it (the sampler's position), and
every rank's RNG state (each batch gets random noise, different on each rank). Global rank 0
alone writes it (the weights are the same everywhere), to a temporary file in the same
directory renamed over the old one (os.replace is atomic: a crash mid-write never leaves a
torn checkpoint), then a barrier: no rank reads before it exists. Each rank loads it with
map_location (its own device) and weights_only=True (tensors and plain data, no code).

Default: train, stop after epoch --resume-after (as if the job were killed), resume in fresh
objects from the checkpoint, finish, and compare with a run never interrupted: bit-identical.
--forget PART leaves one part out of the resume, to show the comparison then fails.
--save-every N makes it a job that checkpoints every N steps and, on start, resumes from the
checkpoint in --out if there is one; --fail-at-step S makes the last rank die there on the
first attempt. Under `torchrun --max-restarts=1` torchrun restarts every worker, they resume,
and the final parameters equal those of a run that never failed (checked in the lesson).
Restarts in this torch need the c10d rendezvous (--standalone on one machine) and
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, else the restarted workers may read the dead attempt's
addresses from torchrun's store (pytorch#135712, explained in launch/elastic.py).

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
from torch.utils.data import DistributedSampler, TensorDataset

from launch.dist_setup import lesson_parser, print0, print_rank, run
from toy import MLP, make_data


def fresh(args, ctx, dataset):
    """Everything a run from scratch starts with; returns the job state as a dict."""
    torch.manual_seed(0)
    model = DDP(MLP(args.width).to(ctx.device))
    # DDP's first backward sums its gradient bucket with parameters in registration order, later
    # ones in the order gradients arrived. At 3+ ranks a float sum depends on the order, so a run
    # resumed in a new DDP would differ by rounding. A backward on an empty batch sets the order
    # before the first real step, in every run (it sends zeros and changes nothing else).
    model(torch.zeros(0, 2, device=ctx.device)).sum().backward()
    model.zero_grad(set_to_none=True)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    steps = args.epochs * -(-len(sampler) // args.batch)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    torch.manual_seed(1000 + ctx.rank)  # each rank's own noise stream
    return dict(model=model, opt=opt, sched=sched, sampler=sampler, epoch=0, step=0)


def gathered(state, ctx):
    """Every rank's copy of `state` (an RNG state, a ByteTensor), stacked on CPU."""
    out = [torch.empty_like(state, device=ctx.device) for _ in range(ctx.world_size)]
    dist.all_gather(out, state.to(ctx.device))
    return torch.stack(out).cpu()


def save(job, path, ctx):
    rng = {"cpu": gathered(torch.get_rng_state(), ctx)}  # a collective: every rank takes part
    if ctx.device.type == "cuda":
        rng["cuda"] = gathered(torch.cuda.get_rng_state(ctx.device), ctx)
    if ctx.rank == 0:
        ckpt = {"model": job["model"].module.state_dict(), "optimizer": job["opt"].state_dict(),
                "scheduler": job["sched"].state_dict(), "epoch": job["epoch"], "step": job["step"],
                "sampler_seed": job["sampler"].seed, "world_size": ctx.world_size, "rng": rng}
        torch.save(ckpt, path + ".tmp")  # same directory, so the rename stays on one file system
        os.replace(path + ".tmp", path)
    dist.barrier()  # nobody reads (or exits) before the file is complete


def load(job, path, args, ctx):
    ckpt = torch.load(path, map_location=ctx.device, weights_only=True)
    ctx.require(ckpt["world_size"] == ctx.world_size, f"the checkpoint was written by {ckpt['world_size']} "
                "ranks: resume with as many (sampler shards and RNG states are per rank)")
    job["model"].module.load_state_dict(ckpt["model"])  # every rank loads the same weights
    if args.forget != "optimizer":
        job["opt"].load_state_dict(ckpt["optimizer"])
    if args.forget != "scheduler":
        job["sched"].load_state_dict(ckpt["scheduler"])
    if args.forget != "rng":
        # clone(): set_rng_state reads a row of the stacked tensor from its storage's start (torch 2.13 crashes)
        torch.set_rng_state(ckpt["rng"]["cpu"][ctx.rank].cpu().clone())
        if ctx.device.type == "cuda":
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"][ctx.rank].cpu().clone(), ctx.device)
    job["sampler"].seed = ckpt["sampler_seed"]
    job.update(epoch=ckpt["epoch"], step=ckpt["step"])
    print0(f"loaded {', '.join(ckpt)} (map_location={ctx.device}, weights_only=True)")


def train(job, x, y, args, ctx, path=None, stop_after=None):
    """Train from job's (epoch, step) to the end, or to the end of epoch stop_after."""
    model, opt, sched, sampler = job["model"], job["opt"], job["sched"], job["sampler"]
    per_epoch = -(-len(sampler) // args.batch)
    while job["epoch"] < args.epochs:
        sampler.set_epoch(job["epoch"])
        order = list(sampler)  # indexed by hand: a DataLoader iterator would draw from the global RNG
        while job["step"] < per_epoch:
            done = job["epoch"] * per_epoch + job["step"]
            if (done == args.fail_at_step and ctx.rank == ctx.world_size - 1
                    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):  # first attempt only
                print_rank(f"dying at step {done} (--fail-at-step) at unix time {time.time():.3f}")
                os._exit(1)  # abrupt, like a lost machine: no cleanup, no exception
            idx = order[job["step"] * args.batch:(job["step"] + 1) * args.batch]
            xb, yb = x[idx].to(ctx.device), y[idx].to(ctx.device)
            xb = xb + args.noise * torch.randn(xb.shape, device=ctx.device)  # augmentation: uses the RNG
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            job["step"] += 1
            if path and args.save_every and (done + 1) % args.save_every == 0:
                save(job, path, ctx)
        job.update(epoch=job["epoch"] + 1, step=0)
        if path and not args.save_every:
            save(job, path, ctx)  # once per epoch
        if job["epoch"] == stop_after:
            return


def params(job):
    return torch.cat([p.detach().reshape(-1) for p in job["model"].module.parameters()]).cpu()


def main(args, ctx):
    ctx.require(args.save_every or 0 < args.resume_after < args.epochs,
                f"--resume-after must be between 1 and --epochs - 1 = {args.epochs - 1}")
    ctx.require(args.fail_at_step < 0 or args.save_every > 0, "--fail-at-step needs --save-every N")
    x, y = make_data(args.train, seed=0)
    dataset = TensorDataset(x, y)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ddp_checkpoint.pt")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    job = fresh(args, ctx, dataset)
    if args.save_every:  # a job: resume if an earlier attempt left a checkpoint
        if os.path.exists(path):
            load(job, path, args, ctx)
            print0(f"attempt {restart}: resumed from {path} at epoch {job['epoch']} step {job['step']}")
        else:
            print0(f"attempt {restart}: no checkpoint in {args.out}, starting from scratch")
        train(job, x, y, args, ctx, path)
    else:  # the demonstration: interrupted after epoch k, then resumed from the checkpoint
        train(job, x, y, args, ctx, path, stop_after=args.resume_after)
        print0(f"stopped after epoch {args.resume_after}: {path} holds {os.path.getsize(path) / 1024:.1f} KiB")
        job = fresh(args, ctx, dataset)
        load(job, path, args, ctx)
        print0(f"resumed in fresh objects at epoch {job['epoch']} step {job['step']}"
               + (f", without the {args.forget} state (--forget)" if args.forget else ""))
        train(job, x, y, args, ctx)
    final = params(job)

    reference = fresh(args, ctx, dataset)  # independent: the same run, never interrupted
    train(reference, x, y, args, ctx)
    diff = (final - params(reference)).abs().max().item()
    digest = hashlib.sha256(final.numpy().tobytes()).hexdigest()[:16]
    print0(f"final params: float64 sum {final.double().sum().item():+.12f}, sha256 {digest}; "
           f"max |resumed - uninterrupted| {diff:.3g}")
    if not torch.equal(final, params(reference)):
        raise RuntimeError(f"the resumed run differs from the uninterrupted run by up to {diff:.3g}")
    how = (f"restart {restart} after a rank died at step {args.fail_at_step}" if args.fail_at_step >= 0
           else f"resume after epoch {args.resume_after}" if not args.save_every else "checkpoints every "
           f"{args.save_every} steps")
    print0(f"OK: {ctx.world_size} ranks, {args.epochs} epochs, {how}: final params bit-identical to "
           f"an uninterrupted run (sha256 {digest})")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--out", default="checkpoints/ddp_basics", help="checkpoint directory")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--resume-after", type=int, default=1, help="epoch after which the demo run stops")
    parser.add_argument("--forget", choices=["optimizer", "scheduler", "rng"],
                        help="leave this part out of the resume: the exact comparison fails")
    parser.add_argument("--save-every", type=int, default=0, help="job mode: checkpoint every N steps, resume")
    parser.add_argument("--fail-at-step", type=int, default=-1, help="job mode: the last rank dies here, once")
    parser.add_argument("--train", type=int, default=480, help="training examples")
    parser.add_argument("--batch", type=int, default=16, help="examples per rank per step")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--noise", type=float, default=0.05, help="std of the noise added to each batch")
    parser.add_argument("--seed", type=int, default=0, help="DistributedSampler's shuffle seed")
    args = parser.parse_args()
    if (os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0"  # before init: fail now, not at the restart
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        sys.exit(f"[rank {os.environ.get('RANK')}] error: restarts in this torch need torchrun --standalone "
                 "(or --rdzv-backend=c10d) and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (pytorch#135712)")
    run(main, args)
