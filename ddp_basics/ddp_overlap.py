"""What runs while what waits in DDP's backward: a text timeline of one step per rank.

DDP cuts the gradients into buckets of bucket_cap_mb MiB, in about the reverse order of
model.parameters(), and all_reduces each bucket as soon as its gradients are all ready, while
autograd goes on with the earlier layers; after the first step it rebuilds the buckets "based on
its real execution order in backward graph". With the default cap (25) the first bucket holds at
most 1 MiB; gradient_as_bucket_view makes each .grad a view into its bucket: no copy, no second
copy of the gradients in memory (all three: torch/nn/parallel/distributed.py, torch 2.13). For
four DDP settings the lesson times each Linear layer's backward (its output's gradient in, its
weight's gradient out) and each bucket's all_reduce (a comm hook: the call, then its future's
completion); all four must train to one process's parameters. On CPU, Gloo adds the buckets on
the cores that run the backward: read the order of the events, not the times. On a GPU the times
are CUDA events, and a comm future's callback runs on a stream that waits for the NCCL kernel
(Future.then, torch/futures/__init__.py): the end of the all_reduce on the GPU.

    torchrun --nproc_per_node=2 ddp_basics/ddp_overlap.py
    python ddp_basics/ddp_overlap.py --nproc 3 --width 1024 --small-mb 4

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/notes/ddp.html#internal-design
      https://pytorch.org/docs/stable/ddp_comm_hooks.html
"""

import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from launch import charts
from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run
from toy import MLP, flat, fp32_tolerance, make_data


def main(args, ctx):
    x, y = (t.to(ctx.device) for t in make_data(args.steps * ctx.world_size * args.batch))
    torch.manual_seed(0)
    start = MLP(args.width, depth=args.depth).to(ctx.device)
    # (bucket_cap_mb, gradient_as_bucket_view); None: DDP's default, 25 MiB, the first one 1 MiB
    variants = [(None, False), (2 * args.small_mb, False), (args.small_mb, False)]
    variants.append((args.small_mb, True))
    results = {v: train(args, ctx, start, x, y, *v) for v in variants}
    print_timelines(results, args, ctx)
    check_timelines(results, start, ctx)
    check_same_parameters(results, start, x, y, args, ctx)


def train(args, ctx, start, x, y, bucket_cap_mb, as_view):
    """Train a DDP copy of start; return its module, the last step's timeline, its buckets'
    parameters and the parameters whose .grad lies in a bucket's buffer."""
    device_ids = None if ctx.device.type == "cpu" else [ctx.device]
    model = DDP(
        copy.deepcopy(start),
        device_ids=device_ids,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=as_view,
    )
    clock, spans, buffers, held = Clock(ctx.device), {}, [], {}
    # the hook must not hold `model`: DDP holds the hook, a loop through C++ that the garbage
    # collector cannot see, so the model and its process group would never be freed
    names = {p.data_ptr(): n for n, p in model.module.named_parameters()}

    def timed_all_reduce(state, bucket):  # DDP calls it once per bucket, when its grads are ready
        started, buf, index = clock.now(), bucket.buffer(), bucket.index()
        ptrs = {p.data_ptr() for p in bucket.parameters()}  # the model's own tensors
        held[index] = [name for ptr, name in names.items() if ptr in ptrs]
        buffers.append((buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()))
        buf.div_(ctx.world_size)  # as DDP's own all_reduce does (default_hooks.allreduce_hook)
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(fut):  # once the all_reduce has finished (on a GPU: on a stream that waits)
            layers = dict.fromkeys(n.rsplit(".", 1)[0] for n in held[index])  # net.6.weight: net.6
            spans[f"all_reduce bucket {index}"] = (started, clock.now(), ", ".join(layers))
            return fut.value()[0]

        return fut.then(done)

    model.register_comm_hook(None, timed_all_reduce)

    def time_backward(name, layer):  # from its output's gradient in to its weight's .grad
        def on_forward(module, inputs, out):
            out.register_hook(lambda grad: spans.update({name: (clock.now(), None, "")}))

        layer.register_forward_hook(on_forward)
        layer.weight.register_post_accumulate_grad_hook(
            lambda p: spans.update({name: (spans[name][0], clock.now(), "grads ready")})
        )

    for name, layer in model.module.named_modules():
        if isinstance(layer, torch.nn.Linear):
            time_backward(f"backward {name}", layer)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        lo = (step * ctx.world_size + ctx.rank) * args.batch
        loss = F.cross_entropy(model(x[lo : lo + args.batch]), y[lo : lo + args.batch])
        spans.clear(), buffers.clear(), held.clear()
        clock.t0 = clock.now()
        loss.backward()  # returns once every bucket's all_reduce has finished
        timeline = clock.resolve(spans)
        grads = [(name, p.grad.data_ptr()) for name, p in model.module.named_parameters()]
        opt.step()
        opt.zero_grad()
    in_buckets = [name for name, ptr in grads if any(lo <= ptr < hi for lo, hi in buffers)]
    return model.module, timeline, dict(held), in_buckets


# ---- The lesson ends here. What follows is how it checks itself. ----


class Clock:
    """Milliseconds since t0: perf_counter on the CPU; on a GPU CUDA events, each recorded on the
    current stream (it completes when the GPU gets there: torch.cuda.Event), read after a
    synchronize. (torch.Event, the device-generic one, has no CPU backend in torch 2.13.)"""

    def __init__(self, device):
        self.cuda, self.t0 = device.type == "cuda", None

    def now(self):
        if self.cuda:
            (event := torch.cuda.Event(enable_timing=True)).record()
            return event
        return time.perf_counter()

    def resolve(self, spans):
        if self.cuda:
            torch.cuda.synchronize()
        ms = self.t0.elapsed_time if self.cuda else (lambda t: (t - self.t0) * 1e3)
        return {what: (ms(a), ms(b), note) for what, (a, b, note) in spans.items() if b is not None}


def label(cap, as_view):
    cap = "default" if cap is None else f"{cap:g}"
    return f"bucket_cap_mb={cap}, gradient_as_bucket_view={as_view}"


def print_timelines(results, args, ctx, width=40):
    """One block per variant: every rank's last backward, one row per layer and per bucket, by
    start time."""
    for (cap, as_view), (_, timeline, held, _) in results.items():
        print0(
            f"\n{label(cap, as_view)}: {len(held)} bucket(s); last step's backward, ms from its "
            "start"
        )
        end = max(b for _, b, _ in timeline.values()) or 1.0
        rows = []
        for what, (a, b, note) in sorted(timeline.items(), key=lambda item: item[1][:2]):
            lo, hi = round(a / end * width), max(round(b / end * width), round(a / end * width) + 1)
            bar = " " * lo + ("#" if what.startswith("backward") else "=") * (hi - lo)
            rows.append(f"  {what:22s} {a:7.2f} .. {b:7.2f} |{bar:{width}s}| {note}")
        print_in_order("\n".join(rows))
    print0("(# backward of a layer, = all_reduce of a bucket; on CPU both share the same cores)")
    if ctx.rank == 0 and args.chart:
        write_chart(results, args.chart)


def write_chart(results, path):
    """Rank 0's timelines as gantts: each layer's backward against each bucket's all_reduce."""
    gantts = []
    for (cap, as_view), (_, timeline, _, _) in results.items():
        computed, sent = [], []  # the layers' backward, the buckets' all_reduce
        for what, (a, b, note) in sorted(timeline.items(), key=lambda item: item[1][:2]):
            if what.startswith("backward"):
                computed.append((what, a * 1e3, b * 1e3))  # microseconds
            else:  # "bucket 0 (net.6, net.8)"
                sent.append((f"{what.removeprefix('all_reduce ')} ({note})", a * 1e3, b * 1e3))
        sections = {"backward (autograd)": computed, "all_reduce (comm hook)": sent}
        gantts.append(charts.gantt(f"rank 0, last step, {label(cap, as_view)}", sections))
    charts.write(path, *gantts)


def check_timelines(results, start, ctx):
    """Per variant, on this rank: every parameter in exactly one bucket; with several buckets the
    first all_reduce starts before the backward is over (overlap: the order of hooks on the
    autograd thread, not a timing); the gradients live in the bucket buffers exactly when
    gradient_as_bucket_view is on."""
    params = [n for n, _ in start.named_parameters()]
    failures = []
    for (cap, as_view), (_, timeline, held, in_buckets) in results.items():
        name = label(cap, as_view)
        every_once = sorted(sum(held.values(), [])) == sorted(params)
        if sorted(held) != list(range(len(held))) or not every_once:
            failures.append(f"{name}: buckets {held} do not hold every parameter once")
        backward_end = max(b for what, (_, b, _) in timeline.items() if what.startswith("backward"))
        if len(held) > 1 and not timeline["all_reduce bucket 0"][0] < backward_end:
            failures.append(f"{name}: bucket 0's all_reduce started after the backward ended")
        if in_buckets != (params if as_view else []):
            failures.append(f"{name}: gradients inside the bucket buffers: {in_buckets}")
    verdict = "no: " + "; ".join(failures) if failures else "yes"
    print_in_order(
        f"every variant: each parameter in one bucket, bucket 0 sent before the backward ends, "
        f".grad in the buckets iff gradient_as_bucket_view: {verdict}"
    )
    dist.barrier()
    if failures:
        raise RuntimeError(f"[rank {ctx.rank}] " + "; ".join(failures))


def check_same_parameters(results, start, x, y, args, ctx):
    """One process, plain torch, each step on the concatenation of every rank's batch (whose mean
    loss is the mean of the ranks' mean losses, what DDP's averaged gradient is the gradient of).
    float32 on one device: the runs differ by summation order only (the all_reduce adds the ranks'
    gradients in an order of its own), measured 3e-8 at 2 ranks; bound 1e-5, widened if TF32
    matmuls are on (toy.fp32_tolerance)."""
    single = copy.deepcopy(start)
    opt = torch.optim.SGD(single.parameters(), lr=args.lr)
    n = ctx.world_size * args.batch
    for step in range(args.steps):
        opt.zero_grad()
        batch = slice(step * n, (step + 1) * n)
        F.cross_entropy(single(x[batch]), y[batch]).backward()
        opt.step()
    tol, ref = fp32_tolerance(1e-5), flat(single)
    diffs = {label(*key): (flat(r[0]) - ref).abs().max().item() for key, r in results.items()}
    for name, d in diffs.items():
        print0(f"{name}: max |parameter - one process| {d:.1e} (bound {tol:.0e})")
    bad = [name for name, diff in diffs.items() if not diff <= tol]
    if bad:
        raise RuntimeError(
            f"[rank {ctx.rank}] parameters differ from one process's beyond {tol:.0e}: {bad}"
        )
    buckets = [len(r[2]) for r in results.values()]
    print0(
        f"OK: {len(results)} DDP variants on {ctx.world_size} rank(s), {min(buckets)} to "
        f"{max(buckets)} buckets, all train to one process's parameters "
        f"(max diff {max(diffs.values()):.1e})"
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--width", type=int_in(1, 8192), default=256, help="hidden width")
    parser.add_argument("--depth", type=int_in(0, 16), default=3, help="hidden layers")
    small = "the small bucket_cap_mb, in MiB (0.25: about one 256 x 256 layer per bucket)"
    parser.add_argument(
        "--small-mb", type=float_in(0, 4096, low_open=True), default=0.25, help=small
    )
    steps = "training steps (the first one builds the buckets, the last one is shown)"
    parser.add_argument("--steps", type=int_in(2, 1000), default=4, help=steps)
    parser.add_argument("--batch", type=int_in(1, 10**5), default=64, help="examples per rank")
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.1)
    parser.add_argument("--chart", type=charts.path, help="rank 0's timelines as gantts (.md)")
    run(main, parser.parse_args())
