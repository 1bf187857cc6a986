"""transformer_basics/: the GPT, its data, and its training with DDP, FSDP, TP, PP and FSDP x TP."""

import re
import sys

import pytest
import torch
from harness import ROOT, assert_fails, assert_ok, run_command, run_lesson

sys.path.insert(0, str(ROOT / "transformer_basics"))
import checkpointing  # noqa: E402  (transformer_basics/checkpointing.py, likewise)
import data  # noqa: E402  (transformer_basics/data.py, imported in this process: no ranks needed)

TIMEOUT = 240
# A few steps of a 2-layer GPT; accum 2 exercises no_sync / set_requires_gradient_sync.
SMALL = [
    "--steps",
    "8",
    "--warmup",
    "2",
    "--batch-size",
    "4",
    "--accum",
    "2",
    "--n-layer",
    "2",
    "--eval-every",
    "4",
    "--eval-batches",
    "2",
    "--log-every",
    "2",
    "--sample-tokens",
    "0",
]
DROPOUT = ["--dropout", "0.1"]  # draws random numbers: an exact resume must restore the RNG too


def losses(output):
    """(first, last) train loss and (first, last) val loss from the summary line."""
    m = re.search(r"train loss ([\d.]+) -> ([\d.]+), val loss ([\d.]+) -> ([\d.]+)", output)
    assert m, f"no summary line in\n{output}"
    a, b, c, d = map(float, m.groups())
    return (a, b), (c, d)


def load_model(path):
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


# ---- data.py, in this process ----


def test_windows_are_disjoint_across_ranks_and_steps():
    tokens = torch.arange(10_000)
    world, batch, accum = 3, 4, 2
    seen = []
    for step in range(3):
        for micro in range(accum):
            for rank in range(world):
                w = data.ShardedWindows(tokens, 16, rank, world, seed=1)
                x, y = w.batch(step, micro, batch, accum)
                assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
                seen += w.indices(step, micro, batch, accum)
    assert (
        len(seen) == len(set(seen)) == 3 * accum * world * batch
    )  # no window read twice within an epoch


def test_generated_corpus_is_deterministic_and_small_enough():
    text = data.generate_corpus()
    assert text == data.generate_corpus() and 100_000 < len(text.encode()) < 1_000_000
    assert data.decode(data.encode("héllo")) == "héllo"


# ---- train.py: none / ddp / fsdp, loss falls, resume is exact ----


@pytest.fixture(scope="session")  # session, not module: kept while the worker runs other modules
def whole_run(tmp_path_factory):
    """An uninterrupted SMALL run per mode, made once and shared by the tests below."""
    cache = {}

    def get(parallel):
        if parallel not in cache:
            out = tmp_path_factory.mktemp(parallel)
            result = run_lesson(
                "transformer_basics/train.py",
                "--parallel",
                parallel,
                *SMALL,
                *DROPOUT,
                "--out",
                out,
                nproc=1 if parallel == "none" else 2,
                timeout=TIMEOUT,
            )
            assert_ok(result)
            cache[parallel] = result, out
        return cache[parallel]

    return get


@pytest.mark.parametrize("parallel,nproc", [("none", 1), ("ddp", 2), ("fsdp", 2)])
def test_train_loss_falls_and_resume_is_exact(parallel, nproc, whole_run, tmp_path):
    first, whole = whole_run(parallel)
    (train0, train1), (val0, val1) = losses(first.stdout)
    assert train1 < train0 - 0.5 and val1 < val0 - 0.5, first.stdout

    # The same run, interrupted after 5 steps (train.py's `python --nproc` run for ddp), then resumed
    # from its checkpoint.
    args = ["--parallel", parallel, *SMALL, *DROPOUT, "--out", tmp_path]
    assert_ok(
        run_lesson(
            "transformer_basics/train.py",
            *args,
            "--stop-after",
            "5",
            nproc=nproc,
            launcher="python" if parallel == "ddp" else "warm",
            timeout=TIMEOUT,
        )
    )
    resumed = run_lesson(
        "transformer_basics/train.py",
        *args,
        "--resume",
        nproc=nproc,
        launcher="warm",
        timeout=TIMEOUT,
    )
    assert_ok(resumed)
    assert "resumed at step 5" in resumed.stdout
    assert (
        losses(resumed.stdout)[1][1] == val1
    )  # the same final validation loss, to the printed digit
    a, b = load_model(whole / "model.pt"), load_model(tmp_path / "model.pt")
    assert a.keys() == b.keys()
    for name in a:  # bit-exact: same data, same order of operations, restored optimizer and RNG
        assert torch.equal(a[name], b[name]), f"{parallel}: {name} differs after resume"


def test_rng_restore_tolerates_a_missing_or_extra_device_state(capsys):
    cpu_state = torch.get_rng_state()
    # Written on the CPU, resumed on a GPU: no rng_cuda in the checkpoint (CUDA is never touched:
    # the state is missing, so this runs on a machine without a GPU too). It used to raise KeyError.
    checkpointing.set_rng_states({"rng": cpu_state}, torch.device("cuda"))
    assert "the checkpoint has no rng_cuda" in capsys.readouterr().out
    # Written on a GPU, resumed on the CPU: rng_cuda is there but of no use.
    torch.manual_seed(123)
    checkpointing.set_rng_states(
        {"rng": cpu_state, "rng_cuda": torch.zeros(16, dtype=torch.uint8)}, torch.device("cpu")
    )
    assert "rng_cuda in the checkpoint not restored" in capsys.readouterr().out
    assert torch.equal(torch.get_rng_state(), cpu_state)  # the CPU state is restored all the same


@pytest.mark.parametrize("parallel,nproc", [("none", 1), ("fsdp", 2)])
def test_resume_on_the_cpu_from_a_checkpoint_written_on_a_gpu(parallel, nproc, whole_run, tmp_path):
    """A checkpoint as a GPU run writes it (an extra rng_cuda), built by hand from a CPU one."""
    whole = whole_run(parallel)[1]
    gpu_state = torch.zeros(16, dtype=torch.uint8)  # any bytes: the CPU run must not use them
    if parallel == "none":  # torch.save
        state = torch.load(whole / "checkpoint.pt", map_location="cpu", weights_only=True)
        torch.save({**state, "rng_cuda": gpu_state}, tmp_path / "checkpoint.pt")
    else:  # torch.distributed.checkpoint: through one torch.save file and back, in this process
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

        dcp_to_torch_save(whole / "checkpoint", tmp_path / "full.pt")
        state = torch.load(tmp_path / "full.pt", map_location="cpu", weights_only=True)
        torch.save({**state, "rng_cuda": gpu_state}, tmp_path / "full.pt")
        torch_save_to_dcp(tmp_path / "full.pt", tmp_path / "checkpoint")
    result = run_lesson(
        "transformer_basics/train.py",
        "--parallel",
        parallel,
        *SMALL,
        "--steps",
        "10",
        "--resume",
        "--out",
        tmp_path,
        nproc=nproc,
        launcher="warm",
        timeout=TIMEOUT,
    )
    assert_ok(result)
    assert "resumed at step 8" in result.stdout
    assert result.stdout.count("rng_cuda in the checkpoint not restored (this run is on cpu)") == 1


def test_activation_checkpointing_under_fsdp_trains_the_same_model_bit_for_bit(whole_run, tmp_path):
    # the recomputed forward restores the RNG state, so dropout draws the same masks: with
    # preserve_rng_state=False in model.py the parameters differ by 0.028 after these 8 steps
    result = run_lesson(
        "transformer_basics/train.py",
        "--parallel",
        "fsdp",
        "--activation-checkpointing",
        *SMALL,
        *DROPOUT,
        "--out",
        tmp_path,
        nproc=2,
        launcher="warm",
        timeout=TIMEOUT,
    )
    assert_ok(result)
    plain, checkpointed = (
        load_model(whole_run("fsdp")[1] / "model.pt"),
        load_model(tmp_path / "model.pt"),
    )
    assert plain.keys() == checkpointed.keys()
    assert all(torch.equal(plain[name], checkpointed[name]) for name in plain)


def test_ddp_and_fsdp_train_the_same_model(whole_run):
    a, b = (
        load_model(whole_run("ddp")[1] / "model.pt"),
        load_model(whole_run("fsdp")[1] / "model.pt"),
    )
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)


@pytest.mark.quick  # in the quick tier for train.py too: whole_run trains the model it samples from
def test_generate_samples_from_the_exported_model(whole_run):
    result = run_command(
        [
            sys.executable,
            ROOT / "transformer_basics/generate.py",
            "--checkpoint",
            whole_run("fsdp")[1] / "model.pt",
            "--tokens",
            "40",
        ],
        timeout=TIMEOUT,
    )
    assert_ok(result)
    assert re.search(r"sample:\n  the ", result.stdout)
    assert_fails(
        run_command(
            [
                sys.executable,
                ROOT / "transformer_basics/generate.py",
                "--checkpoint",
                ROOT / "no/such/model.pt",
            ]
        ),
        "no checkpoint at",
    )


@pytest.mark.parametrize(
    "content,message", [(None, "no such file"), ("", "is empty"), ("too short", "shorter than")]
)
def test_bad_data_gives_one_line_on_every_rank(content, message, tmp_path):
    path = tmp_path / "text.txt"
    if content is not None:
        path.write_text(content)
    result = run_lesson(
        "transformer_basics/train.py",
        "--data",
        path,
        "--out",
        tmp_path / "out",
        nproc=2,
        launcher="warm",
        timeout=TIMEOUT,
    )
    # on 1 or 2 ranks: like torchrun, the launcher stops the other rank once one has failed
    assert_fails(result, message, within=2)
    assert 2 in result.rank_codes and "Traceback" not in result.output


def test_train_on_a_user_file_and_usage_errors(tmp_path):
    text = tmp_path / "poem.txt"
    text.write_text("roses are red, violets are blue; sugar is sweet, and so are you.\n" * 60)
    result = run_lesson(
        "transformer_basics/train.py",
        "--data",
        text,
        *SMALL,
        "--out",
        tmp_path / "o",
        nproc=1,
        launcher="warm",
        timeout=TIMEOUT,
    )
    assert_ok(result)
    for args, message in [
        (["--parallel", "none"], "--parallel none trains one process"),
        (["--resume", "--out", tmp_path / "nothing"], "--resume: no checkpoint"),
    ]:
        result = run_lesson(
            "transformer_basics/train.py", *args, nproc=2, launcher="warm", timeout=TIMEOUT
        )
        assert_fails(result, message, within=2)


# ---- tensor, pipeline and 2-D parallelism: equal to the unsharded model ----


# Real torchrun once per lesson, `python lesson.py --nproc N` once; other sizes through the harness's warm
# launcher (forked ranks).
@pytest.mark.parametrize(
    "nproc,extra", [pytest.param(2, [], marks=pytest.mark.quick), (4, ["--sequence-parallel"])]
)
def test_tensor_parallel_equals_unsharded(nproc, extra):
    ok = assert_ok(
        run_lesson(
            "transformer_basics/tensor_parallel.py",
            *extra,
            nproc=nproc,
            launcher="torchrun" if nproc == 2 else "python",
            timeout=TIMEOUT,
        )
    )
    assert f"on {nproc} rank(s)" in ok
    logits, grads = map(
        float, re.search(r"max diff ([\d.e+-]+) logits, ([\d.e+-]+) gradients", ok).groups()
    )
    assert logits < 2e-5 and grads < 2e-5


def test_tensor_parallel_refuses_heads_that_do_not_divide():
    result = run_lesson(
        "transformer_basics/tensor_parallel.py",
        "--n-head",
        "3",
        "--n-embd",
        "96",
        nproc=2,
        launcher="warm",
        timeout=TIMEOUT,
    )
    assert_fails(result, "must be a multiple of the 2 ranks", within=2)
    assert 2 in result.rank_codes


@pytest.mark.parametrize(
    "nproc,schedule,micro",
    [(1, "gpipe", 4), (2, "gpipe", 4), pytest.param(4, "1f1b", 4, marks=pytest.mark.quick)],
)
def test_pipeline_parallel_equals_single_process(nproc, schedule, micro):
    # 1 stage: what `python pipeline_parallel.py` starts on a machine with one GPU
    launcher = {1: "python", 2: "torchrun"}.get(nproc, "warm")
    result = run_lesson(
        "transformer_basics/pipeline_parallel.py",
        "--schedule",
        schedule,
        "--microbatches",
        str(micro),
        nproc=nproc,
        launcher=launcher,
        timeout=TIMEOUT,
    )
    ok = assert_ok(result)
    assert f"{schedule} pipeline of {nproc} stages" in ok
    bubble = re.search(r"= (\d+)/(\d+) = ", result.stdout).groups()
    assert bubble == (str(nproc - 1), str(micro + nproc - 1))
    # each stage receives and sends one tensor per micro-batch and neighbour, each way (activations, gradients)
    traffic = re.findall(
        r"^\[rank (\d+)\] parameters [\d,]+ B; last step (\d+) send, (\d+) recv .*, (\d+) all_reduce",
        result.stdout,
        re.M,
    )
    neighbours = [(r > 0) + (r < nproc - 1) for r in range(nproc)]
    tie = [int(nproc > 1 and r in (0, nproc - 1)) for r in range(nproc)]
    assert [tuple(map(int, t)) for t in traffic] == [
        (r, micro * n, micro * n, t) for r, n, t in zip(range(nproc), neighbours, tie)
    ], result.stdout


@pytest.mark.quick
def test_train_2d_matches_unsharded_and_learns(tmp_path):
    # bf16 and dropout, as on a GPU by default: the step-0 check must run (in float32) all the same
    result = run_lesson(
        "transformer_basics/train_2d.py",
        *SMALL,
        *DROPOUT,
        "--dtype",
        "bfloat16",
        "--n-layer",
        "2",
        "--sequence-parallel",
        "--out",
        tmp_path,
        nproc=4,
        timeout=TIMEOUT,
    )
    ok = assert_ok(result)
    assert "2x2 mesh" in ok and "bf16 on" in result.stdout
    worst = float(
        re.search(
            r"check: step 0's gradients \(float32\) equal .* \(max diff ([\d.e+-]+)\)",
            result.stdout,
        ).group(1)
    )
    assert worst < 2e-5
    (train0, train1), (val0, val1) = losses(result.stdout)
    assert val1 < val0 - 0.5
    assert (tmp_path / "model.pt").is_file() and (tmp_path / "checkpoint").is_dir()


def test_train_2d_python_launcher_one_row(tmp_path):
    """`python train_2d.py --nproc 2`: a 1x2 mesh (tensor parallel only), the same step-0 check."""
    result = run_lesson(
        "transformer_basics/train_2d.py",
        *SMALL,
        "--n-layer",
        "1",
        "--out",
        tmp_path,
        nproc=2,
        launcher="python",
        timeout=TIMEOUT,
    )
    assert "1x2 mesh" in assert_ok(result)


BENCH_SMALL = ["--n-layer", "1", "--n-embd", "48", "--block-size", "32"]


@pytest.mark.parametrize("launcher", [pytest.param("torchrun", marks=pytest.mark.quick), "python"])
def test_benchmark_prints_a_table(launcher):
    # the default 3 warm-up steps: the profiled third is past DDP's bucket rebuild (2 broadcasts in step 2)
    result = run_lesson(
        "transformer_basics/benchmark.py",
        "--steps",
        "4",
        *BENCH_SMALL,
        nproc=2,
        launcher=launcher,
        timeout=TIMEOUT,
    )
    assert_ok(result)
    rows = re.findall(
        r"^\| (none|ddp\+?|fsdp\+?|tp) \| 2 \| ([\d,]+) \| ([\d.]+) \| ([\d.]+) \| .* \| ([^|]+) \|$",
        result.stdout,
        re.M,
    )
    assert [r[0] for r in rows] == ["none", "ddp", "ddp+", "fsdp", "fsdp+", "tp"]
    state = {r[0]: float(r[3]) for r in rows}
    assert (
        state["fsdp"] < 0.6 * state["ddp"] and state["fsdp+"] == state["fsdp"]
    )  # FSDP holds about half on 2 ranks
    sent = {r[0]: r[4].strip() for r in rows}
    assert (
        sent["none"] == "-" and sent["ddp"] == sent["ddp+"] == "1 all_reduce"
    )  # one bucket: the model is small
    # one block and the root: all_gathered in forward, the block again in backward unless fsdp+ keeps it
    assert (
        sent["fsdp"] == "3 all_gather, 2 reduce_scatter"
        and sent["fsdp+"] == "2 all_gather, 2 reduce_scatter"
    )
    assert re.fullmatch(r"\d+ all_reduce", sent["tp"])
    assert "ddp / none" in result.stdout and "fsdp+ / ddp+" in result.stdout


@pytest.mark.parametrize("tuned", ["ddp+", "fsdp+"])
def test_benchmark_loss_check_fails_when_a_tuned_mode_skips_the_gradient_sync(tuned):
    result = run_lesson(
        "transformer_basics/benchmark.py",
        "--modes",
        "ddp",
        tuned,
        "--no-grad-sync",
        "--steps",
        "3",
        "--warmup",
        "1",
        *BENCH_SMALL,
        nproc=2,
        launcher="warm",
        timeout=TIMEOUT,
    )
    assert_fails(result, "should train the same model, but their losses differ")


def test_benchmark_refuses_no_warmup():
    result = run_lesson(
        "transformer_basics/benchmark.py",
        "--warmup",
        "0",
        nproc=2,
        launcher="warm",
        timeout=TIMEOUT,
    )
    assert_fails(result, "--warmup must be at least 1", within=2)
