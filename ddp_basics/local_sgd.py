"""Local SGD and DiLoCo: replicas train alone for H steps, then sync; against syncing every step.

sync (as DDP): all_reduce (AVG) of every gradient, every step. Local SGD: H plain SGD steps on each
replica's own batches, then all_reduce (AVG) of the weights (torch: PeriodicModelAverager); at H = 1
it equals sync, with plain SGD only (momentum or Adam state stays on each replica). DiLoCo
(Douillard et al. 2023, arXiv:2311.08105): H inner AdamW steps, then all_reduce (AVG) of the
pseudo-gradient (weights at the last sync minus weights now), which an outer SGD with Nesterov
momentum applies to the global weights; every replica starts again from those. Both send 1/H of
sync's bytes per step. Checks: a one-process simulation of every replica, the same on every rank.

    torchrun --nproc_per_node=2 ddp_basics/local_sgd.py
    python ddp_basics/local_sgd.py --nproc 4 --sync-every 1,4,16 --steps 192

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

PeriodicModelAverager has no docs page; its docstring and code:
  https://github.com/pytorch/pytorch/blob/main/torch/distributed/algorithms/model_averaging/averagers.py
"""

import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.optim import SGD, AdamW

from launch.dist_setup import float_in, int_in, lesson_parser, print0, run
from toy import MLP, flat, fp32_tolerance, make_data, spread


def diloco_outer_step(model, outer, outer_opt):  # outer: the global weights, on every replica
    for p, g in zip(model.parameters(), outer.parameters()):
        g.grad = g.detach() - p.detach()  # pseudo-gradient: where this replica's H steps went
        dist.all_reduce(g.grad, op=dist.ReduceOp.AVG)
    outer_opt.step()  # Nesterov momentum, on the averaged pseudo-gradient
    for p, g in zip(model.parameters(), outer.parameters()):
        p.data.copy_(g.data)  # every replica starts again from the new global weights


def train(method, h, x, y, args, ctx):
    torch.manual_seed(0)  # the same seed on every rank: every replica starts the same
    model = MLP(args.width).to(ctx.device)
    inner = AdamW if method in ("sync AdamW", "DiLoCo") else SGD  # plain SGD: no state
    opt = inner(model.parameters(), lr=args.inner_lr if inner is AdamW else args.sgd_lr)
    outer, mu = copy.deepcopy(model), args.outer_momentum  # DiLoCo's global weights, its optimizer
    outer_opt = SGD(outer.parameters(), lr=args.outer_lr, momentum=mu, nesterov=True)
    # warmup_steps=h-1: its counter starts at 0, so it averages after steps h, 2h, ... as ours does
    averager = PeriodicModelAverager(period=h, warmup_steps=h - 1) if h > 1 else None
    for step in range(args.steps):
        lo = (step * ctx.world_size + ctx.rank) * args.batch  # this replica's own batch
        xb, yb = x[lo : lo + args.batch].to(ctx.device), y[lo : lo + args.batch].to(ctx.device)
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        for p in model.parameters() if method.startswith("sync") else []:  # DDP's every step
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        opt.step()
        if method == "torch averager":
            averager.average_parameters(model.parameters())
        elif method == "local SGD" and (step + 1) % h == 0:
            for p in model.parameters():
                dist.all_reduce(p.data, op=dist.ReduceOp.AVG)
        elif method == "DiLoCo" and (step + 1) % h == 0:
            diloco_outer_step(model, outer, outer_opt)
    return model


def main(args, ctx):
    bad = [h for h in args.sync_every if args.steps % h]  # an H above --steps never syncs
    ctx.require(not bad, f"--sync-every {bad} must divide --steps {args.steps}: end on a sync")
    x, y = make_data(args.steps * ctx.world_size * args.batch, seed=0)  # the same on every rank
    plan = [("sync SGD", 1), ("sync AdamW", 1)]
    for h in args.sync_every:  # torch's averager warns at H=1: that is DDP's job
        plan += [("local SGD", h), ("DiLoCo", h)] + [("torch averager", h)] * (h > 1)
    runs = measured(train, plan, x, y, args, ctx)  # (model, bytes sent, seconds) of each run
    check(runs, x, y, args, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


def measured(train, plan, x, y, args, ctx):
    """{(method, H): (model, bytes this rank handed to all_reduce in the run, seconds from one
    barrier to the next)} for each run of the plan. torch.distributed.all_reduce is wrapped to add
    up the bytes (the syncs above call it, PeriodicModelAverager too); an untimed run first pays the
    one-time costs (allocations, threads, the first messages)."""
    sent, plain_all_reduce, runs = [0], dist.all_reduce, {}

    def counting(tensor, *rest, **kwargs):
        sent[0] += tensor.numel() * tensor.element_size()
        return plain_all_reduce(tensor, *rest, **kwargs)

    train(*plan[0], x, y, args, ctx)
    for method, h in plan:
        sent[0] = 0
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce = counting
        try:
            model = train(method, h, x, y, args, ctx)
        finally:
            dist.all_reduce = plain_all_reduce
        if ctx.device.type != "cpu":
            torch.accelerator.synchronize()
        dist.barrier()
        runs[method, h] = model, sent[0], time.perf_counter() - start
    return runs


def simulate(method, h, x, y, args, ctx):
    """Independent: every replica in this one process, on ctx.device in float32. Replica r trains on
    batch step * N + r; sync is one model on the concatenation of the N batches of each step (equal
    sizes: its mean loss is the mean of theirs); the weight average and DiLoCo's outer step
    (Nesterov momentum, as torch.optim.SGD defines it) written out on flat vectors."""
    n, b = ctx.world_size, args.batch
    xd, yd = x.to(ctx.device), y.to(ctx.device)

    def replica():
        torch.manual_seed(0)
        model = MLP(args.width).to(ctx.device)
        if method in ("sync AdamW", "DiLoCo"):
            return model, torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
        return model, torch.optim.SGD(model.parameters(), lr=args.sgd_lr)

    replicas = [replica() for _ in range(1 if method.startswith("sync") else n)]
    size = b * n if method.startswith("sync") else b
    outer, buf = flat(replicas[0][0]), None
    for step in range(args.steps):
        for r, (model, opt) in enumerate(replicas):
            lo = (step * n + r) * b
            opt.zero_grad()
            F.cross_entropy(model(xd[lo : lo + size]), yd[lo : lo + size]).backward()
            opt.step()
        if method.startswith("sync") or (step + 1) % h:
            continue
        new = torch.stack([flat(model) for model, _ in replicas]).mean(dim=0)
        if method == "DiLoCo":  # the average of the pseudo-gradients, then Nesterov on it
            delta = torch.stack([outer - flat(model) for model, _ in replicas]).mean(dim=0)
            buf = delta.clone() if buf is None else buf.mul(args.outer_momentum).add(delta)
            outer = new = outer.add(delta.add(buf, alpha=args.outer_momentum), alpha=-args.outer_lr)
        for model, _ in replicas:
            torch.nn.utils.vector_to_parameters(new.clone(), model.parameters())
    return flat(replicas[0][0])


def off_simulation(runs, x, y, args, ctx):
    """{run: max |weights - simulate()|}: rank 0 simulates (the spread across ranks, checked too,
    covers the other ranks) and broadcasts; torch's averager is compared with local SGD's run."""
    diffs, simulated = torch.zeros(len(runs), device=ctx.device), {}
    for i, ((method, h), (model, _, _)) in enumerate(runs.items() if ctx.rank == 0 else []):
        key = ("local SGD", h) if method == "torch averager" else (method, h)
        if key not in simulated:
            simulated[key] = simulate(*key, x, y, args, ctx)
        diffs[i] = (flat(model) - simulated[key]).abs().max()
    dist.broadcast(diffs, src=0)
    return dict(zip(runs, diffs.tolist()))


def check(runs, x, y, args, ctx):
    """Per run: the weights against simulate(), their spread across ranks, the bytes against the
    parameters' (every sync sends each parameter once); then torch's averager and local SGD at H = 1
    against the hand-written runs they must equal. Both sides are float32 on one device and differ
    by rounding only: 0 at 2 ranks, where the averages round alike; up to 1.5e-6 at 3 and 4 ranks
    (Gloo adds the replicas in another order; torch's averager divides before its SUM), and 6e-6
    for DiLoCo at H = 1, whose 96 outer steps on top of AdamW's grow that rounding (measured on a
    CPU). --tol 1e-4; the mistakes tests/test_local_sgd.py makes in DiLoCo are off by 1e-2 to 1."""
    tol, off, failures = fp32_tolerance(args.tol), off_simulation(runs, x, y, args, ctx), []
    params = list(runs["sync SGD", 1][0].parameters())
    full = sum(p.numel() * p.element_size() for p in params)
    xt, yt = (t.to(ctx.device) for t in make_data(2000, seed=1))
    print0(
        f"{sum(p.numel() for p in params)} parameters ({full} bytes); {ctx.world_size} "
        f"replica(s), {args.steps} steps of {args.batch} examples each"
    )
    print0(f"{'method':15s} {'H':>3s} {'bytes/step':>10s} {'ms/step':>8s} {'loss':>7s}  |w - sim|")
    for (method, h), (model, sent, seconds) in runs.items():
        name, across, d = f"{method} H={h}", spread(flat(model)), off[method, h]
        with torch.no_grad():
            loss = F.cross_entropy(model(xt), yt).item()
        print0(
            f"{method:15s} {h:3d} {sent / args.steps:10.1f} {1e3 * seconds / args.steps:8.2f} "
            f"{loss:7.4f}  {d:.1e}"
        )
        if not d <= tol:  # `not <=`: a NaN fails too
            failures.append(f"{name}: weights differ from the one-process simulation by {d:.2e}")
        if across != 0.0:
            failures.append(f"{name}: ranks hold different weights (spread {across:.2e})")
        if sent * h != full * args.steps:
            failures.append(f"{name}: sent {sent} bytes in {args.steps} steps, not {full}/{h}")
    pairs = [(("torch averager", h), ("local SGD", h)) for h in args.sync_every if h > 1]
    pairs += [(("local SGD", 1), ("sync SGD", 1))] if 1 in args.sync_every else []
    for a, b in pairs:
        diff = (flat(runs[a][0]) - flat(runs[b][0])).abs().max().item()
        print0(f"{a[0]} = {b[0]} at H={a[1]}: max |difference| {diff:.1e}")
        if not diff <= tol:
            failures.append(f"{a[0]} and {b[0]} at H={a[1]} differ by {diff:.2e} > {tol:g}")
    if failures:
        raise RuntimeError("; ".join(failures))
    print0(
        f"OK: {ctx.world_size} replica(s), {args.steps} steps: sync, local SGD and DiLoCo at H = "
        f"{','.join(map(str, args.sync_every))} equal a one-process simulation of every replica "
        f"(max diff {max(off.values()):.1e}, tolerance {tol:g}) and are identical on every rank; "
        + "; ".join(f"{a[0]} = {b[0]} at H={a[1]}" for a, b in pairs)
        + "; each sends 1/H of sync's bytes per step"
    )


def ints_in(low, high):
    """An argparse type: a comma-separated list of integers, each in [low, high] (1,8,32)."""
    one = int_in(low, high)

    def parse(text):
        return [one(part) for part in text.split(",")]

    parse.__name__, parse.high = f"a comma-separated list of integers in [{low}, {high}]", high
    return parse


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--sync-every",
        type=ints_in(1, 100_000),
        default="1,8,32",
        help="H: steps between syncs for local SGD and DiLoCo, one value or several",
    )
    parser.add_argument(
        "--steps", type=int_in(1, 100_000), default=96, help="steps (a multiple of each H)"
    )
    parser.add_argument(
        "--batch", type=int_in(1, 10**5), default=32, help="examples per replica per step"
    )
    parser.add_argument("--width", type=int_in(1, 16384), default=64, help="hidden width")
    parser.add_argument(
        "--sgd-lr", type=float_in(0, 10, low_open=True), default=0.5, help="sync SGD, local SGD"
    )
    parser.add_argument(
        "--inner-lr", type=float_in(0, 1, low_open=True), default=0.01, help="AdamW: DiLoCo's inner"
    )
    parser.add_argument("--outer-lr", type=float_in(0, 10, low_open=True), default=0.7)
    parser.add_argument(
        "--outer-momentum",
        type=float_in(0, 0.999, low_open=True),
        default=0.5,
        help="Nesterov; the paper's 0.9 (lr 0.7, H = 500) diverges here at H = 1",
    )
    parser.add_argument(
        "--tol", type=float_in(0, 1), default=1e-4, help="max |weight difference| (float32)"
    )
    run(main, parser.parse_args())
