"""Local SGD and DiLoCo on the GPT of model.py: H times less communication, for how much loss?

    torchrun --nproc_per_node=2 transformer_basics/train_local_sgd.py
    python transformer_basics/train_local_sgd.py --nproc 4 --sync-every 1,4,16 --steps 96

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

sync (as DDP): every gradient averaged, every step; local SGD: the weights, every H steps; DiLoCo
(arXiv:2311.08105): H inner AdamW steps, then the pseudo-gradient (global weights minus the
replica's) averaged and applied by an outer SGD with Nesterov momentum. torch 2.13's local SGD,
in torch/distributed/: DDP's hook averages the gradients over the world while iter <
start_localSGD_iter, then in subgroup (None: a node's ranks; raises on CPU), or not at all if
post_local_gradient_allreduce=False (algorithms/ddp_comm_hooks/post_localSGD_hook.py 106-124);
PostLocalSGDOptimizer steps, then averages if step >= warmup_steps and (step - warmup_steps) %
period == 0 (optim/post_localSGD_optimizer.py 100-105, model_averaging/averagers.py 121-128).
"""

import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import SGD, AdamW

import data
from launch.dist_setup import float_in, int_in, lesson_parser, print0, run
from model import GPT, config_from_args


def train(method, h, windows, args, ctx):
    torch.manual_seed(args.seed)  # the same seed on every rank: every replica starts the same
    model = forward = GPT(config_from_args(args)).to(ctx.device)
    adamw = method in ("sync AdamW", "DiLoCo")  # plain SGD for the others: no state per replica
    opt = AdamW(model.parameters(), args.inner_lr) if adamw else SGD(model.parameters(), args.lr)
    outer = copy.deepcopy(model)  # DiLoCo's global weights and their optimizer
    outer_opt = SGD(outer.parameters(), args.outer_lr, momentum=args.outer_momentum, nesterov=True)
    if method == "local SGD torch":  # start_localSGD_iter=0, no gradient all_reduce: see above
        forward = DDP(model, device_ids=None if ctx.device.type == "cpu" else [ctx.device])
        state = post_local.PostLocalSGDState(None, None, 0, post_local_gradient_allreduce=False)
        forward.register_comm_hook(state, post_local.post_localSGD_hook)
        # warmup_steps=h-1: its counter starts at 0, so it averages after steps h, 2h, ... as ours
        opt = PostLocalSGDOptimizer(opt, PeriodicModelAverager(period=h, warmup_steps=h - 1))
    for step in range(args.steps):
        x, y = (data.to_device(t, ctx.device) for t in windows.batch(step, 0, args.batch_size))
        opt.zero_grad()
        F.cross_entropy(forward(x).flatten(0, 1), y.flatten()).backward()
        for p in model.parameters() if method.startswith("sync") else []:  # DDP's every step
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        opt.step()
        if method == "local SGD" and (step + 1) % h == 0:
            for p in model.parameters():
                dist.all_reduce(p.data, op=dist.ReduceOp.AVG)
        elif method == "DiLoCo" and (step + 1) % h == 0:  # outer: the global weights, everywhere
            for p, g in zip(model.parameters(), outer.parameters()):
                g.grad = g.detach() - p.detach()  # pseudo-gradient: where this replica went
                dist.all_reduce(g.grad, op=dist.ReduceOp.AVG)
            outer_opt.step()  # Nesterov momentum, on the averaged pseudo-gradient
            model.load_state_dict(outer.state_dict())  # all replicas restart from there
    return model


def main(args, ctx):
    bad = [h for h in args.sync_every if args.steps % h]  # an H above --steps never syncs
    ctx.require(not bad, f"--sync-every {bad} must divide --steps {args.steps}: end on a sync")
    tokens, val_tokens = data.load_tokens(None, args.block_size, ctx)  # data.py's corpus
    windows = data.ShardedWindows(tokens, args.block_size, ctx.rank, ctx.world_size)  # own share
    plan = [("sync SGD", 1), ("sync AdamW", 1)]
    for h in args.sync_every:  # torch's averager warns at H=1: that is DDP's job
        plan += [("local SGD", h), ("DiLoCo", h)] + [("local SGD torch", h)] * (h > 1)
    runs = measured(train, plan, windows, args, ctx)  # (model, bytes, seconds, steps) of each
    check(runs, windows, val_tokens, args, ctx)


# ---- The lesson ends here. What follows is how it checks itself. ----


def measured(train, plan, windows, args, ctx):
    """{(method, H): (model, bytes this rank gave all_reduce, seconds from barrier to barrier, steps
    of the model's optimizer, of any other: DiLoCo's outer)}. The wrapped all_reduce adds up bytes
    (ours, PeriodicModelAverager's, the hook's; DDP with no hook all-reduces in C++, unseen, but
    then differs from our local SGD); a global optimizer hook counts steps. 2 steps of DiLoCo warm
    up both optimizers first: the one-time costs of a first step stay out of the timed runs."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    sent, plain_all_reduce, steps, runs = [0], dist.all_reduce, [], {}

    def counting(tensor, *rest, **kwargs):
        sent[0] += tensor.numel() * tensor.element_size()
        return plain_all_reduce(tensor, *rest, **kwargs)

    train("DiLoCo", 1, windows, type(args)(**{**vars(args), "steps": 2}), ctx)  # both optimizers
    hook = register_optimizer_step_post_hook(lambda optimizer, *_: steps.append(optimizer))
    for method, h in plan:
        sent[0], steps[:] = 0, []
        dist.barrier()
        start, dist.all_reduce = time.perf_counter(), counting
        try:
            model = train(method, h, windows, args, ctx)
        finally:
            dist.all_reduce = plain_all_reduce
        if ctx.device.type != "cpu":
            torch.accelerator.synchronize()
        dist.barrier()
        seconds, own = time.perf_counter() - start, {id(p) for p in model.parameters()}
        inner = sum(id(o.param_groups[0]["params"][0]) in own for o in steps)
        runs[method, h] = model, sent[0], seconds, inner, len(steps) - inner
    hook.remove()
    return runs


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def gap(model, reference):
    return (flat(model) - reference).abs().max().item()


def replay_diloco(h, windows, args, ctx):
    """Independent of train(): this rank's replica again, its AdamW steps, and every H steps the
    outer step written out on flat vectors: the pseudo-gradients averaged with one all_reduce per
    parameter, as the lesson does (same sizes, so Gloo adds the ranks in the same order: 0.0 apart
    at 2 and 4 ranks in the README's runs; NCCL too, by our reading; added in another order they
    round otherwise, and the key biases' gradient, 0 but for rounding, is scaled by AdamW to steps
    of +-lr), then Nesterov as torch.optim.SGD has it (buf = delta, then mu * buf + delta; step
    lr * (delta + mu * buf))."""
    torch.manual_seed(args.seed)
    model = GPT(config_from_args(args)).to(ctx.device)
    opt = AdamW(model.parameters(), lr=args.inner_lr)
    sizes = [p.numel() for p in model.parameters()]
    outer, buf, mu = flat(model), None, args.outer_momentum
    for step in range(args.steps):
        x, y = (t.to(ctx.device) for t in windows.batch(step, 0, args.batch_size))
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        if (step + 1) % h == 0:
            deltas = [g - p for g, p in zip(outer.split(sizes), flat(model).split(sizes))]
            for d in deltas:
                dist.all_reduce(d, op=dist.ReduceOp.AVG)
            delta = torch.cat(deltas)
            buf = delta.clone() if buf is None else buf.mul(mu).add(delta)
            outer = outer.add(delta.add(buf, alpha=mu), alpha=-args.outer_lr)
            torch.nn.utils.vector_to_parameters(outer.clone(), model.parameters())
    return outer


def references(runs, windows, args, ctx):
    """{run: (max |weights - reference|, reference)}: local SGD at H=1 against sync SGD (plain SGD
    from equal weights: the mean of the replicas' steps is the step of the mean gradient), torch's
    local SGD against ours, DiLoCo against replay_diloco."""
    pairs = {("local SGD", 1): ("sync SGD", 1)} if ("local SGD", 1) in runs else {}
    pairs |= {(m, h): ("local SGD", h) for m, h in runs if m == "local SGD torch"}
    off = {a: (gap(runs[a][0], flat(runs[b][0])), b[0]) for a, b in pairs.items()}
    for method, h in runs:
        if method == "DiLoCo":
            off[method, h] = gap(runs[method, h][0], replay_diloco(h, windows, args, ctx)), "replay"
    return off


@torch.no_grad()
def val_loss(model, val_tokens, args, ctx, batches=4):
    """The loss on the first `batches` x --batch-size held-out windows (the same on every rank)."""
    windows = data.ShardedWindows(val_tokens, args.block_size, rank=0, world_size=1)
    x, y = (t.to(ctx.device) for t in windows.batch(0, 0, batches * args.batch_size))
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()


def spread(model):
    """max over weights of (max over ranks - min over ranks): 0.0 iff every rank holds the same."""
    high, low = flat(model), flat(model)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return (high - low).abs().max().item()


def check(runs, windows, val_tokens, args, ctx):
    """Per run: every rank holds the same weights (each run ends on a sync); the steps asked (and
    DiLoCo's outer steps: steps / H); the bytes: sync's are the parameters' every step, the others'
    1/H of sync's. Then each run against its reference (references()): float32 on both sides, equal
    but for rounding (a mean of gradients against a mean of weights; torch's averager divides before
    its SUM), which grows with the steps, fast where training is unstable: the README gives the
    runs, their dates and machine. --tol 1e-4: raise it for long runs (the tests' mistakes: 1e-3
    off or more)."""
    off, (model, sync_sent) = references(runs, windows, args, ctx), runs["sync SGD", 1][:2]
    full, failures = sum(p.numel() * p.element_size() for p in model.parameters()), []
    print0(
        f"GPT of {full // 4} float32 parameters ({full} bytes); {ctx.world_size} replica(s), "
        f"{args.steps} steps of {args.batch_size} windows of {args.block_size} tokens each"
    )
    print0(f"{'method':16s}    H bytes/step  ms/step val loss  |w - reference|")
    for (method, h), (model, sent, seconds, inner, outer) in runs.items():
        name, loss = f"{method} H={h}", val_loss(model, val_tokens, args, ctx)
        d, ref = off.get((method, h), (0.0, None))
        print0(
            f"{method:16s} {h:4d} {sent / args.steps:10.1f} {1e3 * seconds / args.steps:8.2f} "
            f"{loss:8.4f}  " + (f"{d:.1e} ({ref})" if ref else "-")
        )
        if (across := spread(model)) != 0.0:
            failures.append(f"{name}: ranks hold different weights (spread {across:.2e})")
        if (inner, outer) != (args.steps, args.steps // h * (method == "DiLoCo")):
            failures.append(f"{name}: {inner} steps and {outer} outer steps, not {args.steps}")
        if sent * h != (full * args.steps if method.startswith("sync") else sync_sent):
            failures.append(f"{name}: sent {sent} bytes in {args.steps} steps, not sync's / {h}")
        if not d <= args.tol:  # `not <=`: a NaN fails too
            failures.append(f"{name}: weights differ from {ref} by {d:.2e} > {args.tol:g}")
    if failures:
        raise RuntimeError("; ".join(failures))
    print0(
        f"OK: {ctx.world_size} replica(s), {args.steps} steps each: sync, local SGD (ours and "
        f"torch's post_localSGD_hook) and DiLoCo at H = {','.join(map(str, args.sync_every))} end "
        f"identical on every rank, each sending 1/H of sync's bytes per step; local SGD = sync SGD"
        f" at H=1, torch's = ours, DiLoCo = its replay with the outer step written out (max diff "
        f"{max(d for d, _ in off.values()):.1e}, tolerance {args.tol:g})"
    )


def sync_periods(text):
    """--sync-every's type: one H or several, comma-separated."""
    return [int_in(1, 100_000)(part) for part in text.split(",")]


sync_periods.__name__ = "a comma-separated list of integers in [1, 100000]"
sync_periods.high = 100_000  # --help shows the range

if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    add = parser.add_argument
    add("--sync-every", type=sync_periods, default="1,8,32",
        help="H: steps between syncs for local SGD and DiLoCo, one value or several")  # fmt: skip
    add("--steps", type=int_in(1, 100_000), default=96, help="steps (a multiple of each H)")
    add("--batch-size", type=int_in(1, 4096), default=8, help="windows per replica per step")
    add("--lr", type=float_in(0, 10, low_open=True), default=0.2, help="sync SGD and local SGD")
    add("--inner-lr", type=float_in(0, 1, low_open=True), default=3e-3, help="AdamW: sync, DiLoCo")
    add("--outer-lr", type=float_in(0, 10, low_open=True), default=0.7, help="DiLoCo's outer SGD")
    add("--outer-momentum", type=float_in(0, 0.999, low_open=True), default=0.9, help="Nesterov")
    add("--seed", type=int_in(0, 2**32 - 1), default=0, help="the initial weights")
    add("--tol", type=float_in(0, 1), default=1e-4, help="max |weight difference| (float32)")
    add("--n-layer", type=int_in(1, 256), default=2, help="the GPT's size (model.py)")
    add("--n-head", type=int_in(1, 1024), default=2)
    add("--n-embd", type=int_in(1, 65_536), default=32)
    add("--block-size", type=int_in(1, 4096), default=32, help="context length")
    parser.set_defaults(dropout=0.0)  # for config_from_args; the replays draw no dropout masks
    args = parser.parse_args()
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    run(main, args)
