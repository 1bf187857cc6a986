"""transformer_basics/train_local_sgd.py (issue 42): sync, local SGD (by hand and through DDP's
post_localSGD_hook) and DiLoCo on the folder's GPT. The OK line with the defaults at 2 ranks
(`python lesson.py --nproc 2`) and a short run at 3 (warm launcher), the bytes per step
read back from the table; the mistakes a reader could make, each caught by the lesson's own check
(a source mutation of a copy, tests/harness.mutant); an H that does not divide --steps, refused in
one line on every rank."""

import re

import pytest

from harness import assert_fails, assert_ok, mutant, run_lesson

LESSON = "transformer_basics/train_local_sgd.py"
T = 240  # seconds: the CI machine is small and shared; a hang is still caught
ROW = re.compile(
    r"^(sync SGD|sync AdamW|local SGD torch|local SGD|DiLoCo)\s+(\d+)\s+([\d.]+)\s", re.M
)
SHORT = ("--steps", "8", "--sync-every", "4")  # 5 runs of 8 steps, a sync every 4
# torch 2.13's own `import torch.distributed.optim` (for PostLocalSGDOptimizer) warns that
# torch.jit.script and .interface are deprecated: its functional optimizers are TorchScript
# (torch/distributed/optim/functional_*.py); not a call of the lesson's (tests/test_rpc_pipeline.py)
TORCHSCRIPT_AT_IMPORT = re.compile(
    r"^\S+/torch/jit/_script\.py:\d+: DeprecationWarning: `torch\.jit\.(script|interface)` .*\n",
    re.M,
)


def bytes_per_step(out):
    """{(method, H): bytes per step} from the lesson's table, and the parameters' bytes."""
    full = int(re.search(r"^GPT of \d+ float32 parameters \((\d+) bytes\)", out, re.M).group(1))
    return {(m, int(h)): float(b) for m, h, b in ROW.findall(out)}, full


@pytest.mark.parametrize(
    "nproc,launcher,args,runs",
    [
        (2, "python", (), 10),
        pytest.param(
            3, "warm", ("--steps", "16", "--sync-every", "1,8"), 7, marks=pytest.mark.quick
        ),
    ],
)
def test_ok_and_bytes_per_step(nproc, launcher, args, runs):
    result = run_lesson(LESSON, *args, nproc=nproc, launcher=launcher, timeout=T)
    result.stderr = re.sub(TORCHSCRIPT_AT_IMPORT, "", result.stderr)
    line = assert_ok(result)
    steps = args[1] if args else "96"
    assert line.startswith(f"OK: {nproc} replica(s), {steps} steps each"), line
    sent, full = bytes_per_step(result.stdout)
    assert len(sent) == runs, result.stdout  # every method at every H asked
    for (method, h), b in sent.items():  # 1/H of syncing every gradient every step
        assert b == round(full / h, 1), f"{method} H={h}: {b} bytes per step, not {full}/{h}"


MISTAKES = {
    # DiLoCo as local SGD: the weights averaged and copied to the global ones, no outer step. The
    # bytes are the same (the mean pseudo-gradient is the global weights minus the mean weights):
    # the replay of the outer step tells them apart (and the outer steps counted, 0)
    "diloco-weights-synced-not-pseudo-gradient": (
        (
            "                g.grad = g.detach() - p.detach()  # pseudo-gradient: where this "
            "replica went\n                dist.all_reduce(g.grad, op=dist.ReduceOp.AVG)\n"
            "            outer_opt.step()",
            "                dist.all_reduce(p.data, op=dist.ReduceOp.AVG)\n"
            "                g.data.copy_(p.data)",
        ),
        "DiLoCo H=4: weights differ from replay by",
    ),
    # the sum, not the mean: the replicas still agree and send the same bytes
    "local-sgd-sums-not-averages": (
        ("dist.all_reduce(p.data, op=dist.ReduceOp.AVG)", "dist.all_reduce(p.data)"),
        "local SGD torch H=4: weights differ from local SGD by",
    ),
    # the docs' pairing, start_localSGD_iter = warmup_steps: DDP syncs the first H-1 steps' grads
    "hook-starts-local-sgd-late": (
        ("PostLocalSGDState(None, None, 0,", "PostLocalSGDState(None, None, h - 1,"),
        "local SGD torch H=4: weights differ from local SGD by",
    ),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_mistakes_fail_the_check(mistake, tmp_path):
    change, message = MISTAKES[mistake]
    result = run_lesson(
        mutant(tmp_path, LESSON, change), *SHORT, nproc=2, launcher="warm", timeout=T
    )
    assert_fails(result, message)


def test_an_h_that_does_not_divide_the_steps_is_refused_in_one_line():
    result = run_lesson(
        LESSON, "--sync-every", "8,36", "--steps", "96", nproc=2, launcher="warm", timeout=T
    )
    assert_fails(result, "--sync-every [36] must divide --steps 96", within=2)
    assert 2 in result.rank_codes and "Traceback" not in result.output, result
