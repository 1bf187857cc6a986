"""What runs while what waits in DDP's backward: a text timeline of one step per rank.

DDP cuts the gradients into buckets (bucket_cap_mb, in MiB) in about the reverse order of
model.parameters() and all_reduces each bucket as soon as all its gradients are ready, while
autograd goes on with the earlier layers (the "Internal Design" of the DDP notes). After the first
step it rebuilds the buckets in the order the gradients actually became ready, and with default
settings the first bucket holds at most 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES,
torch/nn/parallel/distributed.py, torch 2.13). gradient_as_bucket_view=True makes each .grad a
view into its bucket, which saves a copy and the memory of the gradients (same file, its docstring).
The lesson times the last step's backward of every Linear layer (module pre-hook to its
gradients ready) and each bucket's all_reduce (a comm hook: its call to its future's completion),
for several bucket sizes and both gradient_as_bucket_view settings, and checks that every variant
trains to the parameters of one process on the whole batch.

On CPU with Gloo the all_reduce runs on Gloo's threads on the same cores that run the backward,
so here "overlap" is mostly the order of events. On a GPU the times are CUDA events on the device:
a comm future's callback runs on a stream that waits for the NCCL kernel (Future.then,
torch/futures/__init__.py), so an event recorded there marks the all_reduce's end on the GPU.

    torchrun --nproc_per_node=2 ddp_basics/ddp_overlap.py
    python ddp_basics/ddp_overlap.py --nproc 3 --width 1024 --depth 6 --steps 5

Docs: https://pytorch.org/docs/stable/notes/ddp.html#internal-design
      https://pytorch.org/docs/stable/ddp_comm_hooks.html
"""
import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.dist_setup import lesson_parser, print0, print_in_order, run, test_flags
from toy import MLP, flat, fp32_tolerance, make_data


def main(args, ctx):
    ctx.require(min(args.width, args.depth, args.steps, args.batch) >= 1,
                "--width, --depth, --steps and --batch must be at least 1")
    ctx.require(args.small_mb > 0, f"--small-mb must be positive, got {args.small_mb}")
    x, y = (t.to(ctx.device) for t in make_data(args.steps * ctx.world_size * args.batch))
    torch.manual_seed(0)
    start = MLP(args.width, depth=args.depth).to(ctx.device)
    # (bucket_cap_mb, gradient_as_bucket_view); None: DDP's default, 25 MiB with a first bucket of 1 MiB
    variants = [(None, False), (2 * args.small_mb, False), (args.small_mb, False), (args.small_mb, True)]
    results = {}
    for cap, as_view in variants:
        results[cap, as_view] = train(args, ctx, start, x, y, cap, as_view)
    print_timelines(results, ctx)
    check_timelines(results, start, ctx)
    check_same_parameters(results, start, x, y, args, ctx)


def train(args, ctx, start, x, y, bucket_cap_mb, as_view):
    """Train a DDP copy of start; return (its model, the last step's timeline, its bucket buffers)."""
    model = DDP(copy.deepcopy(start), device_ids=None if ctx.device.type == "cpu" else [ctx.device],
                bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=as_view)
    clock, spans, buffers, held = Clock(ctx.device), {}, [], {}

    def timed_all_reduce(state, bucket):  # DDP calls it once per bucket, when the bucket's gradients are ready
        started, buf = clock.now(), bucket.buffer()
        buffers.append((buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()))
        if not args.no_divide:  # DDP's default divides by the world size too (default_hooks.allreduce_hook)
            buf.div_(ctx.world_size)
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(fut):  # runs when the all_reduce has finished (on a GPU: on a stream that waits for it)
            held[bucket.index()] = names(model, bucket)
            spans[f"all_reduce bucket {bucket.index()}"] = (started, clock.now(), layers(held[bucket.index()]))
            return fut.value()[0]
        return fut.then(done)

    model.register_comm_hook(None, timed_all_reduce)
    def time_backward(name, layer):  # a layer's backward: from its output's gradient in to its weight's grad
        def on_forward(module, inputs, out):
            out.register_hook(lambda grad: spans.update({name: (clock.now(), None, "")}))

        layer.register_forward_hook(on_forward)
        layer.weight.register_post_accumulate_grad_hook(
            lambda p: spans.update({name: (spans[name][0], clock.now(), "grads ready")}))

    for name, layer in model.module.named_modules():
        if isinstance(layer, torch.nn.Linear):
            time_backward(f"backward {name}", layer)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        lo = (step * ctx.world_size + ctx.rank) * args.batch
        loss = F.cross_entropy(model(x[lo:lo + args.batch]), y[lo:lo + args.batch])
        spans.clear(), buffers.clear(), held.clear(), clock.start()
        loss.backward()  # returns once every bucket's all_reduce has finished
        timeline = clock.resolve(spans)
        grads = [(name, p.grad.data_ptr()) for name, p in model.module.named_parameters()]
        opt.step()
        opt.zero_grad()
    in_buckets = [name for name, ptr in grads if any(lo <= ptr < hi for lo, hi in buffers)]
    return model.module, timeline, dict(held), in_buckets


class Clock:
    """Milliseconds since start(): perf_counter on the CPU, CUDA events (resolved after the step) on a GPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def start(self):
        self.t0 = self.now()

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: the moment the GPU gets there
        return event

    def resolve(self, spans):
        if self.cuda:
            torch.cuda.synchronize()
        ms = (lambda t: self.t0.elapsed_time(t)) if self.cuda else (lambda t: (t - self.t0) * 1e3)
        return {what: (ms(a), ms(b), note) for what, (a, b, note) in spans.items() if b is not None}


def names(model, bucket):
    """The names of the parameters a bucket holds (GradBucket.parameters(): the model's own tensors)."""
    ptrs = {p.data_ptr() for p in bucket.parameters()}
    return [n for n, p in model.module.named_parameters() if p.data_ptr() in ptrs]


def layers(param_names):
    return ", ".join(dict.fromkeys(n.rsplit(".", 1)[0] for n in param_names))


def label(cap, as_view):
    return f"bucket_cap_mb={'default' if cap is None else f'{cap:g}'}, gradient_as_bucket_view={as_view}"


def print_timelines(results, ctx, width=40):
    """One block per variant: every rank's last backward, one row per layer and per bucket, by start time."""
    for (cap, as_view), (_, timeline, held, _) in results.items():
        print0(f"\n{label(cap, as_view)}: {len(held)} bucket(s); last step's backward, ms from its start")
        end = max(b for _, b, _ in timeline.values()) or 1.0
        rows = []
        for what, (a, b, note) in sorted(timeline.items(), key=lambda item: item[1][:2]):
            lo, hi = round(a / end * width), max(round(b / end * width), round(a / end * width) + 1)
            bar = " " * lo + ("#" if what.startswith("backward") else "=") * (hi - lo)
            rows.append(f"  {what:22s} {a:7.2f} .. {b:7.2f} |{bar:{width}s}| {note}")
        print_in_order("\n".join(rows))
    print0("(# backward of a layer, = all_reduce of a bucket; on CPU both share the same cores)")


def check_timelines(results, start, ctx):
    """Per variant, on this rank: every parameter in exactly one bucket, each span ends after it starts,
    with several buckets the first all_reduce starts before the backward is over (overlap), and the
    gradients live in the bucket buffers exactly when gradient_as_bucket_view is on."""
    params = [n for n, _ in start.named_parameters()]
    failures = []
    for (cap, as_view), (_, timeline, held, in_buckets) in results.items():
        name = label(cap, as_view)
        if sorted(held) != list(range(len(held))) or sorted(sum(held.values(), [])) != sorted(params):
            failures.append(f"{name}: buckets {held} do not hold every parameter once")
        if any(not a <= b for a, b, _ in timeline.values()):
            failures.append(f"{name}: a span ends before it starts")
        backward_end = max(b for what, (_, b, _) in timeline.items() if what.startswith("backward"))
        if len(held) > 1 and not timeline["all_reduce bucket 0"][0] < backward_end:
            failures.append(f"{name}: bucket 0's all_reduce started after the backward ended")
        if in_buckets != (params if as_view else []):
            failures.append(f"{name}: gradients inside the bucket buffers: {in_buckets}")
    print_in_order(f"every variant: each parameter in one bucket, spans in order, grads in buckets iff "
                   f"gradient_as_bucket_view: {'no: ' + '; '.join(failures) if failures else 'yes'}")
    dist.barrier()
    if failures:
        raise RuntimeError(f"[rank {ctx.rank}] " + "; ".join(failures))


def check_same_parameters(results, start, x, y, args, ctx):
    """One process, plain torch, each step on the concatenation of every rank's batch (whose mean loss
    is the mean of the ranks' mean losses, what DDP's averaged gradient is the gradient of). float32 on
    one device: the runs differ by summation order (bucket sizes change the order in which a ring
    all_reduce adds), measured ~1e-8; bound 1e-5, widened if TF32 matmuls are on (toy.fp32_tolerance)."""
    single = copy.deepcopy(start)
    opt = torch.optim.SGD(single.parameters(), lr=args.lr)
    n = ctx.world_size * args.batch
    for step in range(args.steps):
        opt.zero_grad()
        F.cross_entropy(single(x[step * n:(step + 1) * n]), y[step * n:(step + 1) * n]).backward()
        opt.step()
    tol, ref = fp32_tolerance(1e-5), flat(single)
    diffs = {label(*key): (flat(model) - ref).abs().max().item() for key, (model, *_) in results.items()}
    for name, diff in diffs.items():
        print0(f"{name}: max |parameter - one process| {diff:.1e} (bound {tol:.0e})")
    bad = [name for name, diff in diffs.items() if not diff <= tol]
    if bad:
        raise RuntimeError(f"[rank {ctx.rank}] parameters differ from one process's beyond {tol:.0e}: {bad}")
    print0(f"OK: {len(results)} DDP variants on {ctx.world_size} rank(s), {min(len(h) for _, _, h, _ in results.values())}"
           f" to {max(len(h) for _, _, h, _ in results.values())} buckets, all_reduce overlapping the backward, "
           f"all train to one process's parameters (max diff {max(diffs.values()):.1e})")


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--width", type=int, default=256, help="hidden width (a width x width weight: width^2*4 bytes)")
    parser.add_argument("--depth", type=int, default=3, help="hidden width x width layers")
    parser.add_argument("--small-mb", type=float, default=0.25,
                        help="the small bucket_cap_mb, in MiB (0.25: about one 256 x 256 layer per bucket)")
    parser.add_argument("--steps", type=int, default=4, help="training steps (the first one builds the buckets)")
    parser.add_argument("--batch", type=int, default=64, help="examples per rank per step")
    parser.add_argument("--lr", type=float, default=0.1)
    test_flags(parser).add_argument("--no-divide", action="store_true",
                                    help="the timing hook sums the gradients, not averages them: the parameters differ")
    run(main, parser.parse_args())
