"""Seconds per run of the GPU tiers (tests/test_gpu.py), from what the GPU runs measured.

Both runs: one NVIDIA H200 (139.8 GiB), 16 CPU cores, the machine's own torch 2.11.0+cu130 (CUDA
13.0, NCCL 2.28.9; nothing could be installed), project commit d01dd3b, 2026-11-28, with the two
collectives that torch 2.13 renamed aliased at start-up (a sitecustomize setting
dist.all_gather_single and dist.reduce_scatter_single to all_gather_into_tensor and
reduce_scatter_tensor). Each run was started as test_gpu.run_case started it at d01dd3b: the nccl-1
runs under torchrun, the gloo-2 runs under the warm launcher.
- RUN_5, the second run (17:51-18:00 UTC): 64 of the node check's 76 runs, 5 at a time (5
  processes on the 16 cores), a 60 s limit each; none reached it. Its gloo-2 figures include the
  start of a warm server (each of the 5 processes started one at its first warm run): not used.
- RUN_8, the first run: `pytest --gpu` on 8 pytest-xdist workers (the limit then 3x a reasoned
  budget: 15 s for most), and `pytest --gpu-full -k gloo-2-` on 6 workers.
A run's figure is RUN_5's where it has one (the plan runs 5 at a time on 16 cores: that load), else
RUN_8's (8 or 6 at a time: an upper bound at 5).

What one run costs there, and why (measured there, one process alone, at the start of RUN_5):
`python3 -c "import torch"` 4.01 s wall; `import torch, torch._dynamo` 10.07 s; CUDA's context
and a first tensor 0.31 s more. A torchrun run at 1 rank imports torch twice (the agent, then the
rank) and, for a lesson that builds an optimizer, DDP or a mesh (all but NO_DYNAMO), torch._dynamo
once more in the rank: 8.0 to 14.1 s before its first line of work, of the 8.6 to 38.5 s that
RUN_5's runs took (median 15.7 s). The warm launcher pays neither: its server imports torch and
torch._dynamo once per pytest worker (WARM_SERVER_S) and forks each run's ranks from it; its runs
of the lessons on that GPU (RUN_8's gloo-2 rows, 2 ranks on Gloo with CUDA tensors) took 0.5-7 s.
"""

IMPORT_TORCH_S = 4.01  # `python3 -c "import torch"`, wall, alone on that machine
IMPORT_DYNAMO_S = 6.06  # `import torch, torch._dynamo` (10.07 s) less the line above
# A warm server's start (it imports torch, torch._dynamo and the rest of warm_launcher.PRELOAD),
# once per pytest worker: gloo-2-reduce_scatter took 11.3 s in RUN_5 with its process's server
# start and 1.2 s in RUN_8 without: 10.1 s, as the two imports above (10.07 s)
WARM_SERVER_S = 10.1
# Lessons that do not import torch._dynamo at 1 rank (every other lesson's run does): found by
# running each node-check run at 1 rank on Gloo and reading sys.modules at its exit (torch
# 2.13.0+cpu, 2026-11-28)
NO_DYNAMO = {
    *("hello_distributed", "init_methods", "broadcast", "broadcast_unknown_shape", "reduce"),
    *("all_reduce", "gather", "all_gather", "scatter", "reduce_scatter", "all_to_all", "barrier"),
    *("async_collectives", "collective_costs", "object_collectives", "stores"),
    *("distributed_softmax", "print_env", "legacy_launch", "syncbatchnorm", "ring_attention"),
}
# The least a derived budget gives a run: CUDA's context (0.31 s, measured) and NCCL's first
# communicator at one rank (reasoned: not measured alone)
MIN_RUN_S = 1.0
# At 2 to 8 GPUs (never run: the machine had one): a CUDA context per rank made at once and NCCL's
# first communicator across the GPUs (bootstrap, topology, NVLink connections), reasoned
MULTI_GPU_S = 2.0
FLOOR = 1.5  # a derived budget's least limit, times what the run took as measured


def _table(text):
    """'id seconds status [why]' lines -> {id: (seconds, status)}."""
    rows = (line.split(maxsplit=3) for line in text.strip().splitlines())
    return {row[0]: (float(row[1]), row[2]) for row in rows}


RUN_5 = _table("""
nccl-1-all_gather                 10.2 passed
nccl-1-all_reduce                 11.8 passed
nccl-1-all_to_all                 11.6 passed
nccl-1-async_collectives          11.9 passed
nccl-1-barrier                    11.7 passed
nccl-1-benchmark                  18.3 passed
nccl-1-benchmark_ddp              18.3 passed
nccl-1-broadcast                  11.5 passed
nccl-1-broadcast_unknown_shape    10.8 passed
nccl-1-collective_costs            9.1 passed
nccl-1-composition                38.5 failed 2.11's jit deprecation, its check OK; cold inductor
nccl-1-dataparallel_vs_ddp        13.9 passed
nccl-1-ddp_checkpoint             21.9 passed
nccl-1-ddp_comm_hooks             17.7 passed
nccl-1-ddp_grad_accumulation      23.4 passed
nccl-1-ddp_minimal                23.3 passed
nccl-1-ddp_mixed_precision        18.5 passed
nccl-1-ddp_overlap                14.8 passed
nccl-1-ddp_unused_parameters      18.5 passed
nccl-1-device_mesh                15.7 passed
nccl-1-distributed_eval           17.1 passed
nccl-1-distributed_softmax         9.5 passed
nccl-1-dtensor_basics             16.9 passed
nccl-1-dtensor_loss_parallel      16.4 passed
nccl-1-dtensor_redistribute       16.5 passed
nccl-1-elastic                    18.0 passed
nccl-1-expert_parallel            14.2 passed
nccl-1-fsdp_checkpoint            15.1 passed
nccl-1-fsdp_memory                16.4 passed
nccl-1-fsdp_memory_plan           27.5 passed
nccl-1-fsdp_minimal               19.1 passed
nccl-1-fsdp_mixed_precision       16.2 passed
nccl-1-fsdp_offload               15.1 passed
nccl-1-fsdp_overlap               15.1 passed
nccl-1-gather                      9.5 passed
nccl-1-grad_through_collectives   16.9 passed
nccl-1-hello_distributed          10.5 passed
nccl-1-hsdp                       15.4 passed
nccl-1-init_methods               11.3 passed
nccl-1-legacy_launch               9.0 passed
nccl-1-local_sgd                  17.7 passed
nccl-1-manual_data_parallel       17.7 passed
nccl-1-object_collectives         10.4 passed
nccl-1-pipeline_parallel          18.3 passed
nccl-1-pipeline_schedules         19.6 passed
nccl-1-print_env                   9.4 passed
nccl-1-reduce                      8.7 passed
nccl-1-reduce_scatter             10.0 passed
nccl-1-ring_attention             12.7 passed
nccl-1-scatter                     9.2 passed
nccl-1-stores                     11.7 passed
nccl-1-syncbatchnorm               8.6 passed
nccl-1-tensor_parallel            17.7 passed
nccl-1-train                      17.4 passed
nccl-1-train_2d                   19.0 passed
nccl-1-train_cp                   12.9 passed
nccl-1-train_local_sgd            18.7 failed 2.11's torch.jit deprecations; its check said OK
nccl-1-train_moe                  17.7 passed
nccl-1-ulysses                    12.5 passed
other-rpc_pipeline                20.4 passed
python-1-ddp_minimal              18.6 passed
""")

# RUN_8: the node check's runs that RUN_5 did not reach, and every Gloo-with-CUDA run at 2 ranks.
# "first": passed, most likely a worker's first run (6 workers, the 6 gloo-2 runs of 9.9 s and
# more), a warm server's start included. "failed" rows stopped early (their cause after it).
RUN_8 = _table("""
nccl-1-zero_by_hand               15.1 timeout at its 15 s limit, printed its [setup] line
nccl-1-zero_redundancy_optimizer  15.1 timeout at its 15 s limit, printed its [setup] line
nccl-1-zero_stages                15.1 timeout at its 15 s limit, printed its [setup] line
other-debug_server                21.1 passed
other-flight_recorder             34.1 failed torchfrtrace on 2.11, after the three hangs
other-generate                    38.2 passed
other-spawn_template              12.8 passed
other-two_jobs                    20.9 passed
python-1-all_reduce               11.6 passed
python-1-elastic                  13.8 passed
gloo-2-all_gather                  1.8 passed
gloo-2-all_reduce                  1.6 passed
gloo-2-all_to_all                  2.1 failed 2.11's Gloo has no all_to_all
gloo-2-async_collectives           1.3 passed
gloo-2-async_errors                5.5 passed
gloo-2-async_point_to_point       11.4 first
gloo-2-backend_matrix              6.2 passed
gloo-2-barrier                     1.0 passed
gloo-2-benchmark                  17.1 first
gloo-2-benchmark_collectives      11.2 first
gloo-2-benchmark_ddp               2.3 passed
gloo-2-broadcast                   0.9 passed
gloo-2-broadcast_unknown_shape     1.9 passed
gloo-2-collective_costs            1.7 passed
gloo-2-dataparallel_vs_ddp         1.8 passed
gloo-2-ddp_checkpoint              3.0 passed
gloo-2-ddp_comm_hooks             12.0 first
gloo-2-ddp_grad_accumulation       3.4 passed
gloo-2-ddp_minimal                 2.9 passed
gloo-2-ddp_mixed_precision         4.8 passed
gloo-2-ddp_overlap                 2.2 passed
gloo-2-ddp_uneven_inputs           4.8 passed
gloo-2-ddp_unused_parameters       1.7 passed
gloo-2-deadlock                    3.8 passed
gloo-2-debug_hangs                 7.2 passed
gloo-2-debug_server                7.5 timeout at its 7.5 s limit
gloo-2-device_mesh                 0.5 failed SIGSEGV (the Gloo-with-CUDA crash)
gloo-2-distributed_eval            2.9 passed
gloo-2-distributed_softmax         1.1 passed
gloo-2-dtensor_basics              1.0 failed SIGSEGV
gloo-2-dtensor_loss_parallel       1.4 failed SIGSEGV
gloo-2-dtensor_redistribute        1.0 failed SIGSEGV
gloo-2-expert_parallel             2.0 passed
gloo-2-fsdp_checkpoint             2.2 failed SIGSEGV
gloo-2-fsdp_memory                 2.8 passed
gloo-2-fsdp_memory_plan           13.2 passed
gloo-2-fsdp_minimal                2.2 failed SIGSEGV
gloo-2-fsdp_mixed_precision        3.3 passed
gloo-2-fsdp_offload                3.0 passed
gloo-2-fsdp_overlap                2.8 failed SIGSEGV
gloo-2-gather                      1.7 passed
gloo-2-gil_threads_vs_processes    1.1 passed
gloo-2-grad_through_collectives    1.3 failed SIGSEGV
gloo-2-hsdp                        2.7 failed SIGSEGV
gloo-2-init_methods                9.9 first
gloo-2-legacy_launch               1.1 passed
gloo-2-local_sgd                   3.4 passed
gloo-2-manual_data_parallel        3.2 passed
gloo-2-object_collectives          1.9 passed
gloo-2-pipeline_parallel           3.9 passed
gloo-2-pipeline_schedules          3.4 passed
gloo-2-point_to_point              3.4 passed
gloo-2-print_env                   0.6 passed
gloo-2-process_groups              1.4 passed
gloo-2-reduce                      1.6 passed
gloo-2-reduce_scatter              1.2 passed
gloo-2-ring_all_reduce             3.6 passed
gloo-2-ring_all_reduce_pipelined   3.5 passed
gloo-2-ring_attention              3.7 passed
gloo-2-ring_exchange               3.4 passed
gloo-2-scatter                     1.5 passed
gloo-2-stores                      2.5 passed
gloo-2-syncbatchnorm               1.8 passed
gloo-2-tensor_parallel             2.4 failed SIGSEGV
gloo-2-train                      11.7 first
gloo-2-train_2d                    1.9 failed SIGSEGV
gloo-2-train_cp                    3.5 passed
gloo-2-train_local_sgd             5.6 failed 2.11's torch.jit deprecations, after its OK line
gloo-2-train_moe                   3.3 passed
gloo-2-ulysses                     1.6 passed
gloo-2-weight_sync                 1.2 passed
gloo-2-zero_by_hand                3.1 passed
gloo-2-zero_redundancy_optimizer   2.9 passed
gloo-2-zero_stages                 2.9 passed
""")

# Runs that were never measured to their end, each with the reason for its figure: a run that
# reached its limit or stopped early gets a budget above the time it was given.
UNMEASURED = {
    # RUN_8 ended them at 15.1 s; RUN_5 did not reach them. Their fsdp_basics siblings there:
    # 15.1-19.1 s (fsdp_minimal 19.1 s)
    "nccl-1-zero_by_hand": 19.1,
    "nccl-1-zero_redundancy_optimizer": 19.1,
    "nccl-1-zero_stages": 19.1,
    # flight_recorder failed on 2.11 in torchfrtrace, after its three hangs (34.1 s): the
    # analysis that 2.13 completes comes on top (reasoned)
    "other-flight_recorder": 40.0,
    # tests/gloo_cuda_crash.py's 4 stages, each a warm run of 2 ranks on Gloo with CUDA tensors:
    # RUN_8's gloo-2 runs that crashed took 0.5-1.4 s, its plain collectives 0.9-1.9 s: 3 s each,
    # so that each stage's limit (a quarter of 3 x 12 s) holds the script's 5 s watchdog
    "other-gloo_cuda_crash": 12.0,
    # never run on a GPU: 8.9 s on a 2-core CPU at load 6 (torch 2.13.0+cpu, 2026-11-28), of which
    # two torch imports (about 1 s each there, 4.0 s each on the H200): 15 s (reasoned)
    "other-fault_tolerant_ddp": 15.0,
    # stopped early on 2.11 (the Gloo-with-CUDA crash; no all_to_all): above the 2.2-4.8 s that the
    # DDP and FSDP lessons' completed runs took in that mode
    **{
        f"gloo-2-{name}": 5.0
        for name in (
            *("device_mesh", "dtensor_basics", "dtensor_loss_parallel", "dtensor_redistribute"),
            *("fsdp_checkpoint", "fsdp_minimal", "fsdp_overlap", "grad_through_collectives"),
            *("hsdp", "tensor_parallel", "train_2d", "all_to_all"),
        )
    },
    # reached its 7.5 s limit; its node-check run (other-debug_server, longer hang) took 21.1 s
    "gloo-2-debug_server": 22.0,
    # no run (the --gpu-full row under elastic torchrun): as nccl-1-elastic (18.0 s)
    "gloo-2-elastic": 18.0,
    # parity.py: never run on a GPU (reasoned): 12 trainings of 4 steps of a float64 GPT in turn,
    # most of it Python (DTensor's dispatch, FSDP2's hooks, the pipeline schedule), as in
    # train_2d's, tensor_parallel's and pipeline_parallel's runs (17.7-19.0 s under torchrun, of
    # which 14.1 s imports): about 15 s of work, + 14.1 s torchrun would import
    "nccl-1-parity": 30.0,
    # its refusal of Gloo with CUDA tensors, up front: as the other p2p lessons' refusals
    "gloo-2-parity": 5.0,
    # no report in RUN_8: as nccl-1-composition's figure less torchrun's imports (38.5 - 14.1 s;
    # inductor's compilation, cold cache)
    "gloo-2-composition": 24.4,
    # issue 53's lessons, never run on a GPU (reasoned from their neighbours'): preemption trains a
    # small model with a checkpoint, as ddp_checkpoint (21.9 s under torchrun in RUN_5);
    # record_errors prints and exits, as print_env (9.4 s); straggler's 2 ranks on Gloo with CUDA
    # tensors time 12 steps, as the gloo-2 runs of the DDP lessons (2.2-4.8 s)
    "nccl-1-preemption": 22.0,
    "nccl-1-record_errors": 10.0,
    "gloo-2-preemption": 5.0,
    "gloo-2-record_errors": 3.0,
    "gloo-2-straggler": 5.0,
}


def measured_as(run_id):
    """The launcher a run of this id had when it was measured (test_gpu at d01dd3b)."""
    kind, name = run_id.split("-", 1)[0], run_id.split("-", 2)[-1]
    if kind == "nccl":
        return "elastic" if name == "elastic" else "torchrun"
    return {"gloo": "warm", "python": "python"}.get(kind)  # other-*: unchanged since


def start_s(launcher, name):
    """What a launch costs before the lesson's first line of work, beyond a warm run: torchrun
    imports torch in its agent and in the rank, and torch._dynamo in the rank; `python lesson.py
    --nproc N` in the parent and in its forkserver (the rank is forked: torch._dynamo once)."""
    if launcher not in ("torchrun", "elastic", "python"):
        return 0.0
    return 2 * IMPORT_TORCH_S + (0.0 if name in NO_DYNAMO else IMPORT_DYNAMO_S)


def warm_run_s(name):
    """What the lesson's warm run took on that GPU (2 ranks, Gloo with CUDA tensors, RUN_8) if it
    passed, less a warm server's start where it most likely included one; else None."""
    seconds, status = RUN_8.get(f"gloo-2-{name}", (0.0, "failed"))
    if status == "first":
        return max(MIN_RUN_S, seconds - WARM_SERVER_S)
    return seconds if status == "passed" else None


def figure(run_id):
    """(seconds, source, the launcher it ran with) of a run's own row, or None."""
    if run_id in UNMEASURED:
        return UNMEASURED[run_id], "unmeasured", measured_as(run_id)
    seconds, status = RUN_5.get(run_id) or RUN_8.get(run_id) or (None, None)
    if status == "first":  # a warm server's start taken out
        return max(MIN_RUN_S, seconds - WARM_SERVER_S), "derived", "warm"
    return None if seconds is None else (seconds, "measured", measured_as(run_id))


def budget(run_id, launcher, gpus):
    """(seconds, source, floor) for a run that starts with `launcher` on `gpus` GPUs. source:
    "measured" (as it runs now), "derived" (measured under another launcher, less or plus what
    the launchers' start-ups cost, measured; never less than the lesson's own warm run on that
    GPU) or "unmeasured" (UNMEASURED, MULTI_GPU_S). floor: the least time limit it gets (where
    the launcher now pays less: FLOOR x what it took as measured, so that it passes under the
    launcher it was measured with too, WARM_LAUNCHER=0). run_id: "nccl-N-lesson",
    "gloo-2-lesson", "python-N-lesson" or "other-name"; a run at N GPUs takes its figure at one
    GPU (or, for a lesson of 2 ranks or more, its warm run's on Gloo with CUDA tensors)."""
    kind, _, rest = run_id.partition("-")
    name = rest if kind == "other" else rest.split("-", 1)[1]
    twins = [run_id] if kind in ("other", "gloo") else [f"{kind}-1-{name}", f"nccl-1-{name}"]
    found = [f for f in map(figure, [*twins, f"gloo-2-{name}"]) if f]
    if not found:
        raise KeyError(f"{run_id}: no figure in tests/gpu_budgets.py (RUN_5, RUN_8, UNMEASURED)")
    (seconds, source, then), floor = found[0], 0.0
    if then and then != launcher:
        if start_s(launcher, name) < start_s(then, name):
            floor = FLOOR * seconds
        seconds = seconds - start_s(then, name) + start_s(launcher, name)
        least = warm_run_s(name) if launcher == "warm" else None
        seconds = max(MIN_RUN_S, seconds, least or 0.0)
        source = "derived" if source == "measured" else source
    if gpus > 1:
        seconds, source = seconds + MULTI_GPU_S, "unmeasured"
    return round(seconds, 1), source, floor
