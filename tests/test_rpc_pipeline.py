"""primitives/rpc_pipeline.py: a two-stage model trained over RPC from rank 0 equals one process,
at 2 ranks (both stages on worker 1) and at 3 (one stage per worker). The mistakes its check
catches are rows of tests/test_mutations.py."""

import re

import pytest

from harness import assert_ok, run_lesson

LESSON = "primitives/rpc_pipeline.py"
TORCHSCRIPT_AT_IMPORT = re.compile(
    r"^\S+/torch/jit/_script\.py:\d+: DeprecationWarning: `torch\.jit\.(script|interface)` .*\n",
    re.M,
)


@pytest.mark.parametrize(
    "nproc, launcher, where",
    [
        pytest.param(2, "python", "worker1,", marks=pytest.mark.quick),
        (3, "warm", "worker1 and worker2,"),
    ],
)
def test_rpc_training_matches_one_process(nproc, launcher, where):
    result = run_lesson(LESSON, nproc=nproc, launcher=launcher, timeout=180)
    # torch 2.13's own `import torch.distributed.optim` warns that torch.jit.script and
    # torch.jit.interface are deprecated (its functional optimizers are TorchScript; 2.14.1's
    # import does not): not the lesson's calls, which keep DistributedOptimizer off that path
    result.stderr = re.sub(TORCHSCRIPT_AT_IMPORT, "", result.stderr)
    line = assert_ok(result)
    assert f"the model on {where} trained from rank 0 over RPC, matches one process" in line
    assert result.stdout.count("step ") == 5, result
