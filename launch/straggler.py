"""The slow rank: in a synchronous job every step waits for the slowest rank, so one slow GPU,
host or data loader slows them all, and every rank's step time looks the same. What tells them
apart is the step split in two: compute (forward and backward, this rank's own work) and wait (the
gradient all_reduce, which ends only once the last rank has joined it). Every --report-every steps
the ranks gather both; rank 0 names each rank whose compute exceeds the median by more than
--threshold of a step, and by how much: what every other rank then waits, each step.

    torchrun --nproc_per_node=4 launch/straggler.py --slow-rank 2 --slow-ms 50
    python launch/straggler.py --nproc 3 --slow-rank 1   # the experiment: rank 1 sleeps 50 ms

On a GPU the host's clock says little: a kernel launch returns at once, and its time shows up in
whatever call next waits for the GPU. So on CUDA both parts are read from CUDA events recorded on
the stream between the kernels (elapsed_time, read once per report, after one synchronize); on the
CPU from time.perf_counter. Megatron-LM's straggler detector (megatron/core/utils.py) does the same.
run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/generated/torch.cuda.Event.html
"""

import statistics
import time

import torch
import torch.distributed as dist
from launch.dist_setup import float_in, int_in, lesson_parser, print0, run


class StepClock:
    """Marks on the device's own timeline: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.steps = []  # (start, computed, reduced) of each step since the last report

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: it fires when the kernels before it are done
        return event

    def per_step_ms(self):
        """(compute, wait) in ms of the median step since the last call: a rank slow on most
        steps, not one hiccup (the host stalling a process once, a garbage collection)."""
        if self.cuda:
            torch.cuda.synchronize()  # once per report, not once per step
            ms = [(a.elapsed_time(b), b.elapsed_time(c)) for a, b, c in self.steps]
        else:
            ms = [((b - a) * 1e3, (c - b) * 1e3) for a, b, c in self.steps]
        self.steps = []
        return [statistics.median(part) for part in zip(*ms)]


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "a straggler needs others to be slower than: start 2 ranks")
    ctx.require(
        args.slow_rank is None or args.slow_rank < ctx.world_size,
        f"--slow-rank {args.slow_rank}: there are ranks 0 to {ctx.world_size - 1}",
    )
    ctx.require(args.steps >= args.report_every, "--steps: fewer than --report-every, no report")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1)
    ).to(ctx.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    clock, found = StepClock(ctx.device), []
    dist.barrier()  # start together: else the first step's wait holds the others' start-up
    for step in range(1, args.steps + 1):
        start = clock.mark()
        x = torch.randn(args.batch, args.width, device=ctx.device)
        model(x).square().mean().backward()
        if ctx.rank == args.slow_rank:  # the experiment: this rank's compute takes longer
            time.sleep(args.slow_ms / 1000)  # on CUDA too: the next event is recorded after it
        computed = clock.mark()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        dist.all_reduce(grads, op=dist.ReduceOp.AVG)  # returns once the slowest rank has joined
        if step > 1:  # the first step pays one-time costs (allocations, autograd's threads)
            clock.steps.append((start, computed, clock.mark()))
        torch.nn.utils.vector_to_parameters(grads, [p.grad for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
        if step % args.report_every == 0:
            mine = torch.tensor(clock.per_step_ms(), device=ctx.device)
            times = torch.empty(ctx.world_size * 2, device=ctx.device)
            dist.all_gather_single(times, mine)  # rank r's (compute, wait) ms per step at 2r
            times = times.view(ctx.world_size, 2).cpu()
            found.append(name_stragglers(step, times, args.threshold))
    check_found(found, times, args, ctx)


def name_stragglers(step, times, threshold):
    """Rank 0 prints; every rank returns the slow ranks: those whose compute exceeds the median
    compute by more than `threshold` of a step, each with its excess in ms per step."""
    compute, wait = times[:, 0], times[:, 1]
    step_ms = (compute + wait).median().item()  # about the same on every rank: they wait
    excess = (compute - compute.median()).tolist()  # of an even count, the lower middle value
    slow = {r: ms for r, ms in enumerate(excess) if ms > threshold * step_ms}
    ms = " ".join(f"{c:.1f}+{w:.1f}" for c, w in times.tolist())
    names = ", ".join(
        f"rank {r} by {e:.1f} ms ({e / step_ms:.0%} of a step)" for r, e in slow.items()
    )
    print0(f"step {step}: compute+wait ms/step by rank: {ms}; slow: {names or 'none'}")
    return slow


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_found(found, times, args, ctx):
    """Each report named the slowed rank and no other, by about --slow-ms; and the others waited
    for it: a rank's step (compute + wait) is never shorter than the slowest rank's compute."""
    compute, wait = times[:, 0], times[:, 1]
    slowest = compute.max().item()
    short = [r for r in range(ctx.world_size) if compute[r] + wait[r] < 0.8 * slowest]
    if short:
        raise RuntimeError(f"ranks {short} ended a step before the slowest rank's compute did: "
                           f"compute {compute.tolist()}, wait {wait.tolist()}")  # fmt: skip
    if args.slow_rank is None:
        seen = sorted({r for slow in found for r in slow})
        print0(f"OK: {len(found)} reports, no rank slowed; named by chance: {seen or 'none'}")
        return
    for report, slow in enumerate(found, 1):
        if list(slow) != [args.slow_rank]:
            raise RuntimeError(f"report {report} named {sorted(slow)}, not rank {args.slow_rank}")
        if not 0.5 * args.slow_ms <= slow[args.slow_rank] <= 1.5 * args.slow_ms + 5:
            by = slow[args.slow_rank]
            raise RuntimeError(f"report {report}: rank {args.slow_rank} slower by {by:.1f} ms, "
                               f"not about --slow-ms {args.slow_ms:g}")  # fmt: skip
    print0(
        f"OK: all {len(found)} reports named rank {args.slow_rank} and no other, slower by about "
        f"--slow-ms {args.slow_ms:g}; the others waited for it"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument("--steps", type=int_in(1, 1_000_000), default=30)
    parser.add_argument("--report-every", type=int_in(2, 1_000_000), default=10,
                        help="steps per report (the first step is not timed)")  # fmt: skip
    parser.add_argument("--threshold", type=float_in(0, 1, low_open=True), default=0.25,
                        help="named when it adds this part of a step to the median")  # fmt: skip
    parser.add_argument("--slow-rank", type=int_in(0, 4095),
                        help="the experiment: this rank sleeps --slow-ms in each step")  # fmt: skip
    parser.add_argument("--slow-ms", type=float_in(10, 60_000), default=50,
                        help="at least 10: more than a step's noise on a loaded CPU")  # fmt: skip
    parser.add_argument("--width", type=int_in(1, 16384), default=256)
    parser.add_argument("--batch", type=int_in(1, 65_536), default=256)
    run(main, parser.parse_args())
