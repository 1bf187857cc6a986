"""Train the GPT of model.py on one process, with DDP, or with FSDP2 (--parallel none|ddp|fsdp).

    torchrun --nproc_per_node=2 transformer_basics/train.py                  # DDP, 2 ranks
    torchrun --nproc_per_node=2 transformer_basics/train.py --parallel fsdp
    torchrun --nproc_per_node=2 transformer_basics/train.py --resume --steps 300  # from --out
    torchrun --nproc_per_node=2 transformer_basics/train.py --async-save --save-every 2
    torchrun --nproc_per_node=8 transformer_basics/train.py --gpt2-small --data input.txt
    python transformer_basics/train.py --nproc 1 --parallel none

main() is the whole recipe, top to bottom, as in nanoGPT's train.py: the data each rank reads,
the model, the parallelism (the lines train_2d.py changes), AdamW with a warm-up and a cosine,
resume, the evaluation (a collective), then the loop: micro-batches, gradient sync, clipping,
step, logging, checkpoints. It needs model.py, data.py and checkpointing.py (torch.save for none
and ddp, torch.distributed.checkpoint for fsdp and --async-save; atomic, with the RNG state).
--gpt2-small: GPT-2 small's shape with this folder's byte vocabulary, 85.25M parameters (GPT-2's
own 124M: add --vocab-size 50304), sized for throughput on a GPU; --profile N: where a step's
time goes.

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/notes/ddp.html, .../distributed.fsdp.fully_shard.html
"""

import argparse
import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.autograd import DeviceType
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves, tree_map

import data
from checkpointing import (
    Checkpointer,
    checkpoint_state,
    export_full_model,
    find_checkpoint,
    load_checkpoint,
    make_out_dir,
)
from launch.dist_setup import float_in, int_in, lesson_parser, print0, run
from model import GPT, GPTConfig


def main(args, ctx):
    ctx.require(
        args.parallel != "none" or ctx.world_size == 1,
        f"--parallel none trains one process, not {ctx.world_size}: use --nproc 1 or another one",
    )
    out = Path(args.out)
    ckpt = out / ("checkpoint" if args.parallel == "fsdp" or args.async_save else "checkpoint.pt")
    if args.resume:  # whichever checkpoint --out holds; the run goes on writing that one
        ckpt = find_checkpoint(out, args.parallel == "fsdp" or args.async_save, ctx)
    train_tokens, val_tokens = data.load_tokens(args.data, args.block_size, ctx)
    make_out_dir(out, ctx)  # after the refusals: a refused run writes nothing
    # Rank r reads the r-th disjoint share of every step's windows (like DistributedSampler).
    shard = dict(rank=ctx.rank, world_size=ctx.world_size, seed=args.seed)
    train_data = data.ShardedWindows(train_tokens, args.block_size, **shard)
    val_data = data.ShardedWindows(val_tokens, args.block_size, **shard)

    torch.manual_seed(args.seed)  # the same initial model on every rank (DDP broadcasts rank 0's)
    sizes = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout")
    cfg = GPTConfig(**{name: getattr(args, name) for name in sizes})
    model = GPT(cfg, activation_checkpointing=args.activation_checkpointing).to(ctx.device)
    n_params, flops_per_token = model.num_params(), model.flops_per_token()
    if args.compile:
        model.compile()  # in place: parameter names (and so checkpoints) stay the same
    # ---- the parallelism: these lines are what train_2d.py changes ----
    if args.parallel == "ddp":
        # .grad as views into the buckets: benchmark.py's ddp+, ddp_basics/ddp_overlap.py
        device_ids = None if ctx.device.type == "cpu" else [ctx.device]
        model = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
    elif args.parallel == "fsdp":
        # a mesh of ctx.device's type: FSDP2 would pick the GPU even on CPU + Gloo
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        blocks = list(model.blocks.values())
        for i, block in enumerate(blocks):
            # one all-gather per block, freed after use; not the last: its backward comes first
            fully_shard(block, mesh=mesh, reshard_after_forward=i < len(blocks) - 1)
        fully_shard(model, mesh=mesh)  # the rest (embeddings, final norm, head): the root's group
        for i, block in enumerate(blocks):  # gather the next block early: fsdp_overlap.py
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
            block.set_modules_to_backward_prefetch(blocks[i - 1 : i] if i else [])
    # --------------------------------------------------------------------
    # AdamW, weight decay on matrices (Linear weights, embeddings) only, never on biases and norms;
    # fused: one kernel updates every parameter (CUDA, and CPU since torch 2.4), no Python loop
    params = [p for p in model.parameters() if p.requires_grad]  # a tied weight comes once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=True)

    def lr_factor(step):  # a linear warm-up to --lr, then a cosine down to --min-lr at --steps
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        floor = args.min_lr / args.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    stateful = (model, optimizer, scheduler)  # what a checkpoint holds, with the step and the RNG
    start = load_checkpoint(ckpt, stateful, ctx) if args.resume else 0
    if args.resume:  # the check: what was restored, against the checkpoint read back
        check_resumed(ckpt, stateful, start=start, ctx=ctx)
    ctx.require(
        start < args.steps,
        f"--resume: the checkpoint is at step {start}, nothing left of --steps {args.steps}",
    )
    stop = min(args.steps, start + args.stop_after) if args.stop_after else args.steps
    resumed = f", resumed at step {start}" if args.resume else ""
    print0(
        f"model: {n_params / 1e6:.2f}M parameters, {cfg}; {args.parallel} on {ctx.world_size} "
        f"rank(s){resumed}"
    )
    # --async-save: a save returns once the state is copied to CPU, written behind the training
    save = Checkpointer(ckpt, stateful, ctx, asynchronous=args.async_save)
    if args.async_save:  # the check: the first asynchronous checkpoint, read back once written
        save = CheckedSaves(save)
    # bf16 autocast on a GPU that has it (--dtype auto); weights, gradients and AdamW stay float32
    gpu_bf16 = ctx.device.type == "cuda" and torch.cuda.is_bf16_supported()
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and gpu_bf16)
    autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=bf16)

    @torch.no_grad()
    def evaluate():  # the held-out loss: every rank its share of the windows, then the mean
        model.eval()
        total = torch.zeros((), device=ctx.device)
        for i in range(args.eval_batches):
            x, y = val_data.batch(i, 0, args.batch_size, args.accum, device=ctx.device)
            with autocast:
                total += model(x, y)
        dist.all_reduce(total, op=dist.ReduceOp.AVG)  # a collective: every rank evaluates
        model.train()
        return total.item() / args.eval_batches

    val_first = evaluate()
    tokens = args.batch_size * args.accum * args.block_size * ctx.world_size  # per step
    progress = Progress(range(start, stop), tokens_per_step=tokens, args=args, ctx=ctx)
    for step in progress:  # times the steps (and --profile)
        loss_sum = torch.zeros((), device=ctx.device)
        for micro in range(args.accum):
            x, y = train_data.batch(step, micro, args.batch_size, args.accum, device=ctx.device)
            # Backward syncs the gradients on the last micro-batch only; before, each rank adds
            # them up locally: DDP skips its all_reduce, FSDP its reduce-scatter.
            last = micro == args.accum - 1
            if args.parallel == "fsdp":
                model.set_requires_gradient_sync(last)
            with model.no_sync() if args.parallel == "ddp" and not last else nullcontext():
                with autocast:
                    loss = model(x, y) / args.accum  # the loss inside: compiled with the head
                loss.backward()
            loss_sum += loss.detach()  # stays on the device: no host sync per step
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == stop - 1:  # the only host syncs: when logging
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)  # the mean over the ranks' batches
            progress.log(step, loss_sum.item(), scheduler.get_last_lr()[0])
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < stop:
            save(step + 1)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < stop:
            print0(f"step {step + 1}: val loss {evaluate():.3f}")
    val_last = evaluate()
    save(stop, last=True)  # waits for the write in flight; this one is synchronous
    export_full_model(model, cfg, out / "model.pt")  # a collective: every rank

    if args.parallel == "ddp":
        check_replicas_agree(model)
    label = f"{args.parallel} x{ctx.world_size}"
    progress.summary(label, (val_first, val_last), flops_per_token, bf16)
    if args.async_save:
        save.print_stalls()
    print_sample(out / "model.pt", args.sample_tokens, ctx)
    check_loss_fell(val_first, val_last)
    print0(
        f"OK: {args.parallel} on {ctx.world_size} rank(s) trained steps {start}..{stop - 1}, "
        f"val loss {val_first:.3f} -> {val_last:.3f}; checkpoint {ckpt}, model {out / 'model.pt'}"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


class Progress:
    """The run's steps, for its loop: the first warms up (and compiles), --profile N profiles the
    next N, the rest are timed for the summary. log() prints the train loss."""

    def __init__(self, steps, tokens_per_step, args, ctx):
        self.steps, self.tokens_per_step, self.ctx, self.losses = steps, tokens_per_step, ctx, []
        n = max(0, min(args.profile, len(steps) - 2))  # and one timed step at least
        self.profiled, self.folder = range(steps.start + 1, steps.start + 1 + n), Path(args.out)
        # A GPU runs ahead of the host: time only what it has finished.
        self.sync = torch.accelerator.synchronize if ctx.device.type != "cpu" else lambda: None

    def __iter__(self):
        first_timed, self.t_timed = self.steps.start + 1 + len(self.profiled), None
        self.sync()
        self.t_log = time.perf_counter()
        for step in self.steps:
            if step == first_timed:
                self.sync()
                self.t_timed = time.perf_counter()
            if step in self.profiled:
                yield from self.profile(step)
            else:
                yield step
        self.sync()
        timed = self.steps.stop - first_timed
        self.step_time = (time.perf_counter() - self.t_timed) / timed if timed > 0 else math.nan

    def log(self, step, loss, lr):
        """The train loss after `step` (the ranks' mean), and the time per step since the last
        log: the loss's .item() has just waited for the device."""
        now, since = time.perf_counter(), (self.losses or [(self.steps.start - 1, 0)])[-1][0]
        ms = (now - self.t_log) / (step - since) * 1e3
        print0(f"step {step}: train loss {loss:.3f}, lr {lr:.1e}, {ms:.1f} ms/step")
        self.losses.append((step, loss))
        self.t_log = now

    def summary(self, label, val, flops_per_token, bf16):
        """Throughput and MFU of the timed steps; the train and val losses, first and last; then
        --profile's files."""
        tok_s = self.tokens_per_step / self.step_time
        (_, first), (_, final) = self.losses[0], self.losses[-1]
        cuda = self.ctx.device.type == "cuda"
        peak = torch.cuda.max_memory_allocated(self.ctx.device) / 2**30 if cuda else 0
        print0(
            f"summary: {label}, {len(self.steps)} steps, {tok_s:,.0f} tokens/s, "
            f"{self.step_time * 1e3:.1f} ms/step, MFU {mfu(flops_per_token * tok_s, self.ctx)}, "
            f"train loss {first:.3f} -> {final:.3f}, val loss {val[0]:.3f} -> {val[1]:.3f}, "
            f"bf16 {'on' if bf16 else 'off'}"
            + (f", peak CUDA memory {peak:.1f} GiB" if cuda else "")
        )
        if self.profiled and self.profiler:
            times = (self.wall_s, self.host_s, self.step_time)
            write_profile(self.profiler, self.profiled, times, self.folder / "profile", self.ctx)

    def profile(self, step):
        """A step under torch.profiler on rank 0; on every rank it ends with a synchronize, so
        that the time the host takes to issue it is measured alone."""
        if step == self.profiled.start:
            kinds = [torch.profiler.ProfilerActivity.CPU]
            if self.ctx.device.type == "cuda":
                kinds.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=kinds) if self.ctx.rank == 0 else None
            self.host_s, self.t_profile = 0.0, time.perf_counter()
            if self.profiler:
                self.profiler.start()
        t = time.perf_counter()
        yield step
        self.host_s += time.perf_counter() - t
        self.sync()
        if step == self.profiled[-1] and self.profiler:
            self.profiler.stop()
            self.wall_s = time.perf_counter() - self.t_profile


# Dense bf16 peak FLOP/s (NVIDIA's data sheets, without sparsity), for MFU; the first name found in
# the device's name wins, so "H100 PCIe" comes before "H100" and "A100" before "A10".
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "H800": 989e12, "B200": 2250e12}
PEAK_BF16 |= {"A100": 312e12, "A800": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12}


def mfu(flops_per_s, ctx):
    """Model FLOPs utilisation: the training FLOPs per second per GPU / the GPU's peak."""
    name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    peak = next((f for key, f in PEAK_BF16.items() if key in name), None)
    if peak is None:
        return f"unknown (no peak FLOP/s known for {name})"
    share = flops_per_s / ctx.world_size / peak
    return f"{share:.1%} of {name} bf16 dense peak {peak / 1e12:,.0f} TFLOP/s (data sheet)"


def write_profile(prof, steps, times, folder, ctx):
    """--profile: OUT/profile/trace.json, and summary.txt: per step the host's time to issue it
    and its data time (data.batch); the GPU's kernel time against the steps' (the timed ones ran
    without a synchronize per step); the top kernels by GPU time (on a CPU: ops by self time)."""
    (wall_s, host_s, step_s), n = times, len(steps)
    folder.mkdir(exist_ok=True)
    prof.export_chrome_trace(str(folder / "trace.json"))
    events = prof.events()
    kernels = [e for e in events if e.device_type != DeviceType.CPU and not e.is_user_annotation]
    busy_us, end = 0, 0
    for a, b in sorted((e.time_range.start, e.time_range.end) for e in kernels):
        busy_us, end = busy_us + max(0, b - max(a, end)), max(end, b)  # streams may overlap
    data_us = sum(e.cpu_time_total for e in prof.key_averages() if e.key == "data.batch")
    top = {}
    for e in kernels or events:
        us, calls = top.get(e.name, (0, 0))
        took = e.time_range.elapsed_us() if kernels else e.self_cpu_time_total
        top[e.name] = (us + took, calls + 1)
    busy_ms = busy_us / n / 1e3
    lines = [
        f"steps {steps.start}..{steps[-1]}, rank 0, on {torch.cuda.get_device_name(ctx.device)}"
        if kernels
        else f"steps {steps.start}..{steps[-1]}, rank 0, on the CPU",
        f"host: {host_s / n * 1e3:.1f} ms to issue a step (each profiled step synchronized at its "
        f"end), of which data {data_us / n / 1e3:.2f} ms (data.batch)",
        f"GPU: kernels {busy_ms:.1f} ms per step, {len(kernels) / n:,.0f} of them; busy "
        f"{busy_ms / (step_s * 1e3):.1%} of the timed steps' {step_s * 1e3:.1f} ms, "
        f"{busy_ms / (wall_s / n * 1e3):.1%} of the profiled steps' {wall_s / n * 1e3:.1f} ms"
        if kernels
        else "GPU: none",
        f"top {'kernels by GPU' if kernels else 'ops by self CPU'} time; per step: ms, calls, name",
    ]
    for name, (us, calls) in sorted(top.items(), key=lambda item: -item[1][0])[:25]:
        lines.append(f"{us / n / 1e3:10.3f} {calls / n:8.1f}  {name[:100]}")
    (folder / "summary.txt").write_text("\n".join(lines) + "\n")
    print(f"profile: {folder / 'summary.txt'}, {folder / 'trace.json'} (Chrome trace format: "
          "https://ui.perfetto.dev opens it)")  # fmt: skip


def check_replicas_agree(model):
    """DDP's promise: every replica holds the same parameters, to the bit."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if not torch.equal(low, high):
        raise RuntimeError("DDP replicas diverged: parameters differ between ranks")


def check_loss_fell(val_first, val_last):
    if val_last >= val_first:
        raise RuntimeError(f"the validation loss did not fall: {val_first:.3f} -> {val_last:.3f}")


def print_sample(path, tokens, ctx):
    """--sample-tokens: the exported model, in this process alone (generate.py does more)."""
    if ctx.rank == 0 and tokens:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        model = GPT(GPTConfig(**saved["config"]))
        model.load_state_dict(saved["model"])
        torch.manual_seed(0)
        prompt = data.encode("the ")[None].to(ctx.device)
        out = model.to(ctx.device).eval().generate(prompt, tokens, temperature=0.8, top_k=10)
        print("sample:\n  " + data.decode(out[0].tolist()).replace("\n", "\n  "))


def check_resumed(path, stateful, start, ctx):
    """After --resume, before anything draws a random number: the model, the optimizer's state
    (AdamW's moments and step counts), the scheduler, the step and the CPU RNG state equal the
    checkpoint's, read back on their own into fresh tensors. A resume that skipped one of them
    (the optimizer's, say) would train on from another state, and its loss might not show it."""
    model, optimizer, scheduler = stateful
    if path.suffix != ".pt":  # DCP: each rank reads its shards into copies of its own tensors
        model_sd, optim_sd = get_state_dict(model, optimizer)
        live = {"model": model_sd, "optimizer": optim_sd}
        saved = tree_map(clone, live) | {"scheduler": scheduler.state_dict(), "step": -1}
        saved["rng"] = torch.empty_like(torch.get_rng_state())
        dcp.load(saved, checkpoint_id=path)
    else:
        module = model.module if isinstance(model, DDP) else model
        live = {"model": module.state_dict(), "optimizer": optimizer.state_dict()}
        saved = torch.load(path, map_location="cpu", weights_only=True)
    live |= {"scheduler": scheduler.state_dict(), "step": start, "rng": torch.get_rng_state()}
    n = compare_states(live, {key: saved[key] for key in live}, "--resume: after the resume,")
    print0(
        f"check: resumed at step {start}: model, optimizer ({n} tensors in all), scheduler and "
        f"RNG state equal the checkpoint's"
    )


class CheckedSaves:
    """train.py's save with --async-save, checked and timed. When the first asynchronous save is
    called: a copy of this rank's state at that step (as DCP would write it); once that write is
    complete and published (at the next save), the checkpoint is read back and compared with the
    copy, to the bit. A write of live tensors that training changed meanwhile (no staged copy)
    differs. Also how long each save stopped the loop, and the CPU memory a save staged."""

    def __init__(self, save):
        self.save, self.expected, self.checked = save, None, False
        self.ms, self.async_steps, self.staged = {"wait": [], "async": [], "sync": []}, [], 0

    def __call__(self, step, last=False):
        save, t = self.save, time.perf_counter()
        save.wait()  # the write in flight, now complete, and published
        self.ms["wait"].append((time.perf_counter() - t) * 1e3)
        if self.expected is not None:
            saved_step, expected = self.expected
            saved = tree_map(clone, checkpoint_state(save.path, save.stateful, -1, save.ctx))
            dcp.load(saved, checkpoint_id=save.path)
            what = f"--async-save: the checkpoint of step {saved_step}, read back,"
            n = compare_states(expected, saved, what)
            print0(
                f"check: the asynchronous checkpoint of step {saved_step}, read back, holds "
                f"the state of step {saved_step} ({n} tensors, to the bit)"
            )
            self.expected, self.checked = None, True
        if not last:
            state = checkpoint_state(save.path, save.stateful, step, save.ctx)
            self.async_steps.append(step)
            self.staged = max(self.staged, staged_bytes(state))
            if not self.checked:
                self.expected = (step, tree_map(cpu_copy, state))
        t = time.perf_counter()
        save(step, last=last)
        self.ms["sync" if last else "async"].append((time.perf_counter() - t) * 1e3)

    def print_stalls(self):
        ms = self.ms
        print0(
            f"checkpoint stall: synchronous save {max(ms['sync']):.1f} ms, asynchronous "
            f"{sum(ms['async']) / len(ms['async']):.1f} ms (mean of steps "
            f"{', '.join(map(str, self.async_steps))}) + {sum(ms['wait']):.1f} ms in all waiting "
            f"for a write in flight; staged copy {self.staged / 2**20:.2f} MiB of CPU memory per "
            "rank until written"
        )


def staged_bytes(state):
    """The CPU copy async_save stages: one copy of each tensor storage in the state (a DTensor:
    of this rank's shard), as _state_dict_stager.py copies them."""
    storages = {}
    for t in tree_leaves(state):
        if isinstance(t, torch.Tensor):
            local = t.to_local() if isinstance(t, DTensor) else t
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def clone(t):
    return t.clone() if isinstance(t, torch.Tensor) else t


def cpu_copy(t):
    """This rank's part of a tensor (a DTensor: its shard), copied to the CPU."""
    if not isinstance(t, torch.Tensor):
        return t
    return (t.to_local() if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)


def compare_states(want, got, what):
    """Every leaf of two state dicts equal (tensors: this rank's part, to the bit); the number of
    tensors compared. Raises naming the first that differs, or is missing."""
    want, got = (dict(tree_flatten_with_path(tree_map(cpu_copy, s))[0]) for s in (want, got))
    for key in sorted(want.keys() | got.keys(), key=keystr):
        if key not in want or key not in got:
            where = "the checkpoint only" if key not in want else "the state only"
            raise RuntimeError(
                f"{what} the state differs from the checkpoint: {keystr(key)} is in {where}"
            )
        a, b = want[key], got[key]
        if not (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b):
            raise RuntimeError(f"{what} the state differs from the checkpoint at {keystr(key)}")
    n = sum(isinstance(a, torch.Tensor) for a in want.values())
    if not n:
        raise RuntimeError(f"{what} no tensor compared")
    return n


# --gpt2-small: GPT-2 small's shape (Radford et al. 2019; nanoGPT's gpt2 config) at this folder's
# byte vocabulary, and on a GPU its throughput: one micro-batch of 64 windows per rank and step
# (65,536 tokens; 524,288 on 8 GPUs, GPT-2's 0.5M), compiled. Fewer, larger micro-batches keep the
# GPU busy: each micro-batch costs the host about 1,000 kernel launches whatever its size (the
# README: measured on an H200).
GPT2_SMALL = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=64, accum=1)
GPT2_SMALL |= dict(lr=6e-4, min_lr=6e-5, warmup=100, compile=True)


def add_flags(parser):
    """The flags of train.py and train_2d.py, each with its range."""
    add = parser.add_argument
    add("--data", help="a UTF-8 text file (default: the corpus data.py makes)")
    add("--out", default="runs/gpt", help="checkpoints, model.pt and --profile's files go here")
    add("--resume", action="store_true", help="go on from the checkpoint in --out, whichever")
    count, every = int_in(1, 1_000_000), int_in(0, 1_000_000)
    for flag, kind, default, what in [
        ("--steps", count, 250, "optimizer steps in all (sets the LR schedule)"),
        ("--stop-after", every, 0, "stop after N steps, as if interrupted (0: at --steps)"),
        ("--batch-size", int_in(1, 4096), 16, "windows per micro-batch per rank"),
        ("--accum", int_in(1, 1024), 1, "micro-batches per step (gradient accumulation)"),
        ("--lr", float_in(0, 10, low_open=True), 3e-3, "peak learning rate"),
        ("--min-lr", float_in(0, 10), 3e-4, "learning rate at the last step (at most --lr)"),
        ("--weight-decay", float_in(0, 10), 0.1, "AdamW's, on matrices only"),
        ("--grad-clip", float_in(0, 1e6, low_open=True), 1.0, "largest gradient norm"),
        ("--warmup", every, 10, "steps of linear warm-up (0: none)"),
        ("--eval-every", every, 50, "held-out loss every N steps (0: at the end only)"),
        ("--eval-batches", int_in(1, 10_000), 4, "batches per held-out loss"),
        ("--log-every", count, 10, "train loss every N steps (a host sync)"),
        ("--save-every", every, 0, "also checkpoint every N steps (0: at the end only)"),
        ("--sample-tokens", int_in(0, 100_000), 200, "bytes to sample at the end (0: none)"),
        ("--seed", int_in(0, 2**32 - 1), 0, "data order and initial model"),
        ("--profile", every, 0, "N steps after the first under torch.profiler: OUT/profile/"),
        ("--vocab-size", int_in(256, 1_048_576), 256, "256: bytes; 50304: GPT-2's (50257 padded)"),
        ("--n-layer", int_in(1, 256), 4, "blocks"),
        ("--n-head", int_in(1, 1024), 4, "attention heads"),
        ("--n-embd", int_in(1, 65_536), 128, "width, a multiple of --n-head"),
        ("--block-size", int_in(1, 1_048_576), 64, "context length"),
        ("--dropout", float_in(0, 0.9), 0.0, "dropout probability"),
    ]:
        add(flag, type=kind, default=default, help=what)
    add("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
        help="autocast dtype; auto: bf16 on a GPU that has it, else float32")  # fmt: skip
    add("--compile", action=argparse.BooleanOptionalAction, default=False,
        help="torch.compile the model (--gpt2-small: on)")  # fmt: skip
    add("--gpt2-small", action="store_true",
        help="GPT-2 small's shape (12 layers, 12 heads, 768 wide, 1024 context): 85.25M "
        "parameters with the byte vocabulary, 123.69M with --vocab-size 50304 (GPT-2's 124M); "
        "64 windows x --accum 1 per rank, lr 6e-4, --compile: flags given still win")  # fmt: skip


def parse(parser, argv):
    """Parse argv; --gpt2-small's values become the defaults (a flag given still wins); then the
    constraints between flags, each refused in one line before any process group starts."""
    args = parser.parse_args(argv)
    if args.gpt2_small:
        parser.set_defaults(**GPT2_SMALL)
        args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must be larger than --warmup {args.warmup}")
    if args.min_lr > args.lr:
        parser.error(f"--min-lr {args.min_lr:g} is above --lr {args.lr:g}")
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    if args.profile and args.profile + 2 > (args.stop_after or args.steps):
        parser.error(f"--profile {args.profile}: the run needs {args.profile + 2} steps or more "
                     "(one to warm up, one timed)")  # fmt: skip
    return args


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument("--parallel", choices=["none", "ddp", "fsdp"], default="ddp")
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each block's activations in backward: less memory, one more forward",
    )
    parser.add_argument(
        "--async-save",
        action="store_true",
        help="write checkpoints (DCP) in a background thread, training goes on (the last: not)",
    )
    add_flags(parser)
    args = parse(parser, None)
    if args.async_save and not args.save_every:
        parser.error("--async-save needs --save-every N > 0")
    run(main, args)
