"""Every check of every lesson fails when the lesson is wrong.

Each row below is a mistake a reader could make copying a lesson, written into a copy of the
lesson (tests/harness.mutant: a copy of the lesson's folder in a temporary directory, with `old`
replaced by `new`, each `old` occurring exactly once in the file), and the message the lesson's own
check prints when it catches that mistake. The copy runs as the lesson does (the warm launcher
by default) and must exit non-zero, print that message and no OK line. No lesson has a flag for it.

test_every_mutation_still_applies checks in a second, in this process, that every `old` still
occurs once in today's lessons: a change to a lesson that moves the text fails there first.
"""

from dataclasses import dataclass, field

import pytest

from harness import ROOT, assert_fails, mutant, run_lesson


@dataclass
class Mutation:
    id: str  # the name of the test case
    lesson: str  # the lesson that is run
    changes: list  # [(old, new), ...], made in `file`
    message: str  # what the lesson's check prints when it catches the mistake
    nproc: int = 2
    args: tuple = ()
    file: str = None  # a sibling of the lesson to change instead of the lesson (e.g. "model.py")
    launcher: str = "warm"
    timeout: int = 120
    quick: bool = False  # also in `pytest -m quick`
    marks: list = field(default_factory=list)


# ---------------------------------------------------------------------------------- primitives/
PRIMITIVES = [
    Mutation(
        "all_reduce-call-left-out",
        "primitives/all_reduce.py",
        [("dist.all_reduce(t, op=getattr(dist.ReduceOp, name))", "pass")],
        "all_reduce SUM gave",
        quick=True,
    ),
    Mutation(  # was the flag --no-barrier
        "barrier-left-out",
        "primitives/barrier.py",
        [("dist.barrier()  # nobody reads before the preparer has written", "pass")],
        "does not exist yet",
        args=("--delay", "3"),  # the readers fail at once; the preparer is still asleep
        quick=True,
    ),
    Mutation(  # a hard-coded root: right only when --src is 0
        "broadcast-from-rank-0-always",
        "primitives/broadcast.py",
        [("dist.broadcast(t, src=args.src)", "dist.broadcast(t, src=0)")],
        "expected rank 1's",
        args=("--src", "1"),
    ),
    Mutation(  # the last element sent left instead of right: every halo is the wrong edge
        "ring_exchange-wrong-edge-sent",
        "primitives/ring_exchange.py",
        [
            (
                "dist.P2POp(dist.isend, chunk[-1:].contiguous(), right)",
                "dist.P2POp(dist.isend, chunk[:1].contiguous(), right)",
            )
        ],
        "!= numpy",
        nproc=3,
    ),
    Mutation(  # the shift by SUM of the local maxima: softmax and logsumexp cancel it out, so
        # only the check of m itself can see it (at --offset 0, where exp does not underflow)
        "distributed_softmax-shift-by-sum",
        "primitives/distributed_softmax.py",
        [("dist.all_reduce(m, op=dist.ReduceOp.MAX)", "dist.all_reduce(m, op=dist.ReduceOp.SUM)")],
        "global max",
        args=("--offset", "0"),
    ),
    Mutation(  # SUM where the lesson shares by MAX: each slot comes out x its group size
        "process_groups-shared-by-sum",
        "primitives/process_groups.py",
        [
            (
                "dist.all_reduce(by_max, op=dist.ReduceOp.MAX)",
                "dist.all_reduce(by_max, op=dist.ReduceOp.SUM)",
            )
        ],
        "sharing by MAX gave",
        nproc=3,
    ),
    Mutation(  # the half's all_reduce on the world group: every rank sums everyone's data
        "process_groups-half-summed-over-the-world",
        "primitives/process_groups.py",
        [("dist.all_reduce(t, group=group)", "dist.all_reduce(t)")],
        "gave [-600.0, -597.0], expected",  # the world's sum, on whichever half fails first
        nproc=3,
    ),
    Mutation(  # new_subgroups' group left out: at 4 ranks the world's sum, not the pair's
        "process_groups-subgroup-left-out",
        "primitives/process_groups.py",
        [("dist.all_reduce(s, group=sub)", "dist.all_reduce(s)")],
        "subgroup sum 10.0 is not the sum of ranks + 1 over",
        nproc=4,
    ),
    Mutation(  # the empty slots 0, not MAX's identity -inf: only negative sums can show it
        "process_groups-empty-slots-zero",
        "primitives/process_groups.py",
        [
            (
                'slots = torch.full((2, n), float("-inf"), device=dev)',
                "slots = torch.zeros(2, n, device=dev)",
            )
        ],
        "sharing by MAX gave",
    ),
    Mutation(  # the mesh's dimensions swapped: the check reads the mesh built, not the request
        "device_mesh-dims-swapped",
        "primitives/device_mesh.py",
        [("ctx.device.type, (dp, tp)", "ctx.device.type, (tp, dp)")],
        "the mesh built is",
    ),
    # ring_all_reduce, ring_all_reduce_pipelined, benchmark_collectives, weight_sync, the DTensor
    # lessons, grad_through_collectives: one block, kept at the end of this list.
    Mutation(
        "ring_all_reduce-copy-instead-of-add",
        "primitives/ring_all_reduce.py",
        [("chunks[recv_i].add_(incoming)", "chunks[recv_i].copy_(incoming)")],
        "ring all-reduce of 7 elements differs from a plain sum",
        nproc=3,
        args=("--sizes", "7", "--iters", "1"),
        quick=True,
    ),
    Mutation(  # was --reduce-before-wait: with 4 pieces per segment at 3 ranks, 16 adds per rank
        # on 16 K-element pieces race their receives; every add would have to lose the race for
        # the sum to come out right
        "ring_all_reduce_pipelined-add-before-wait",
        "primitives/ring_all_reduce_pipelined.py",
        [  # the add moved from after the wait to before it
            (
                "into, works = posted[k]\n",
                "into, works = posted[k]\n        if add:\n            recv.add_(into)\n",
            ),
            ("            recv.add_(into)  # the overlap", "            pass  # the overlap"),
        ],
        "pipelined ring (4 chunks) all-reduce of 65537 elements differs from a plain sum",
        nproc=3,
        args=("--sizes", "65537", "--chunks", "4", "--iters", "1"),
    ),
    Mutation(  # was --corrupt-for-testing: the in-place all_gather idiom, the input never copied in
        "benchmark_collectives-all-gather-in-place-without-its-input",
        "primitives/benchmark_collectives.py",
        [
            (
                "lambda: dist.all_gather_single(out, inp)",
                "lambda: dist.all_gather_single(out, out[rank * part : (rank + 1) * part])",
            )
        ],
        "wrong result of all_gather",
        args=("--ops", "all_reduce,all_gather", "--max-bytes", "4K"),
    ),
    Mutation(  # the worker receives each bucket into a new tensor, not the one its parameters view
        "weight_sync-bucket-received-into-a-copy",
        "primitives/weight_sync.py",
        [
            (
                "dist.broadcast(flats[i], src=trainer, group=sync_group)",
                "dist.broadcast(_flatten_dense_tensors(bucket), src=trainer, group=sync_group)",
            )
        ],
        "after bucketed sync at step 0 a parameter of shape",
        args=("--steps", "1"),
    ),
    Mutation(  # was --from-local-without-shape: 10 rows as 4, 4, 2; from_local assumes 3 x local
        "dtensor_basics-from-local-without-shape",
        "primitives/dtensor_basics.py",
        [(", [Shard(0)], shape=full.shape, stride=full.stride())", ", [Shard(0)])")],
        "from_local gave global shape",
        nproc=3,
    ),
    Mutation(  # was --local-as-full: a Partial's to_local() is this rank's term, not the value
        "dtensor_basics-to-local-read-as-the-value",
        "primitives/dtensor_basics.py",
        [("{name: d.full_tensor() for", "{name: d.to_local() for")],
        "from_local(Partial): placement P(sum), full_tensor matches plain torch: False",
        nproc=3,
    ),
    Mutation(  # was --seed-per-rank; on CPU only: on CUDA DTensor copies rank 0's RNG state
        "dtensor_basics-a-seed-per-rank",
        "primitives/dtensor_basics.py",
        [("torch.manual_seed(args.seed)", "torch.manual_seed(args.seed + rank)")],
        "rand_like on CPU: ranks [1] did not draw what a generator seeded with --seed 0 draws",
    ),
    Mutation(  # was --relabel: a new label on the same local data, nothing moved
        "dtensor_redistribute-relabel-instead-of-redistribute",
        "primitives/dtensor_redistribute.py",
        [
            (
                "return src.redistribute(mesh, [dst])",
                "return DTensor.from_local(src.to_local(), mesh, [dst], shape=src.shape, "
                "stride=src.stride())",
            )
        ],
        "is not my R piece of the plain tensor",
        nproc=3,
    ),
    Mutation(  # was --without-loss-parallel: the same call outside the context gathers the logits
        "dtensor_loss_parallel-without-the-context",
        "primitives/dtensor_loss_parallel.py",
        [("with loss_parallel():", "with torch.enable_grad():")],
        "the logits were gathered ({'all_gather_into_tensor': 1})",
    ),
    Mutation(  # issue 32: the backward outside loss_parallel() runs, but gathers the gradient
        "dtensor_loss_parallel-backward-outside-the-context",
        "primitives/dtensor_loss_parallel.py",
        [("        with CommDebugMode() as backward:", "    with CommDebugMode() as backward:")],
        "the gradient of the logits is Replicate() with local shape (8, 16), not Shard(1)",
    ),
    Mutation(  # was --unreduced-backward: the hand-written gather is then the plain one
        "grad_through_collectives-backward-without-its-all-reduce",
        "primitives/grad_through_collectives.py",
        [("dist.all_reduce(grad, op=dist.ReduceOp.SUM)", "pass  # no all_reduce")],
        "autograd.Function by hand: max gradient error",
        nproc=3,
        args=("--batch", "4"),
        quick=True,
    ),
    # async_errors (issue 45): the data separate SUM from MAX; the failure is the timeout asked for
    Mutation(  # rank + 1 in every element: at 2 ranks MAX gives 2, SUM 3 (rank 0's zeros hid it)
        "async_errors-in-flight-max-not-sum",
        "primitives/async_errors.py",
        [
            (
                "works = [dist.all_reduce(x, async_op=True) for x in tensors]",
                "works = [dist.all_reduce(x, dist.ReduceOp.MAX, async_op=True) for x in tensors]",
            )
        ],
        "tensor 0 of 1: [2.0, 2.0, 2.0, 2.0], expected 3.0",
        args=("--fail-after", "1"),
    ),
    Mutation(  # a timeout typed in instead of the one asked for: the failure comes too soon
        "async_errors-timeout-typed-in",
        "primitives/async_errors.py",
        [("timedelta(seconds=args.fail_after)", "timedelta(seconds=1)")],
        "before --fail-after 3 s",
        args=("--fail-after", "3", "--in-flight", "1"),
    ),
    # flight_recorder and rpc_pipeline (issue 31)
    Mutation(  # the analysis singles out the ranks that agree instead of the one outvoted
        "flight_recorder-majority-inverted",
        "primitives/flight_recorder.py",
        [("votes.count(repr(call)) == 1", "votes.count(repr(call)) > 1")],
        "order: the record shows",
        nproc=3,
        args=("--fault", "order"),
        timeout=240,
    ),
    Mutation(  # the fault made on another rank than the one the lesson names
        "flight_recorder-fault-on-another-rank",
        "primitives/flight_recorder.py",
        [
            (
                "mine = fault if ctx.rank == culprit else None",
                "mine = fault if ctx.rank == 0 else None",
            )
        ],
        "order: the record shows",
        nproc=3,
        args=("--fault", "order"),
        timeout=240,
    ),
    Mutation(  # --culprit ignored: the last rank goes wrong, and main's culprit agrees with it
        "flight_recorder-culprit-ignored",
        "primitives/flight_recorder.py",
        [
            (
                "culprit = ctx.world_size - 1 if args.culprit is None else args.culprit",
                "culprit = ctx.world_size - 1",
            )
        ],
        "order: the record shows",
        nproc=3,
        args=("--fault", "order", "--culprit", "0"),
        timeout=240,
    ),
    Mutation(  # both stages on worker 1 where the lesson puts stage 2 on the last worker: the
        # training is the same wherever the stages live, so only the owners can show it
        "rpc_pipeline-stage-2-on-another-worker",
        "primitives/rpc_pipeline.py",
        [('rpc.remote(f"worker{ctx.world_size - 1}", Stage', 'rpc.remote("worker1", Stage')],
        "the stages live on ['worker1', 'worker1'], not on ['worker1', 'worker2']",
        nproc=3,
        timeout=240,
    ),
    Mutation(  # no distributed backward: the optimizer steps with no gradients
        "rpc_pipeline-no-backward",
        "primitives/rpc_pipeline.py",
        [("                dist_autograd.backward(context_id, [loss])\n", "")],
        "RPC training differs from one process",
        timeout=240,
    ),
]


# ---------------------------------------------------------------------------------- ddp_basics/
# ddp_checkpoint writes its checkpoint beside the mutated copy (in pytest's tmp_path), not in --out
CHECKPOINT_IN_COPY = (
    'path = os.path.join(args.out, "ddp_checkpoint.pt")',
    'path = os.path.join(os.path.dirname(__file__), "ddp_checkpoint.pt")',
)
DDP_BASICS = [
    Mutation(
        "ddp_minimal-forward-bypasses-ddp",
        "ddp_basics/ddp_minimal.py",
        [("F.cross_entropy(model(xb), yb)", "F.cross_entropy(model.module(xb), yb)")],
        "ranks disagree (params",
        args=("--epochs", "1"),
    ),
    Mutation(
        "ddp_minimal-no-set-epoch",
        "ddp_basics/ddp_minimal.py",
        [("        sampler.set_epoch(epoch)  # a new shuffle each epoch\n", "")],
        "DDP training differs from single-process training",
        args=("--epochs", "2"),
    ),
    Mutation(
        "ddp_minimal-evaluation-sums-not-all-reduced",
        "ddp_basics/ddp_minimal.py",
        [("dist.all_reduce(sums)  # every rank", "(sums)  # every rank")],
        "all_reduced metric",
        args=("--epochs", "1"),
    ),
    Mutation(
        "manual_data_parallel-gradients-not-averaged",
        "ddp_basics/manual_data_parallel.py",
        [
            (
                "dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)\n"
                "                    p.grad /= ctx.world_size",
                "pass",
            )
        ],
        "ranks hold different params",
        args=("--epochs", "1"),
        quick=True,
    ),
    Mutation(
        "manual_data_parallel-sum-not-divided",
        "ddp_basics/manual_data_parallel.py",
        [("p.grad /= ctx.world_size", "pass")],
        "params differ from single-process training",
        args=("--epochs", "1"),
    ),
    Mutation(
        "manual_data_parallel-no-broadcast",
        "ddp_basics/manual_data_parallel.py",
        [("dist.broadcast(p.data, src=0)", "pass")],
        "ranks hold different params",
        args=("--epochs", "1"),
    ),
    Mutation(
        "ddp_checkpoint-optimizer-not-restored",
        "ddp_basics/ddp_checkpoint.py",
        [CHECKPOINT_IN_COPY, ('opt.load_state_dict(ckpt["optimizer"])', "pass")],
        "the resumed run differs from the uninterrupted run",
    ),
    Mutation(
        "ddp_checkpoint-scheduler-not-restored",
        "ddp_basics/ddp_checkpoint.py",
        [CHECKPOINT_IN_COPY, ('sched.load_state_dict(ckpt["scheduler"])', "pass")],
        "the resumed run differs from the uninterrupted run",
    ),
    Mutation(
        "ddp_checkpoint-rng-not-restored",
        "ddp_basics/ddp_checkpoint.py",
        [
            CHECKPOINT_IN_COPY,
            ('torch.set_rng_state(ckpt["rng"]["cpu"][ctx.rank].cpu().clone())', "pass"),
        ],
        "the resumed run differs from the uninterrupted run",
    ),
    Mutation(
        "ddp_grad_accumulation-loss-not-divided",
        "ddp_basics/ddp_grad_accumulation.py",
        # 20 spaces: the line under no_sync (the one of the last micro-batch has 16)
        [
            (
                " " * 20 + "loss = F.cross_entropy(model(xb), yb) / args.accum",
                " " * 20 + "loss = F.cross_entropy(model(xb), yb)",
            )
        ],
        "accumulated DDP training differs from the large batch",
    ),
    Mutation(
        "ddp_grad_accumulation-no-sync-left-out",
        "ddp_basics/ddp_grad_accumulation.py",
        [("with model.no_sync():", "if True:")],
        "fewer all_reduces with no_sync",
    ),
    Mutation(
        "ddp_mixed_precision-clip-before-unscale",
        "ddp_basics/ddp_mixed_precision.py",
        [("scaler.unscale_(opt)  # true gradients", "pass  # true gradients")],
        "fp16 autocast + GradScaler ends",
    ),
    Mutation(
        "distributed_eval-padding-not-masked",
        "ddp_basics/distributed_eval.py",
        [("real = positions < len(dataset)", "real = positions >= 0")],
        "differ from one process's",
        nproc=3,
        quick=True,
    ),
    Mutation(
        "ddp_overlap-hook-sums-not-averages",
        "ddp_basics/ddp_overlap.py",
        [("buf.div_(ctx.world_size)", "pass")],
        "parameters differ from one process's beyond 1e-05",
    ),
    Mutation(
        "ddp_overlap-bucket-view-left-out",
        "ddp_basics/ddp_overlap.py",
        [("gradient_as_bucket_view=as_view,", "gradient_as_bucket_view=False,")],
        "bucket_cap_mb=0.25, gradient_as_bucket_view=True: gradients inside the bucket buffers: []",
    ),
    Mutation(
        "syncbatchnorm-by-hand-not-all-reduced",
        "ddp_basics/syncbatchnorm.py",
        [("dist.all_reduce(stats)  # SUM over ranks", "(stats)  # SUM over ranks")],
        "differ from those of the whole batch",
    ),
    Mutation(
        "benchmark_ddp-buckets-summed-not-averaged",
        "ddp_basics/benchmark_ddp.py",
        [("flat /= dist.get_world_size()", "pass")],
        "(b) flat buckets by hand: parameters differ from one-process training",
        args=("--steps", "3", "--warmup", "1"),
    ),
    # ddp_comm_hooks: a hook that does not compress, and PowerSGD left at its default start
    Mutation(  # the plain hook registered under the fp16 name: full fp32 bytes
        "ddp_comm_hooks-fp16-hook-not-registered",
        "ddp_basics/ddp_comm_hooks.py",
        [
            (
                '"fp16_compress_hook": (None, default_hooks.fp16_compress_hook)',
                '"fp16_compress_hook": (None, default_hooks.allreduce_hook)',
            )
        ],
        "fp16_compress_hook sent 18448 bytes, expected half of 18448",
        args=("--steps", "10", "--target", "0"),
    ),
    Mutation(  # start_powerSGD_iter left at its default, 1000: the whole run is plain all_reduce
        "ddp_comm_hooks-powersgd-never-starts",
        "ddp_basics/ddp_comm_hooks.py",
        [("start_powerSGD_iter=2", "start_powerSGD_iter=1000")],
        "PowerSGD sent 18448 bytes, not fewer than 18448",
        args=("--steps", "10", "--target", "0"),
    ),
]


# ---------------------------------------------------------------------------------- fsdp_basics/
FSDP_BASICS = [
    # fsdp_minimal: the optimizer made before fully_shard holds the replaced parameters
    Mutation(
        "fsdp_minimal-optimizer-before-fully-shard",
        "fsdp_basics/fsdp_minimal.py",
        [
            (
                "    opt = torch.optim.Adam(model.parameters(), lr=args.lr)  # after fully_shard",
                "    pass  # ",
            ),
            (
                "    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))\n",
                "    opt = torch.optim.Adam(model.parameters(), lr=args.lr)\n"
                "    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))\n",
            ),
        ],
        "FSDP and one process differ by",
        quick=True,
    ),
    # fsdp_offload: reset_parameters() on the shards (every CPU rank draws rank 0's numbers)
    Mutation(
        "fsdp_offload-reset-parameters-on-shards",
        "fsdp_basics/fsdp_offload.py",
        [
            (
                "    init_shards_(model)\n    opt",
                "    [m.reset_parameters() for m in model.modules() if isinstance(m, nn.Linear)]\n"
                "    opt",
            )
        ],
        "offloaded training is",
    ),
    # fsdp_checkpoint: a crash inside the save of step 6, after dcp.save and before the publish
    # (was --crash-during-save; tests/test_fsdp_basics.py resumes from what it leaves)
    Mutation(
        "fsdp_checkpoint-crash-during-save",
        "fsdp_basics/fsdp_checkpoint.py",
        [
            (
                "    dist.barrier()  # every rank's files are complete before the directory is",
                "    if step == 6:\n"
                "        raise RuntimeError(f'simulated crash during save: {tmp.name} written, "
                "`latest` still names the previous one')\n"
                "    dist.barrier()  # every rank's files are complete before the directory is",
            ),
            ('default="runs/fsdp_checkpoint"', 'default=str(Path(__file__).with_name("ck"))'),
        ],
        "simulated crash during save: step_000006.tmp written",
    ),
    # fsdp_overlap (was --ignore-reshard, --no-grad-sync; the backward prefetches: issue 32)
    Mutation(
        "fsdp_overlap-reshard-ignored",
        "fsdp_basics/fsdp_overlap.py",
        [("reshard_after_forward=reshard)", "reshard_after_forward=False)")],
        "reshard_after_forward=True: 4 all_gathers, 4 reduce_scatters, 0 forward-prefetched, "
        "0 backward-prefetched; expected 7, 4, 0, 3",
    ),
    Mutation(
        "fsdp_overlap-no-gradient-sync",
        "fsdp_basics/fsdp_overlap.py",
        [
            (
                "    opt = torch.optim.Adam(model.parameters(), lr=args.lr)\n",
                "    model.set_requires_gradient_sync(False)\n"
                "    opt = torch.optim.Adam(model.parameters(), lr=args.lr)\n",
            )
        ],
        "parameters differ from one process's beyond 1e-4",
    ),
    Mutation(
        "fsdp_overlap-backward-prefetch-left-out",
        "fsdp_basics/fsdp_overlap.py",
        [("block.set_modules_to_backward_prefetch(", "print(")],
        "True, explicit prefetch of 2: prefetched ",
    ),
    Mutation(  # the backward list farthest block first: the same set, issued in the wrong order
        "fsdp_overlap-backward-prefetch-farthest-first",
        "fsdp_basics/fsdp_overlap.py",
        [("blocks[max(0, i - prefetch) : i][::-1]", "blocks[max(0, i - prefetch) : i]")],
        "True, explicit prefetch of 2: prefetched blocks.1 by blocks.0 (forward), blocks.2 by "
        "blocks.0 (forward), blocks.2 by root (backward), blocks.0 by blocks.2 (backward), "
        "blocks.1 by blocks.2 (backward); expected",
    ),
    # zero_stages (was --skip-all-gather, --keep-full-grads; a SUM for the AVG: issue 32)
    Mutation(
        "zero_stages-all-gather-left-out",
        "fsdp_basics/zero_stages.py",
        [("dist.all_gather_single(flat, shard.detach().clone())", "pass")],
        "ZeRO by hand differs from single-process training by",
    ),
    Mutation(
        "zero_stages-full-gradient-kept",
        "fsdp_basics/zero_stages.py",
        [("model.zero_grad(set_to_none=True)", "pass")],
        "ZeRO-2 holds",
    ),
    Mutation(
        "zero_stages-sum-not-average",
        "fsdp_basics/zero_stages.py",
        [
            (
                "reduce_scatter_single(mine_only, grads, op=dist.ReduceOp.AVG)",
                "reduce_scatter_single(mine_only, grads, op=dist.ReduceOp.SUM)",
            )
        ],
        "the averaged gradient slices differ from one process's gradient by",
    ),
    Mutation(  # Adam hides the N-times scale: only the check of the reduced gradient sees it
        "zero_by_hand-sum-not-average",
        "fsdp_basics/zero_by_hand.py",
        [
            (
                "dist.reduce_scatter_single(grad_shard, full_grad, op=dist.ReduceOp.AVG)",
                "dist.reduce_scatter_single(grad_shard, full_grad, op=dist.ReduceOp.SUM)",
            )
        ],
        "the reduced gradient shards differ from one process's by",
    ),
    Mutation(  # the forward's full layer never freed: every gathered layer stays alive
        "zero_by_hand-forward-gather-kept",
        "fsdp_basics/zero_by_hand.py",
        [
            (
                "full.untyped_storage().resize_(0)  # free the full layer now",
                "pass  # free the full layer now",
            )
        ],
        "a gathered layer outlived its use, or a rank holds more than 1/N of the state",
    ),
    Mutation(  # the shard a view of the whole flat layer: each rank keeps all of it
        "zero_by_hand-shard-a-view-not-a-copy",
        "fsdp_basics/zero_by_hand.py",
        [("flat.chunk(ctx.world_size)[ctx.rank].clone()", "flat.chunk(ctx.world_size)[ctx.rank]")],
        "a gathered layer outlived its use, or a rank holds more than 1/N of the state",
    ),
    # zero_redundancy_optimizer (was --leave-out-last; --skip-optimizer-load needs a checkpoint:
    # tests/test_zero_stages.py makes that mutation)
    Mutation(
        "zero_redundancy_optimizer-last-parameter-left-out",
        "fsdp_basics/zero_redundancy_optimizer.py",
        [
            (
                "ZeroRedundancyOptimizer(ddp.parameters(),",
                "ZeroRedundancyOptimizer(list(ddp.parameters())[:-1],",
            ),
            (
                'default="runs/zero_redundancy_optimizer.pt"',
                'default=os.path.join(os.path.dirname(__file__), "z.pt")',
            ),
        ],
        "the ranks' optimizer shards hold [7, 2070] tensors/elements, not [8, 2074]",
    ),
    # fsdp_memory_plan (was --no-shard, --count-params)
    Mutation(
        "fsdp_memory_plan-planned-without-fully-shard",
        "fsdp_basics/fsdp_memory_plan.py",
        [
            ("for block in planned.blocks:", "for block in []:"),
            ("fully_shard(planned, mesh=mesh)", "pass"),
            ("[p.to_local() for p in planned.parameters()]", "list(planned.parameters())"),
        ],
        "fake-group plan differs from the ceil-rows formula: N=8: plan",
        nproc=3,
        args=("--max-ranks", "16"),
    ),
    Mutation(
        "fsdp_memory_plan-weight-counted-as-activation",
        "fsdp_basics/fsdp_memory_plan.py",
        [("{p.untyped_storage().data_ptr() for p in block.parameters()}", "set()")],
        "!= 8 x tokens x 62 B",
        args=("--max-ranks", "8"),
    ),
    # hsdp (was --shard-mesh-only, --same-probe-batch; the transposed mesh: issue 32)
    Mutation(
        "hsdp-shard-mesh-only",
        "fsdp_basics/hsdp.py",
        [
            ("fully_shard(block, mesh=mesh)", 'fully_shard(block, mesh=mesh["shard"])'),
            ("fully_shard(model, mesh=mesh)", 'fully_shard(model, mesh=mesh["shard"])'),
        ],
        "RuntimeError: HSDP and one process differ by",
        nproc=4,
    ),
    Mutation(
        "hsdp-shard-mesh-only-collectives",  # the first check loosened: the next one sees it
        "fsdp_basics/hsdp.py",
        [
            ("fully_shard(block, mesh=mesh)", 'fully_shard(block, mesh=mesh["shard"])'),
            ("fully_shard(model, mesh=mesh)", 'fully_shard(model, mesh=mesh["shard"])'),
        ],
        "RuntimeError: expected 3 all_reduce (replicate) and 3 reduce_scatter_single (shard)",
        nproc=4,
        args=("--tol", "1"),
    ),
    Mutation(
        "hsdp-same-probe-batch",  # the replicas agree without their all_reduce: nothing shown
        "fsdp_basics/hsdp.py",
        [
            (
                "rank_batch(x, y, 0, args.batch, ctx)  # each rank its own rows",
                "(x[: args.batch // ctx.world_size], y[: args.batch // ctx.world_size])",
            )
        ],
        "RuntimeError: expected the 2-D mesh to hold more than the 1-D",
        nproc=4,
    ),
    Mutation(
        "hsdp-mesh-transposed",  # (N/R, R) for (R, N/R): at 2 ranks FSDP instead of replicas
        "fsdp_basics/hsdp.py",
        [("(R, ctx.world_size // R), mesh_dim_names", "(ctx.world_size // R, R), mesh_dim_names")],
        "expected 3 all_reduce (replicate) and 0 reduce_scatter_single (shard), nothing on "
        "another group; got 5 all_gather_single (replicate), 3 reduce_scatter_single (replicate)",
    ),
    Mutation(
        "hsdp-mesh-dim-names-swapped",  # trains as asked (FSDP reads dims by position)
        "fsdp_basics/hsdp.py",
        [
            (
                'ctx.world_size // R), mesh_dim_names=("replicate", "shard")',
                'ctx.world_size // R), mesh_dim_names=("shard", "replicate")',
            )
        ],
        "mesh, groups, placements, local rows built ((2, 2), ('shard', 'replicate')",
        nproc=4,
    ),
]


# --------------------------------------------------------------------------- transformer_basics/
TRANSFORMER_BASICS = [
    # ring_attention: the partial outputs averaged instead of merged by their log-sum-exp
    Mutation(
        "ring_attention-average-merge",
        "transformer_basics/ring_attention.py",
        [
            (
                "out[:, :, rows] = old_part + o_b * (lse_b - new).exp()[..., None]",
                "out[:, :, rows] = (out[:, :, rows] + o_b) / 2 if step else o_b",
            )
        ],
        "ring attention's output",
        nproc=3,
    ),
    # backward without the last hop: each rank keeps its neighbour's dK, dV
    Mutation(
        "ring_attention-no-home-hop",
        "transformer_basics/ring_attention.py",
        [
            (
                "if world > 1:  # pass K, V, dK, dV on;",
                "if step < world - 1:  # pass K, V, dK, dV on;",
            )
        ],
        "ring attention's dk, dv differ from full causal attention",
        nproc=3,
    ),
    # issue 32: a received block read before its wait() failed or passed as the timing fell; now it
    # fails every time (check_blocks_read_after_wait). Forward: each step waits for the previous
    # step's requests, after computing on the block they bring.
    Mutation(
        "ring_attention-forward-waits-a-step-late",
        "transformer_basics/ring_attention.py",
        [
            ("kv = torch.stack([k, v])", "kv, late = torch.stack([k, v]), []"),
            (
                "for req in reqs:\n                req.wait()  # nxt",
                "for req in late:\n                req.wait()  #",
            ),
            ("kv = nxt", "late, kv = reqs, nxt"),
        ],
        "ring attention reads a received block before its wait()",
        quick=True,
    ),
    # backward: every wait put off to the end, the blocks used as they come
    Mutation(
        "ring_attention-backward-waits-at-the-end",
        "transformer_basics/ring_attention.py",
        [
            ("dq = torch.zeros_like(q)", "dq, late = torch.zeros_like(q), []"),
            ("for req in reqs:\n                    req.wait()  # kvd", "late += reqs  #"),
            (
                "        return dq,",
                "        for req in late:\n            req.wait()\n        return dq,",
            ),
        ],
        # dk and dv change as timing falls, dq in every run seen: 14 warm runs, 28 rank messages, 4
        # of them "its dq change" alone; and the first rank to fail may stop the other unprinted
        "ring attention reads a received block before its wait(): with each receive buffer NaN "
        "until wait() returns, its dq",
    ),
    # ulysses: the output sent back without putting its destination first
    Mutation(
        "ulysses-no-transpose-back",
        "transformer_basics/ulysses.py",
        [(".permute(2, 0, 1, 3, 4).contiguous()", ".reshape(world, B, h, t, D)")],
        "Ulysses attention's output",
    ),
    # expert_parallel: no count exchange, the receive splits guessed (every rank routes to my
    # experts as I do): Gloo's transport refuses the mismatched sizes
    Mutation(
        "expert_parallel-no-count-exchange",
        "transformer_basics/expert_parallel.py",
        [
            (
                "dist.all_to_all_single(recv_counts, send_counts, group=group)",
                "recv_counts = send_counts.view(N, local)[dist.get_rank(group)].repeat(N)",
            )
        ],
        "Received data size doesn't match expected size",
    ),
    # dist.all_to_all_single for the tokens: no autograd, the experts' weights get no gradient
    Mutation(
        "expert_parallel-plain-all-to-all",
        "transformer_basics/expert_parallel.py",
        [
            (
                "import torch.distributed._functional_collectives as funcol",
                "import types\n\n\n"
                "def plain(tensor, out_splits, in_splits, group):\n"
                "    out = tensor.new_empty((sum(out_splits), *tensor.shape[1:]))\n"
                "    dist.all_to_all_single(out, tensor, out_splits, in_splits, group=group)\n"
                "    return out\n\n\n"
                "funcol = types.SimpleNamespace(all_to_all_single_autograd=plain)",
            )
        ],
        "W1 gradient 1.0e+00, W2 gradient 1.0e+00",
    ),
    # the returned rows combined in expert order, not put back in (token, choice) order
    Mutation(
        "expert_parallel-no-unsort",
        "transformer_basics/expert_parallel.py",
        [("per_choice = torch.zeros_like(back).index_copy(0, order, back)", "per_choice = back")],
        "differs from one process beyond 7.6e-05: output",
        quick=True,
    ),
    # P_e of detached probabilities: the aux loss keeps its value and loses its gradient
    Mutation(
        "expert_parallel-aux-detached",
        "transformer_basics/expert_parallel.py",
        [("(f * probs.mean(0))", "(f * probs.detach().mean(0))")],
        "differs from one process beyond 7.6e-05: input gradient",
    ),
    # train_cp: the position embedding given model.py's numbering 0..2c-1, not the chunks' positions
    Mutation(
        "train_cp-local-positions",
        "transformer_basics/train_cp.py",
        [("pos_ids = pos.to(ctx.device)", "pos_ids = torch.arange(len(pos), device=ctx.device)")],
        "context-parallel training differs from one process",
        timeout=240,
    ),
    # train_moe: the experts' gradients, summed over dp, divided by dp instead of N (ep times too
    # large), or summed over all ranks (other experts' gradients added in)
    Mutation(
        "train_moe-experts-divided-by-dp",
        "transformer_basics/train_moe.py",
        [("flat /= N  #", "flat /= N // ep if params is experts else N  #")],
        "differs from one process beyond --tol 2e-05",
        timeout=240,
    ),
    Mutation(
        "train_moe-experts-over-world",
        "transformer_basics/train_moe.py",
        [('(experts, mesh["dp"].get_group())', "(experts, dist.group.WORLD)")],
        "differs from one process beyond --tol 2e-05",
        timeout=240,
    ),
    # benchmark.py --no-grad-sync (ddp+), removed: a comm hook that sends nothing
    Mutation(
        "benchmark-ddp+-sends-no-gradients",
        "transformer_basics/benchmark.py",
        [
            (
                "**tuned)\n",
                "**tuned)\n"
                "        from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks\n"
                "\n"
                '        if mode == "ddp+":\n'
                "            model.register_comm_hook(None, debugging_hooks.noop_hook)\n",
            )
        ],
        "should train the same model, but their losses differ",
        args=tuple("--modes ddp ddp+ --steps 3 --warmup 1 --n-layer 1 --n-embd 48".split()),
    ),
    # benchmark.py --no-grad-sync (fsdp+), removed: no reduce-scatter of the gradients
    Mutation(
        "benchmark-fsdp+-no-reduce-scatter",
        "transformer_basics/benchmark.py",
        [
            (
                "block.set_modules_to_backward_prefetch(blocks[i - 1 : i] if i else [])\n",
                "block.set_modules_to_backward_prefetch(blocks[i - 1 : i] if i else [])\n"
                "            model.set_requires_gradient_sync(False)\n",
            )
        ],
        "should train the same model, but their losses differ",
        args=tuple("--modes ddp fsdp+ --steps 3 --warmup 1 --n-layer 1 --n-embd 48".split()),
    ),
    # composition.py --no-preserve-rng-state, removed: the recomputation draws other dropout masks
    Mutation(
        "composition-recompute-without-rng-state",
        "transformer_basics/composition.py",
        [
            (
                "checkpoint(self.block, x, use_reentrant=False)",
                "checkpoint(self.block, x, use_reentrant=False, preserve_rng_state=False)",
            )
        ],
        "ddp, checkpointed, eager: losses differ from one process's plain model",
        args=("--parallel", "ddp", "--no-compile", "--dropout", "0.1", "--batch-size", "2"),
    ),
    # train.py's DDP that never syncs: tests/test_transformer_basics.py (it needs its own --out)
    # train_2d.py: the data sharded by the tp index, so the ranks of one TP row read different
    # windows: step 0's gradients differ from the unsharded model's on the global batch
    Mutation(
        "train_2d-data-sharded-by-tp-rank",
        "transformer_basics/train_2d.py",
        [
            ('dp_rank = mesh["dp"].get_local_rank()', 'dp_rank = mesh["tp"].get_local_rank()'),
            ('out="runs/gpt_2d"', 'out=__file__ + ".runs"'),  # not into the checkout
        ],
        "first step: gradient of",
        nproc=4,
        args=tuple("--steps 3 --warmup 1 --batch-size 2 --n-layer 1".split()),
    ),
    # tensor_parallel.py: the final norm left out of the sequence-parallel plan: each rank's
    # ln_f gradient covers its own tokens only
    Mutation(
        "tensor_parallel-ln_f-not-sequence-parallel",
        "transformer_basics/tensor_parallel.py",
        [('"ln_f": SequenceParallel(),', "")],
        "gradient of ln_f.weight differs from the unsharded model's",
        args=("--sequence-parallel", "--steps", "1"),
    ),
    # parity.py's check of its own table (its --mistake runs are tests/test_parity.py's). Each row
    # compared with the plain GPT's one process, whatever its model: the dropout and MoE rows fail
    Mutation(
        "parity-compares-with-the-wrong-row",
        "transformer_basics/parity.py",
        [('ref = losses[f"one process, {kinds[name]}"]', 'ref = losses["one process, gpt"]')],
        "FAILED: 2 row(s) beyond their tolerance of one process: tp, ep",
        timeout=240,
    ),
    # a table that shows one row's losses in every row: only the control can tell
    Mutation(
        "parity-table-repeats-one-row",
        "transformer_basics/parity.py",
        [
            (
                "    for name, (what, got) in losses.items():\n",
                "    for name, (what, _) in losses.items():\n"
                '        got = losses["one process, gpt"][1]\n',
            )
        ],
        "FAILED: the control (control, f32 grads) is within its tolerance",
        timeout=240,
    ),
    # float32's eps in the tolerance: 2^29 times wider, it hides the float32 rounding of the control
    Mutation(
        "parity-tolerance-of-float32",
        "transformer_basics/parity.py",
        [("torch.finfo(torch.float64).eps * max(", "torch.finfo(torch.float32).eps * max(")],
        "FAILED: the control (control, f32 grads) is within its tolerance",
        timeout=240,
    ),
    # the global norm's squares not divided by their copies: replicas counted as shards
    Mutation(
        "parity-clip-counts-replicas-as-shards",
        "transformer_basics/parity.py",
        [("squares += grads[-1].pow(2).sum() / copies", "squares += grads[-1].pow(2).sum()")],
        "FAILED: 7 row(s) beyond their tolerance of one process: ddp, hsdp, tp, pp 1f1b, cp",
        file="layouts.py",
        timeout=240,
    ),
    # pipeline_parallel.py: the tied embedding's two copies (first and last stage) not summed
    Mutation(
        "pipeline-tied-gradients-not-summed",
        "transformer_basics/pipeline_parallel.py",
        [("dist.all_reduce(tied.weight.grad, group=tie_group)", "pass")],
        "differs from single-process training",
        args=("--steps", "1"),
        quick=True,
    ),
]


# -------------------------------------------------------------------------------------- launch/
LAUNCH = [
    Mutation(
        "legacy_launch-all_reduce-left-out",
        "launch/legacy_launch.py",
        [("dist.all_reduce(total)", "pass")],
        "all_reduce gave",
        quick=True,
    ),
    Mutation(  # each rank folds in only its own share of the batch: a partial sum
        "elastic-step-sum-not-all_reduced",
        "launch/elastic.py",
        [("dist.all_reduce(total)", "pass")],
        "differs from the serial computation",
        launcher="python",  # the warm launcher shares its store: elastic.py refuses it
    ),
    Mutation(
        "spawn_template-all_reduce-left-out",
        "launch/spawn_template.py",
        [("dist.all_reduce(total)", "pass")],
        ", expected 3",
        launcher="python",  # it starts its ranks itself (--nproc)
    ),
    Mutation(  # the rank that waits longest taken for the slow one: at 2 ranks it names the other
        "straggler-named-by-its-wait",
        "launch/straggler.py",
        [("excess = (compute - compute.median())", "excess = (wait - wait.median())")],
        "report 1 named [0], not rank 1",
        args=("--slow-rank", "1"),
    ),
    Mutation(  # compute timed to the end of the all_reduce: every rank's compute is the whole step
        "straggler-compute-includes-the-wait",
        "launch/straggler.py",
        [
            (
                "clock.steps.append((start, computed, clock.mark()))",
                "clock.steps.append((start, clock.mark(), clock.mark()))",
            )
        ],
        "report 1 named [], not rank 1",
        nproc=3,
        args=("--slow-rank", "1"),
    ),
    Mutation(  # the all_reduce waited for after the clock is read, as a GPU launch is: untimed
        "straggler-wait-not-timed",
        "launch/straggler.py",
        [
            (
                "dist.all_reduce(grads, op=dist.ReduceOp.AVG)",
                "work = dist.all_reduce(grads, op=dist.ReduceOp.AVG, async_op=True)",
            ),
            (
                "        torch.nn.utils.vector_to_parameters",
                "        work.wait()\n        torch.nn.utils.vector_to_parameters",
            ),
        ],
        "ended a step before the slowest rank's compute did",
        nproc=3,
        args=("--slow-rank", "1"),
    ),
    Mutation(  # the agreement by MIN: one rank signalled is outvoted and the job runs on
        "preemption-stop-agreed-by-min",
        "launch/preemption.py",
        [("op=dist.ReduceOp.MAX", "op=dist.ReduceOp.MIN")],
        "received a signal, yet the job ran on to step 40",
        args=(
            "--preempt-at",
            "5",
            "--save-every",
            "1000",
        ),  # nothing written: the check comes first
    ),
]


MUTATIONS = PRIMITIVES + DDP_BASICS + FSDP_BASICS + TRANSFORMER_BASICS + LAUNCH


@pytest.mark.quick
def test_mutation_ids_are_unique():
    ids = [m.id for m in MUTATIONS]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


@pytest.mark.quick
def test_every_mutation_still_applies():
    problems = []
    for m in MUTATIONS:
        text = (ROOT / m.lesson).with_name(m.file or (ROOT / m.lesson).name).read_text()
        problems += [
            f"{m.id}: {old!r} occurs {text.count(old)} times"
            for old, _ in m.changes
            if text.count(old) != 1
        ]
    assert not problems, "\n".join(problems)


def _param(m):
    marks = list(m.marks) + ([pytest.mark.quick] if m.quick else [])
    return pytest.param(m, id=m.id, marks=marks)


@pytest.mark.parametrize("m", [_param(m) for m in MUTATIONS])
def test_check_fails_when_the_lesson_is_wrong(m, tmp_path):
    copy = mutant(tmp_path, m.lesson, *m.changes, file=m.file)
    result = run_lesson(copy, *m.args, nproc=m.nproc, launcher=m.launcher, timeout=m.timeout)
    assert_fails(result, m.message)
