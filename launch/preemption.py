"""Preemption: the scheduler says "stop" (SIGTERM; SIGUSR1 from Slurm's --signal) and nothing is
lost. The handler only notes the signal; every rank finishes its step; the ranks agree on the last
step with an all_reduce (the signal may reach them in different steps, or reach only some), save an
atomic checkpoint and exit with code 75, "preempted, resume me" (EX_TEMPFAIL in sysexits.h); the
next run with --resume ends where an uninterrupted run ends, bit for bit (same world size).

    torchrun --nproc_per_node=2 launch/preemption.py          # then: kill -TERM <torchrun's pid>
    torchrun --nproc_per_node=2 launch/preemption.py --resume
    python launch/preemption.py --nproc 3 --preempt-at 17     # rank 2 sends itself SIGUSR1
    sbatch launch/preemption.sbatch                           # Slurm: USR1, then a requeue

torchrun forwards SIGTERM to its workers and waits for them (--shutdown-timeout, 30 s); SIGUSR1
only with --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 (else it dies at once and
leaves its workers alone). torchrun then exits 1 whatever the workers' codes; `python --nproc` and
srun pass the 75 on. --out and --resume mean what they mean for transformer_basics/train.py.
run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://docs.python.org/3/library/signal.html, https://slurm.schedmd.com/sbatch.html#OPT_signal
"""

import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch.dist_setup import float_in, int_in, lesson_parser, print0, run

PREEMPTED = 75  # the exit code that says "preempted, resume me" (EX_TEMPFAIL, sysexits.h)


class StopSignal:
    """Notes the first of `signals`, nothing more: whatever the rank was doing (a step, a save, a
    collective) goes on, and the training loop decides when to stop."""

    def __init__(self, *signals):
        self.received, self.signals = 0, signals
        for number in signals:
            signal.signal(number, self.note)

    def note(self, number, frame):
        self.received = self.received or number

    def agreed(self, device):
        """A collective, at the same place in every step: nonzero on every rank as soon as any
        rank has received a signal."""
        anyone = torch.tensor([self.received], device=device)
        dist.all_reduce(anyone, op=dist.ReduceOp.MAX)
        received = anyone.item()  # on a GPU a wait for it: check every few steps if that costs
        if received:  # stopping: a second signal (torchrun forwards its own) must not kill the
            for number in self.signals:  # exit, where Python puts the default action back
                signal.signal(number, signal.SIG_IGN)
        return received


def main(args, ctx):
    stop = StopSignal(signal.SIGTERM, signal.SIGUSR1)  # first: a signal from here on is kept
    ckpt = Path(args.out) / "checkpoint.pt"
    ctx.require(not args.resume or ckpt.exists(), f"--resume: no checkpoint at {ckpt}")
    ctx.require(
        (args.preempt_rank or 0) < ctx.world_size,
        f"--preempt-rank {args.preempt_rank}: there are ranks 0 to {ctx.world_size - 1}",
    )
    ctx.require(can_write_in(ckpt.parent), f"cannot write to {ckpt.parent}: pass another --out")
    model, optimizer = make_model(args, ctx.device)
    start = load(ckpt, model, optimizer, ctx) if args.resume else 0
    ctx.require(start < args.steps, f"--resume: {ckpt} is at step {start}, past --steps")
    print0(f"{'resumed at' if args.resume else 'starting at'} step {start} of {args.steps}")
    for step in range(start, args.steps):
        x, y = batch(step, ctx.rank, args, ctx.device)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        # Data parallel by hand: a new DDP (as after a resume) sums its first step's buckets in
        # another order, which changes the rounding at 3+ ranks (ddp_checkpoint.py's fix).
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)  # the mean of the ranks' gradients
        preempt_if_asked(step, args, ctx)  # --preempt-at: the scheduler's signal, mid-step
        optimizer.step()
        time.sleep(args.step_time)  # the rest of a real step: room for a signal to land
        if (step + 1) % args.save_every == 0:
            save(ckpt, model, optimizer, step + 1, ctx)
        received = stop.agreed(ctx.device)  # a collective: every rank stops after one step
        if received:
            save(ckpt, model, optimizer, step + 1, ctx)
            print0(f"{signal.Signals(received).name}: stopped after step {step + 1}, saved "
                   f"{ckpt}; exit code {PREEMPTED}: resume me")  # fmt: skip
            check_saved(ckpt, model, step + 1, ctx)
            sys.exit(PREEMPTED)
    check_no_signal_was_missed(stop, args, ctx)
    save(ckpt, model, optimizer, args.steps, ctx)
    check_equals_one_process(model, args, ctx)


def make_model(args, device):
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, 1)
    ).to(device, torch.float64)
    return model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


def batch(step, rank, args, device):
    """This rank's samples of this step, from (seed, step, rank) alone: a resumed run draws what an
    uninterrupted one does, with no data loader state to save."""
    g = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 4096 + rank)
    x = torch.randn(args.batch, args.width, generator=g, dtype=torch.float64, device="cpu")
    return x.to(device), x.sum(1, keepdim=True).sin().to(device)


def save(path, model, optimizer, step, ctx):
    """A collective. Rank 0 writes (the replicas are equal) to a temporary name, then renames it
    (os.replace is atomic): a kill mid-save leaves the previous checkpoint whole."""
    if ctx.rank == 0:  # on several machines: --out on storage that every machine reads
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save({**state, "step": step, "world_size": ctx.world_size}, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
    dist.barrier()  # no rank exits, or reads it, before the checkpoint is complete


def load(path, model, optimizer, ctx):
    try:  # a torn or foreign file: one line that names it, not a traceback
        state = torch.load(path, map_location=ctx.device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])  # the momentum: without it, another run
    except Exception as error:
        ctx.require(False, f"--resume: {path} is not a checkpoint of this lesson ({error!r:.80})")
    n = state["world_size"]
    ctx.require(n == ctx.world_size, f"--resume: {path} was written by {n} ranks: resume at {n}")
    return state["step"]


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


def preempt_if_asked(step, args, ctx):
    """--preempt-at S: rank --preempt-rank sends itself --signal in step S (the others are not
    signalled at all), as a scheduler would from outside; the tests send real signals too."""
    rank = ctx.world_size - 1 if args.preempt_rank is None else args.preempt_rank
    if step == args.preempt_at and ctx.rank == rank:
        os.kill(os.getpid(), getattr(signal, args.signal))


def check_saved(path, model, step, ctx):
    """Every rank reads the checkpoint back: complete, at the step every rank stopped after, and
    holding this rank's weights bit for bit."""
    steps = [None] * ctx.world_size
    dist.all_gather_object(steps, step)
    if len(set(steps)) != 1:
        raise RuntimeError(f"the ranks stopped after different steps: {steps}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    mine = {k: v.cpu() for k, v in model.state_dict().items()}
    if state["step"] != step or any(not torch.equal(state["model"][k], v) for k, v in mine.items()):
        raise RuntimeError(f"{path} holds step {state['step']}, not this rank's step {step}")


def check_no_signal_was_missed(stop, args, ctx):
    """A run that ends normally: no rank received a signal before the last agreement (one that
    did and was outvoted ran on to the end: its job would have been killed after the grace)."""
    got = [None] * ctx.world_size
    dist.all_gather_object(got, stop.received)
    late = {r: signal.Signals(n).name for r, n in enumerate(got) if n}
    if late:
        raise RuntimeError(
            f"ranks {late} received a signal, yet the job ran on to step {args.steps}"
        )


def replay(args, world_size):
    """The whole run in one process, never interrupted: every rank's batch of each step together
    (the mean of the ranks' gradients is the gradient of the mean over all their samples)."""
    model, optimizer = make_model(args, "cpu")
    for step in range(args.steps):
        pairs = [batch(step, r, args, "cpu") for r in range(world_size)]
        x, y = (torch.cat(parts) for parts in zip(*pairs))
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return model


def check_equals_one_process(model, args, ctx):
    reference = replay(args, ctx.world_size).state_dict()
    mine = {k: v.cpu() for k, v in model.state_dict().items()}
    diff = max((mine[k] - reference[k]).abs().max().item() for k in mine)
    if diff > 1e-9:
        raise RuntimeError(f"the weights differ from the one-process replay by {diff:.2e}")
    digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in mine.values())).hexdigest()
    print0(
        f"OK: {args.steps} steps on {ctx.world_size} rank(s), weights equal the one-process "
        f"replay (max diff {diff:.1e}); weights sha256 {digest[:16]}"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--out", default="runs/preemption", help="the checkpoint goes here")
    parser.add_argument("--resume", action="store_true", help="go on from the checkpoint in --out")
    parser.add_argument("--steps", type=int_in(1, 1_000_000), default=40)
    parser.add_argument("--save-every", type=int_in(1, 1_000_000), default=10)
    parser.add_argument("--step-time", type=float_in(0, 60), default=0.05,
                        help="seconds each step sleeps (a real step's work)")  # fmt: skip
    parser.add_argument("--width", type=int_in(1, 4096), default=16)
    parser.add_argument("--batch", type=int_in(1, 65_536), default=8, help="samples per rank")
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.05)
    parser.add_argument("--seed", type=int_in(0, 1_000_000), default=0)
    parser.add_argument("--preempt-at", type=int_in(0, 1_000_000),
                        help="the experiment: a rank signals itself in this step")  # fmt: skip
    parser.add_argument("--preempt-rank", type=int_in(0, 4095),
                        help="which rank sends it (default: the last)")  # fmt: skip
    parser.add_argument("--signal", choices=["SIGUSR1", "SIGTERM"], default="SIGUSR1")
    run(main, parser.parse_args())
