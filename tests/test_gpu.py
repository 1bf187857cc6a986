"""The GPU mode of the suite: `pytest --gpu` on a machine with CUDA GPUs.

Every lesson runs under torchrun with NCCL (`--backend nccl`, one rank per GPU) at each world
size from 1 up to the number of GPUs that the lesson accepts, and with Gloo on CUDA tensors
(`--backend gloo --device cuda`) at 2 ranks, which may share one GPU: lessons that support it
must print OK, lessons whose calls Gloo cannot do on CUDA tensors (send/recv) must refuse with
one line. Without `--gpu`, or on a machine without a GPU, every test here skips with one reason;
the CPU suite is the same either way. On a GPU node it doubles as a check that the node works:

    pytest --gpu tests/test_gpu.py            # only the GPU mode
    pytest --gpu tests/test_gpu.py -k nccl    # NCCL only
"""

import os

import pytest
import torch

from harness import assert_fails, assert_ok, run_lesson

TIMEOUT = 300
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
MAX_WORLD = 8  # the sizes the lessons promise: 1, 2, 4 and 8 GPUs (and what lies between)

# lesson -> min_ranks: smallest NCCL world; divides: the world size must divide this (a batch or a
# head count; the defaults are chosen so that 1, 2, 4 and 8 do); gloo_cuda: runs on Gloo with CUDA
# tensors (False: it must refuse with one line; None: it has no --device flag); args: a short run.
ANY, P2P = dict(min_ranks=1, gloo_cuda=True), dict(min_ranks=2, gloo_cuda=False)
BATCH48 = dict(min_ranks=1, gloo_cuda=True, divides=48)
LESSONS = {
    "primitives/hello_distributed.py": dict(
        min_ranks=1, gloo_cuda=None
    ),  # no --device flag: NCCL or CPU
    "primitives/init_methods.py": ANY,
    "primitives/point_to_point.py": P2P,
    "primitives/deadlock.py": P2P,
    "primitives/async_point_to_point.py": P2P,
    "primitives/ring_exchange.py": P2P,
    "primitives/broadcast.py": ANY,
    "primitives/broadcast_unknown_shape.py": ANY,
    "primitives/reduce.py": ANY,
    "primitives/all_reduce.py": ANY,
    "primitives/gather.py": ANY,
    "primitives/all_gather.py": ANY,
    "primitives/scatter.py": ANY,
    "primitives/reduce_scatter.py": ANY,
    "primitives/all_to_all.py": ANY,
    "primitives/barrier.py": ANY,
    "primitives/async_collectives.py": ANY,
    "primitives/collective_costs.py": ANY,
    "primitives/object_collectives.py": ANY,
    "primitives/process_groups.py": dict(min_ranks=2, gloo_cuda=True),
    "primitives/device_mesh.py": ANY,
    "primitives/stores.py": ANY,
    "primitives/distributed_softmax.py": ANY,
    "primitives/grad_through_collectives.py": ANY,
    "primitives/ring_all_reduce.py": P2P,
    "primitives/weight_sync.py": dict(min_ranks=2, gloo_cuda=True),
    "primitives/backend_matrix.py": dict(min_ranks=2, gloo_cuda=True),
    "primitives/benchmark_collectives.py": dict(
        min_ranks=2, gloo_cuda=False, args=["--max-bytes", "64M"]
    ),
    "primitives/debug_hangs.py": dict(min_ranks=2, gloo_cuda=True),
    "primitives/gil_threads_vs_processes.py": dict(
        min_ranks=2, gloo_cuda=True, args=["--work", "200000"]
    ),
    "primitives/dtensor_basics.py": ANY,
    "primitives/dtensor_redistribute.py": ANY,
    "primitives/dtensor_loss_parallel.py": ANY,
    "primitives/ring_all_reduce_pipelined.py": P2P,
    "launch/print_env.py": ANY,
    "launch/legacy_launch.py": ANY,
    "launch/elastic.py": ANY,
    "ddp_basics/manual_data_parallel.py": dict(min_ranks=1, gloo_cuda=True, divides=96),
    "ddp_basics/ddp_minimal.py": ANY,
    "ddp_basics/ddp_checkpoint.py": ANY,
    "ddp_basics/ddp_grad_accumulation.py": dict(
        min_ranks=1, gloo_cuda=True, divides=1536
    ),  # whole micro-batches
    "ddp_basics/ddp_mixed_precision.py": ANY,
    "ddp_basics/ddp_comm_hooks.py": ANY,
    "ddp_basics/ddp_uneven_inputs.py": dict(min_ranks=2, gloo_cuda=True),
    "ddp_basics/ddp_unused_parameters.py": dict(min_ranks=1, gloo_cuda=True, divides=48),
    "ddp_basics/syncbatchnorm.py": ANY,
    "ddp_basics/dataparallel_vs_ddp.py": dict(min_ranks=1, gloo_cuda=True, divides=96),
    "ddp_basics/benchmark_ddp.py": dict(min_ranks=1, gloo_cuda=True, divides=192),
    # any N: 100 samples pad at 3, 6, 7 and 8 GPUs, which it checks
    "ddp_basics/distributed_eval.py": ANY,
    "ddp_basics/ddp_overlap.py": ANY,  # any N: each rank trains on its own slice of generated data
    # N must divide --batch (48) since it reduce_scatters the batch
    "fsdp_basics/zero_by_hand.py": BATCH48,
    "fsdp_basics/fsdp_minimal.py": BATCH48,
    "fsdp_basics/fsdp_mixed_precision.py": BATCH48,
    "fsdp_basics/fsdp_memory.py": ANY,
    "fsdp_basics/fsdp_checkpoint.py": BATCH48,
    "fsdp_basics/fsdp_offload.py": BATCH48,
    "fsdp_basics/zero_stages.py": BATCH48,
    "fsdp_basics/zero_redundancy_optimizer.py": BATCH48,  # saves runs/zero_redundancy_optimizer.pt
    "fsdp_basics/fsdp_memory_plan.py": ANY,  # any N: the plan is made for the size it runs at
    "fsdp_basics/hsdp.py": BATCH48,  # and --replicas (default 2 at 4+ even ranks, else 1) divides N
    "fsdp_basics/fsdp_overlap.py": BATCH48,
    "transformer_basics/train.py": dict(min_ranks=1, gloo_cuda=True, args=["--steps", "60"]),
    "transformer_basics/train_2d.py": dict(min_ranks=1, gloo_cuda=True, args=["--steps", "30"]),
    "transformer_basics/tensor_parallel.py": dict(min_ranks=1, gloo_cuda=True, divides=24),
    "transformer_basics/pipeline_parallel.py": dict(min_ranks=1, gloo_cuda=False),
    "transformer_basics/benchmark.py": dict(
        min_ranks=1, gloo_cuda=True, divides=24, args=["--steps", "6", "--warmup", "2"]
    ),
    "transformer_basics/ring_attention.py": dict(
        min_ranks=1, gloo_cuda=False, divides=24
    ),  # --seq 48 in 2N chunks
    "transformer_basics/ulysses.py": dict(
        min_ranks=1, gloo_cuda=True, divides=8
    ),  # --heads 8 (and --seq 48)
    "transformer_basics/expert_parallel.py": dict(min_ranks=1, gloo_cuda=True, divides=8),
    # any N: --ep defaults to 2 on an even world size, else 1
    "transformer_basics/train_moe.py": ANY,
    "transformer_basics/train_cp.py": dict(
        min_ranks=1, gloo_cuda=False, divides=24
    ),  # 2cp divides --block-size 96
    "transformer_basics/composition.py": dict(
        min_ranks=1, gloo_cuda=True
    ),  # inductor on CUDA (not run here: no GPU)
}
# Not here, with the reason: primitives/weight_sync_two_jobs.py runs as two jobs
# (test_weight_sync_two_jobs below); launch/spawn_template.py is a CPU/Gloo template that starts its
# own processes (no device choice); the shell scripts (multinode_local.sh, netns_two_hosts.sh,
# slurm.sbatch) launch the lessons above in other ways and are covered by the CPU suite.


def gpu_mode_reason(config):
    if not config.getoption("--gpu"):
        return "GPU mode: run `pytest --gpu` on a machine with CUDA GPUs"
    if GPUS == 0:
        return "GPU mode: no CUDA GPU on this machine (torch.cuda.device_count() is 0)"
    return None


def gpu_env():
    """The CPU suite may hide the GPUs from the lessons; these runs must see them."""
    return {
        "CUDA_VISIBLE_DEVICES": os.environ.get(
            "CUDA_VISIBLE_DEVICES", ",".join(map(str, range(GPUS)))
        )
    }


def pytest_generate_tests(metafunc):
    """Cases only where they can run: without the GPU mode, one skipped test says why."""
    reason = gpu_mode_reason(metafunc.config)
    if "nccl_case" in metafunc.fixturenames:
        cases = (
            [pytest.param(None, marks=pytest.mark.skip(reason=reason), id="off")]
            if reason
            else [
                pytest.param((lesson, n), id=f"{n}-{lesson}")
                if spec["min_ranks"] <= GPUS
                else pytest.param(
                    None,
                    id=f"{spec['min_ranks']}-{lesson}",
                    marks=pytest.mark.skip(
                        reason=f"needs {spec['min_ranks']} GPUs, this machine has {GPUS}"
                    ),
                )
                for lesson, spec in LESSONS.items()
                for n in range(spec["min_ranks"], max(spec["min_ranks"], min(GPUS, MAX_WORLD)) + 1)
                if spec.get("divides", n) % n == 0
            ]
        )
        metafunc.parametrize("nccl_case", cases)
    if "gloo_case" in metafunc.fixturenames:
        cases = (
            [pytest.param(None, marks=pytest.mark.skip(reason=reason), id="off")]
            if reason
            else [
                pytest.param(lesson, id=lesson)
                for lesson, spec in LESSONS.items()
                if spec["gloo_cuda"] is not None
            ]
        )
        metafunc.parametrize("gloo_case", cases)


def test_lesson_on_nccl(nccl_case):
    lesson, nproc = nccl_case
    result = run_lesson(
        lesson,
        "--backend",
        "nccl",
        *LESSONS[lesson].get("args", ()),
        nproc=nproc,
        timeout=TIMEOUT,
        env=gpu_env(),
    )
    assert_ok(result)
    assert "nccl" in result.stdout, f"the lesson did not say it used NCCL\n{result}"


def test_lesson_on_gloo_with_cuda_tensors(gloo_case):
    lesson, spec = gloo_case, LESSONS[gloo_case]
    result = run_lesson(
        lesson,
        "--backend",
        "gloo",
        "--device",
        "cuda",
        *spec.get("args", ()),
        nproc=2,
        timeout=TIMEOUT,
        env=gpu_env(),
    )
    if spec["gloo_cuda"]:
        assert_ok(result)
        assert "backend gloo, device cuda" in result.stdout, result
    else:
        assert_fails(result, "needs CPU tensors", within=2)


def test_weight_sync_two_jobs(request):
    """The trainer job on GPU 0 (or GPUs 0 and 1, FSDP) and the inference job on the others, over
    NCCL, each job seeing only its own GPUs, as the lesson tells; on a 1-GPU machine both jobs share
    it through Gloo."""
    reason = gpu_mode_reason(request.config)
    if reason:
        pytest.skip(reason)
    from test_weight_sync import two_jobs

    gpus = list(map(str, range(min(GPUS, MAX_WORLD))))
    if len(gpus) == 1:
        flags, trainers = ("--backend", "gloo", "--device", "cuda"), 1
        envs, inference = ({"CUDA_VISIBLE_DEVICES": "0"},) * 2, 1
    else:
        flags, trainers = ("--backend", "nccl"), 2 if len(gpus) >= 4 else 1
        envs = (
            {"CUDA_VISIBLE_DEVICES": ",".join(gpus[:trainers])},
            {"CUDA_VISIBLE_DEVICES": ",".join(gpus[trainers:])},
        )
        inference = len(gpus) - trainers
    trainer, engine = two_jobs(
        trainers, inference, trainer_args=flags, inference_args=flags, envs=envs, timeout=TIMEOUT
    )
    assert f"all {inference} inference rank(s) confirmed" in assert_ok(trainer)
    assert_ok(engine)
