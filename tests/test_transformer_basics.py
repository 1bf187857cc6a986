"""transformer_basics/: the GPT, its data, and its training with DDP, FSDP, TP, PP and FSDP x TP.

train.py is the folder's first lesson: real torchrun at 1 and 2 ranks (the shared runs of
`whole_run`), `python train.py --nproc 2` once; every other lesson runs once as
`python lesson.py --nproc N` and at its other world sizes through the warm launcher. The
training runs are small (6 steps of a 2-layer, 64-wide GPT on 32-token windows), and one run
serves several tests where it can (whole_run, resume_run).
"""

import json
import re
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
from harness import ROOT, assert_fails, assert_ok, mutant, run_command, run_lesson
from lesson_cli import lesson_parser

sys.path.insert(0, str(ROOT / "transformer_basics"))
# transformer_basics/ modules, imported in this process: no ranks needed
import checkpointing  # noqa: E402
import data  # noqa: E402
import generate  # noqa: E402
from launch.dist_setup import UsageError  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

TIMEOUT = 240
TRAIN, TRAIN_2D = "transformer_basics/train.py", "transformer_basics/train_2d.py"
# A few steps of a 2-block GPT; accum 2 exercises no_sync / set_requires_gradient_sync, two blocks
# FSDP2's per-block groups and prefetch, eval-every 3 one evaluation mid-run. train.py's runs are
# 64 wide on 32-token windows (GPT_SMALL); train_2d.py keeps its defaults (12 heads, 96 wide).
SMALL = (
    "--steps 6 --warmup 1 --batch-size 4 --accum 2 --n-layer 2 --eval-every 3 --eval-batches 2 "
    "--log-every 2 --sample-tokens 0".split()
)
GPT_SMALL = [*SMALL, "--n-embd", "64", "--block-size", "32"]
DROPOUT = ["--dropout", "0.1"]  # draws random numbers: an exact resume must restore the RNG too


def losses(output):
    """(first, last) train loss and (first, last) val loss from the summary line."""
    m = re.search(r"train loss ([\d.]+) -> ([\d.]+), val loss ([\d.]+) -> ([\d.]+)", output)
    assert m, f"no summary line in\n{output}"
    a, b, c, d = map(float, m.groups())
    return (a, b), (c, d)


def load_model(path):
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def assert_same_model(a_path, b_path, what):
    a, b = load_model(a_path), load_model(b_path)
    assert a.keys() == b.keys()
    for name in a:  # bit-exact: same data, same order of operations, restored optimizer and RNG
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs"


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
    # no window read twice within an epoch
    assert len(seen) == len(set(seen)) == 3 * accum * world * batch


def test_generated_corpus_is_deterministic_and_small_enough():
    text = data.generate_corpus()
    assert text == data.generate_corpus() and 100_000 < len(text.encode()) < 1_000_000
    assert data.decode(data.encode("héllo")) == "héllo"


def test_a_text_that_cannot_train_is_one_line():
    """The reasons data.load_tokens gives (the lesson's one line: test_bad_data_... below)."""
    assert "is empty" in data.check_tokens(data.encode(""), 32, "t.txt")
    assert "shorter than the 330 needed" in data.check_tokens(data.encode("too short"), 32, "t")
    assert data.check_tokens(data.encode("x" * 330), 32, "t.txt") is None
    with pytest.raises(ValueError, match="--data /no/such.txt: no such file"):
        data.load_text("/no/such.txt")


# ---- train.py: none / ddp / fsdp, loss falls, resume is exact ----


@pytest.fixture(scope="session")  # session, not module: kept while the worker runs other modules
def whole_run(tmp_path_factory):
    """An uninterrupted SMALL run per mode under real torchrun, made once, shared below."""
    cache = {}

    def get(parallel):
        if parallel not in cache:
            out = tmp_path_factory.mktemp(parallel)
            args = ["--parallel", parallel, *GPT_SMALL, *DROPOUT, "--out", out]
            args += ["--profile", "2"] if parallel == "none" else []  # test_profile_...
            nproc = 1 if parallel == "none" else 2
            result = run_lesson(TRAIN, *args, nproc=nproc, launcher="torchrun", timeout=TIMEOUT)
            assert_ok(result)
            cache[parallel] = result, out
        return cache[parallel]

    return get


def with_gpu_rng_state(path):
    """The torch.save checkpoint at path as a GPU run writes it: an extra rng_cuda (any bytes:
    a CPU run must not use them)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    torch.save({**state, "rng_cuda": torch.zeros(16, dtype=torch.uint8)}, path)


@pytest.mark.parametrize(
    "parallel,nproc,extra",
    [("none", 1, []), ("ddp", 2, []), ("fsdp", 2, ["--activation-checkpointing"])],
    ids=["none", "ddp", "fsdp-ac"],
)
def test_train_loss_falls_and_resume_is_exact(parallel, nproc, extra, whole_run, tmp_path):
    """The whole run's loss falls. The same run, interrupted after 4 steps (ddp: the one
    `python train.py --nproc 2` run), then resumed from its checkpoint, ends with every parameter
    bit-identical. none: the checkpoint resumed has a GPU's RNG state added (as if written on a
    GPU); it is named in one line and the result is still exact. fsdp: both halves run with
    activation checkpointing, so the equality also shows that the recomputed forward restores
    the RNG state (dropout draws the same masks; with preserve_rng_state=False in model.py the
    parameters differed by 0.028 after 8 steps, torch 2.13)."""
    first, whole = whole_run(parallel)
    (train0, train1), (val0, val1) = losses(first.stdout)
    assert train1 < train0 - 0.5 and val1 < val0 - 0.5, first.stdout

    args = ["--parallel", parallel, *GPT_SMALL, *DROPOUT, *extra, "--out", tmp_path]
    launcher = "python" if parallel == "ddp" else "warm"
    stop = ["--stop-after", "4"]
    assert_ok(run_lesson(TRAIN, *args, *stop, nproc=nproc, launcher=launcher, timeout=TIMEOUT))
    if parallel == "none":
        with_gpu_rng_state(tmp_path / "checkpoint.pt")
    resumed = run_lesson(TRAIN, *args, "--resume", nproc=nproc, launcher="warm", timeout=TIMEOUT)
    assert_ok(resumed)
    assert "resumed at step 4" in resumed.stdout
    gpu_line = "rng_cuda in the checkpoint not restored (this run is on cpu)"
    assert resumed.stdout.count(gpu_line) == (1 if parallel == "none" else 0)
    # the same final validation loss, to the printed digit
    assert losses(resumed.stdout)[1][1] == val1
    assert_same_model(whole / "model.pt", tmp_path / "model.pt", f"{parallel} {extra} resumed")


def test_ddp_check_fails_when_the_gradients_are_never_synced(tmp_path):
    """train.py with every micro-batch under no_sync (a reader's slip in the accumulation): DDP
    never all-reduces, the replicas drift apart, and check_replicas_agree says so."""
    sync = 'with model.no_sync() if args.parallel == "ddp" and not last else nullcontext():'
    copy = mutant(tmp_path, TRAIN, (sync, "with model.no_sync():"))
    args = [*GPT_SMALL, "--steps", "3", "--n-layer", "1", "--out", tmp_path / "out"]
    result = run_lesson(copy, *args, nproc=2, launcher="warm", timeout=TIMEOUT)
    assert_fails(result, "DDP replicas diverged: parameters differ between ranks")


def test_resume_check_fails_when_the_optimizer_state_is_not_restored(whole_run, tmp_path):
    """A copy whose resume loads the model but not the optimizer (AdamW would start again from
    zero moments, and the loss alone barely shows it): the lesson's check of the resume
    (train.py's check_resumed) compares the optimizer state with the checkpoint's and stops."""
    shutil.copytree(whole_run("ddp")[1], tmp_path / "out")
    load = '        optimizer.load_state_dict(state["optimizer"])\n'
    copy = mutant(tmp_path, TRAIN, (load, "        pass\n"), file="checkpointing.py")
    args = [*GPT_SMALL, "--steps", "8", "--resume", "--out", tmp_path / "out"]
    result = run_lesson(copy, *args, nproc=2, launcher="warm", timeout=TIMEOUT)
    assert_fails(result, "--resume: after the resume, the state differs from the checkpoint")
    assert "['optimizer']" in result.output


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


def test_resume_fsdp_on_the_cpu_from_a_checkpoint_written_on_a_gpu(whole_run, tmp_path):
    """A DCP checkpoint as a GPU run writes it (an extra rng_cuda), built by hand from a CPU one
    (torch.save's form is covered by test_train_loss_falls_and_resume_is_exact[none])."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    whole = whole_run("fsdp")[1]
    dcp_to_torch_save(whole / "checkpoint", tmp_path / "full.pt")  # in this process, and back
    with_gpu_rng_state(tmp_path / "full.pt")
    torch_save_to_dcp(tmp_path / "full.pt", tmp_path / "checkpoint")
    args = ["--parallel", "fsdp", *GPT_SMALL, "--steps", "8", "--resume", "--out", tmp_path]
    result = run_lesson(TRAIN, *args, nproc=2, launcher="warm", timeout=TIMEOUT)
    assert_ok(result)
    assert "resumed at step 6" in result.stdout
    assert result.stdout.count("rng_cuda in the checkpoint not restored (this run is on cpu)") == 1


def test_ddp_and_fsdp_train_the_same_model(whole_run):
    a = load_model(whole_run("ddp")[1] / "model.pt")
    b = load_model(whole_run("fsdp")[1] / "model.pt")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)


def test_profile_writes_its_summary_and_a_trace(whole_run):
    """--profile 2 (the `none` run): OUT/profile/summary.txt and trace.json, both named by one
    `profile:` line; on a CPU the summary times the host and the data and lists ops by CPU time;
    the trace is Chrome's trace format (JSON with traceEvents, which Perfetto opens), the
    data.batch ranges in it."""
    result, out = whole_run("none")
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("profile:")]
    summary, trace = out / "profile" / "summary.txt", out / "profile" / "trace.json"
    assert str(summary) in line and str(trace) in line, line
    text = summary.read_text()
    assert text.startswith("steps 1..2, rank 0, on the CPU\n"), text
    assert re.search(r"host: [\d.]+ ms to issue a step .*, of which data [\d.]+ ms", text), text
    assert "top ops by self CPU time" in text and "aten::" in text, text
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert "data.batch" in names, sorted(names)[:20]


def test_flags_and_the_constraints_between_them_are_refused_when_parsed(capsys):
    """In this process, train.py's parse: one argparse line for each constraint between flags;
    --gpt2-small's sizes are defaults that a flag given still overrides, and the parameter counts
    its help and the README give (85.25M with bytes, 123.69M at GPT-2's vocabulary) are the
    model's."""
    import train

    for argv, message in [
        (["--warmup", "250"], "--steps 250 must be larger than --warmup 250"),
        (["--min-lr", "0.1"], "--min-lr 0.1 is above --lr 0.003"),
        (["--n-head", "3"], "--n-embd 128 must be a multiple of --n-head 3"),
        (
            ["--profile", "9", "--steps", "10", "--warmup", "1"],
            "--profile 9: the run needs 11 steps",
        ),
        (["--gpt2-small", "--steps", "50"], "--steps 50 must be larger than --warmup 100"),
    ]:
        with pytest.raises(SystemExit):
            train.parse(lesson_parser(TRAIN), argv)
        assert message in capsys.readouterr().err
    args = train.parse(lesson_parser(TRAIN), ["--gpt2-small", "--batch-size", "32"])
    sizes = (args.n_layer, args.n_head, args.n_embd, args.block_size, args.accum, args.compile)
    assert sizes == (12, 12, 768, 1024, 1, True) and args.batch_size == 32
    with torch.device("meta"):  # shapes only
        for vocab, millions in ((256, 85.25), (50304, 123.69)):
            model = GPT(GPTConfig(vocab, 1024, n_layer=12, n_head=12, n_embd=768))
            assert round(model.num_params() / 1e6, 2) == millions


@pytest.mark.parametrize("found", ["torch.save file", "two checkpoints"])
def test_resume_names_what_to_change(found, whole_run, tmp_path):
    """--resume reads whichever checkpoint --out holds (tests/test_copy_out.py: a plain resume of
    an --async-save run); FSDP cannot read DDP's torch.save file, and two checkpoints are one too
    many: one line on every rank that says what to change."""
    shutil.copytree(whole_run("ddp")[1], tmp_path, dirs_exist_ok=True)
    message = "checkpoint.pt is a torch.save file (--parallel none or ddp wrote it)"
    if found == "two checkpoints":
        shutil.copytree(whole_run("fsdp")[1] / "checkpoint", tmp_path / "checkpoint")
        message = "holds two checkpoints, checkpoint/ and checkpoint.pt: move away the one"
    args = ["--parallel", "fsdp", *GPT_SMALL, "--steps", "8", "--resume", "--out", tmp_path]
    result = run_lesson(TRAIN, *args, nproc=2, launcher="warm", timeout=TIMEOUT)
    assert_fails(result, message, within=2)
    assert "Traceback" not in result.output


# ---- a checkpoint that does not fit: one line that names the file and what differs ----


def fits(path, model):
    """checkpointing.check_fits in this process (the torch.save form): the message, or None."""
    ctx = SimpleNamespace(require=lambda ok, message: None if ok else throw(UsageError(message)))
    try:
        checkpointing.check_fits(path, model, ctx)
    except UsageError as error:
        return str(error)
    return None


def throw(error):
    raise error


def test_check_fits_names_the_file_and_the_difference(whole_run, tmp_path):
    saved = whole_run("none")[1] / "checkpoint.pt"  # 2 layers, 64 wide, 32 tokens
    small = dict(n_layer=2, n_embd=64, block_size=32)
    assert fits(saved, GPT(GPTConfig(**small))) is None
    wider = fits(saved, GPT(GPTConfig(**{**small, "n_embd": 128})))
    assert f"--resume: {saved} holds wte.weight of shape (256, 64), this model (256, 128)" in wider
    deeper = fits(saved, GPT(GPTConfig(**{**small, "n_layer": 3})))
    assert f"--resume: {saved} has no blocks.2.attn.k.bias, which this model has" in deeper
    garbage = tmp_path / "garbage.pt"
    garbage.write_text("not a checkpoint\n")
    assert f"--resume: {garbage} is not a checkpoint of this script (not a zip" in fits(
        garbage, GPT(GPTConfig(**small))
    )
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    assert "(it holds no model state)" in fits(tmp_path / "other.pt", GPT(GPTConfig(**small)))


@pytest.mark.parametrize(
    "parallel,change,message",
    [
        ("fsdp", ["--n-layer", "1"], "checkpoint has blocks.1.attn.k.bias, which this model lacks"),
        ("ddp", "garbage", "checkpoint.pt is not a checkpoint of this script (not a zip"),
        ("fsdp", "empty-shard", "__1_0.distcp is missing or shorter than its metadata says"),
        ("fsdp", "cut-shard", "__0_0.distcp is missing or shorter than its metadata says"),
    ],
    ids=["fsdp-deeper", "ddp-not-a-checkpoint", "fsdp-empty-shard", "fsdp-cut-shard"],
)
def test_resume_from_a_checkpoint_that_does_not_fit(parallel, change, message, whole_run, tmp_path):
    """The lesson, on every rank: DCP's metadata of a deeper model (fsdp), a file that is not a
    checkpoint (ddp), a DCP shard empty or cut short: one line and exit 2, no traceback."""
    shutil.copytree(whole_run(parallel)[1], tmp_path, dirs_exist_ok=True)
    if change == "garbage":
        (tmp_path / "checkpoint.pt").write_bytes(b"\x00" * 100)
    elif change == "empty-shard":  # a full disk: the file made, nothing written
        (tmp_path / "checkpoint" / "__1_0.distcp").write_bytes(b"")
    elif change == "cut-shard":  # a copy cut short
        shard = tmp_path / "checkpoint" / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    change = [] if isinstance(change, str) else change
    args = ["--parallel", parallel, *GPT_SMALL, *change, "--resume", "--out", tmp_path]
    result = run_lesson(TRAIN, *args, nproc=2, launcher="warm", timeout=TIMEOUT)
    assert_fails(result, message, within=2)
    assert 2 in result.rank_codes and "Traceback" not in result.output


# ---- generate.py ----


@pytest.mark.quick  # in the quick tier for train.py too: whole_run trains the model it samples from
def test_generate_samples_from_the_exported_model(whole_run, tmp_path):
    model_pt = whole_run("fsdp")[1] / "model.pt"
    lesson = ROOT / "transformer_basics/generate.py"
    command = [sys.executable, lesson, "--checkpoint", model_pt, "--tokens", "40"]
    result = run_command(command, timeout=TIMEOUT)
    assert_ok(result)
    assert re.search(r"sample:\n  the ", result.stdout)
    # temperature 0 is greedy decoding (in this process): each new byte is the most likely one
    model = generate.load_model(model_pt, torch.device("cpu"))
    with torch.no_grad():
        out = model.generate(data.encode("the ")[None], 20, temperature=0)
        assert torch.equal(model(out[:, :-1]).argmax(-1)[0, 3:], out[0, 4:])
    assert generate.sample(model, "the ", 20, temperature=0) == data.decode(out[0].tolist())
    # a missing file, a file that is not a model.pt: one line (sys.exit prints it, no traceback)
    garbage = tmp_path / "model.pt"
    garbage.write_text("not a model")
    for checkpoint, message in [
        (ROOT / "no/such/model.pt", "error: no checkpoint at"),
        (garbage, f"error: {garbage} is not a model.pt written by train.py or train_2d.py"),
    ]:
        with pytest.raises(SystemExit, match=re.escape(message)):
            generate.check_model_file(checkpoint)


# ---- train.py: bad input is one line on every rank ----


def test_bad_data_gives_one_line_on_every_rank(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("too short")
    result = run_lesson(
        TRAIN, "--data", path, "--out", tmp_path / "out", nproc=2, launcher="warm", timeout=TIMEOUT
    )
    # on 1 or 2 ranks: like torchrun, the launcher stops the other rank once one has failed
    assert_fails(result, "shorter than", within=2)
    assert 2 in result.rank_codes and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()  # a refused run writes nothing


def test_train_on_a_user_file_and_usage_errors(tmp_path):
    text = tmp_path / "poem.txt"
    text.write_text("roses are red, violets are blue; sugar is sweet, and so are you.\n" * 60)
    args = ["--data", text, *GPT_SMALL, "--out", tmp_path / "o"]
    assert_ok(run_lesson(TRAIN, *args, nproc=1, launcher="warm", timeout=TIMEOUT))
    for args, message in [
        (["--parallel", "none"], "--parallel none trains one process"),
        (["--resume"], "--resume: no checkpoint"),
        (["--async-save"], "--async-save needs --save-every N > 0"),
        (["--data", tmp_path / "no.txt"], "no.txt: no such file"),
    ]:
        out = tmp_path / "refused"
        result = run_lesson(TRAIN, *args, "--out", out, nproc=2, launcher="warm", timeout=TIMEOUT)
        assert_fails(result, message, within=2)
        assert not out.exists(), f"{args}: a refused run wrote {out}"


# ---- tensor, pipeline and 2-D parallelism: equal to the unsharded model ----


@pytest.mark.parametrize(
    "nproc,launcher,extra",
    [pytest.param(2, "python", [], marks=pytest.mark.quick), (4, "warm", ["--sequence-parallel"])],
    ids=["2", "4-sequence-parallel"],
)
def test_tensor_parallel_equals_unsharded(nproc, launcher, extra):
    lesson = "transformer_basics/tensor_parallel.py"
    ok = assert_ok(run_lesson(lesson, *extra, nproc=nproc, launcher=launcher, timeout=TIMEOUT))
    assert f"on {nproc} rank(s)" in ok
    logits, grads = map(
        float, re.search(r"max diff ([\d.e+-]+) logits, ([\d.e+-]+) gradients", ok).groups()
    )
    assert logits < 2e-5 and grads < 2e-5


def test_tensor_parallel_refuses_heads_that_do_not_divide():
    result = run_lesson(
        "transformer_basics/tensor_parallel.py",
        *"--n-head 3 --n-embd 96".split(),
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
    result = run_lesson(
        "transformer_basics/pipeline_parallel.py",
        *f"--schedule {schedule} --microbatches {micro} --steps 2".split(),
        nproc=nproc,
        launcher="python" if nproc == 1 else "warm",
        timeout=TIMEOUT,
    )
    ok = assert_ok(result)
    assert f"{schedule} pipeline of {nproc} stages" in ok
    bubble = re.search(r"= (\d+)/(\d+) = ", result.stdout).groups()
    assert bubble == (str(nproc - 1), str(micro + nproc - 1))
    # each stage receives and sends one tensor per micro-batch and neighbour, each way
    # (activations, gradients)
    traffic = re.findall(
        r"^\[rank (\d+)\] parameters [\d,]+ B; last step (\d+) send, (\d+) recv .*, "
        r"(\d+) all_reduce",
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
    args = [*SMALL, *DROPOUT, "--dtype", "bfloat16", "--sequence-parallel", "--out", tmp_path]
    result = run_lesson(TRAIN_2D, *args, nproc=4, launcher="warm", timeout=TIMEOUT)
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
    args = [*SMALL, "--n-layer", "1", "--out", tmp_path]
    result = run_lesson(TRAIN_2D, *args, nproc=2, launcher="python", timeout=TIMEOUT)
    assert "1x2 mesh" in assert_ok(result)


BENCH_SMALL = ["--n-layer", "1", "--n-embd", "48", "--block-size", "32"]


@pytest.mark.quick
def test_benchmark_prints_a_table():
    # the default 3 warm-up steps: the profiled third is past DDP's bucket rebuild (2 broadcasts in
    # step 2)
    result = run_lesson(
        "transformer_basics/benchmark.py",
        "--steps",
        "4",
        *BENCH_SMALL,
        nproc=2,
        launcher="python",
        timeout=TIMEOUT,
    )
    assert_ok(result)
    rows = re.findall(
        r"^\| (none|ddp\+?|fsdp\+?|tp) \| 2 \| ([\d,]+) \| ([\d.]+) \| ([\d.]+) \| .* "
        r"\| ([^|]+) \|$",
        result.stdout,
        re.M,
    )
    assert [r[0] for r in rows] == ["none", "ddp", "ddp+", "fsdp", "fsdp+", "tp"]
    state = {r[0]: float(r[3]) for r in rows}
    # FSDP holds about half on 2 ranks
    assert state["fsdp"] < 0.6 * state["ddp"] and state["fsdp+"] == state["fsdp"]
    sent = {r[0]: r[4].strip() for r in rows}
    # one bucket: the model is small
    assert sent["none"] == "-" and sent["ddp"] == sent["ddp+"] == "1 all_reduce"
    # one block and the root: all_gathered in forward, the block again in backward unless fsdp+
    # keeps it
    assert sent["fsdp"] == "3 all_gather, 2 reduce_scatter"
    assert sent["fsdp+"] == "2 all_gather, 2 reduce_scatter"
    assert re.fullmatch(r"\d+ all_reduce", sent["tp"])
    assert "ddp / none" in result.stdout and "fsdp+ / ddp+" in result.stdout


def test_benchmark_refuses_as_many_warmup_steps_as_steps():
    result = run_lesson(
        "transformer_basics/benchmark.py",
        *"--steps 3 --warmup 3".split(),
        nproc=2,
        launcher="warm",
        timeout=TIMEOUT,
    )
    assert_fails(result, "--steps must be larger than --warmup", within=2)
