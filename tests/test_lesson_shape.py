"""Every lesson reads as the code a reader copies, then how it checks itself (DESIGN.md's contract):

- one divider line, DIVIDER, exactly once: above it the lesson (docstring, imports, `main` and the
  functions it teaches), below it the checks, the printing of what was checked, and the flags (the
  `if __name__ == "__main__":` block ends the file: Python must have defined the checks before `run`
  calls `main`);
- the part above the divider fits on one screen (ABOVE_DIVIDER lines), but for the few lessons in
  LONGER, each with the reason; no file of a lesson folder over MAX_LINES lines;
- a lesson that uses launch/dist_setup.run says in its docstring what run and ctx stand for
  (SETUP_LINE);
- no lesson has a flag that exists only so a test can break a check: the suite breaks a lesson by a
  source mutation of a copy (tests/test_mutations.py), so `test_flags` is gone from launch/.
Line length (100) and formatting are ruff's (pyproject.toml; .ci/run runs `ruff format --check` and
`ruff check`).
"""

import pytest

from lesson_cli import FOLDERS, ROOT, lessons

pytestmark = pytest.mark.quick

DIVIDER = "# ---- The lesson ends here. What follows is how it checks itself. ----"
# In the docstring of every lesson that uses launch.dist_setup.run: what run and ctx stand for
# (launch/README.md shows the block that replaces the import when the lesson is copied out).
SETUP_LINE = (
    "run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python."
)
ABOVE_DIVIDER = 100  # one screen
MAX_LINES = 330  # nanoGPT's train.py is 336
# lesson: (lines allowed above the divider, why this lesson cannot be one screen)
# (issue 50: the Gloo point-to-point refusal and can_write_in's call, written out in the lessons
# when they left launch/dist_setup.py, raised pipeline_parallel, ring_attention, train_cp, train
# and train_2d by 1 to 5 lines)
LONGER = {
    "primitives/flight_recorder.py": (110, "the faults, the dump and the analyzer are the lesson"),
    "launch/fault_tolerant_ddp.py": (
        172,
        "its own launcher, its store keys, the failed step, the regroup, the join, the state sync",
    ),
    "primitives/hello_distributed.py": (120, "the whole set-up by hand, torchrun and spawn paths"),
    # issue 53: a job that runs for days
    "launch/preemption.py": (136, "the handler, the agreement, the atomic save, the exact resume"),
    "launch/straggler.py": (105, "a clock on the device's timeline (CUDA events), the report"),
    "primitives/init_methods.py": (115, "four ways to form a group, each spelled out"),
    "transformer_basics/ring_attention.py": (
        148,
        "an autograd.Function: forward and backward ring",
    ),
    "transformer_basics/train_cp.py": (129, "a GPT training script: dp x cp mesh, ring attention"),
    # + 2: helpers called by keyword (issue 40)
    "transformer_basics/train_moe.py": (122, "a GPT training script: MoE blocks, dp x ep mesh"),
    # the timed training loop, which the lesson measures, came up from below the divider (issue 50)
    "ddp_basics/benchmark_ddp.py": (102, "two syncs by hand, DDP, and the timed loop they run in"),
    "ddp_basics/ddp_checkpoint.py": (160, "save, load and the resumable job that uses them"),
    # each method a function a reader can call (issue 50), and the data's size refused up front
    "ddp_basics/local_sgd.py": (112, "four training loops, DiLoCo's outer step, the plan of runs"),
    "ddp_basics/ddp_overlap.py": (110, "timing hooks on autograd and on DDP's buckets: the lesson"),
    # fsdp_basics/: the lessons that write a mechanism out by hand
    "fsdp_basics/fsdp_checkpoint.py": (
        141,
        "save, load and the atomic publish are each written out",
    ),
    "fsdp_basics/fsdp_memory_plan.py": (124, "the fake-group planner, the real step, activations"),
    "fsdp_basics/zero_by_hand.py": (121, "ZeRO-3 by hand: an autograd.Function and a module"),
    "fsdp_basics/zero_stages.py": (111, "ZeRO-1 and 2 by hand: the flat buffer and its slices"),
    # a tool: the timed calls with their buffers, the timing and busbw (issue 50: the calls came up
    # from below the divider)
    "primitives/benchmark_collectives.py": (113, "buffers and calls of 7 ops, timing, busbw"),
    # open_store, how the two jobs meet, came up from below the divider (issue 50)
    "primitives/weight_sync_two_jobs.py": (
        109,
        "two jobs: a store on one address, a group, buckets",
    ),
    # + its start checks and the wait for the front end, none below the divider (issue 50)
    "primitives/debug_server.py": (142, "the hang, the watchdog thread and the pages it reads"),
    "transformer_basics/benchmark.py": (130, "six ways to build one GPT and the timing loop"),
    "transformer_basics/composition.py": (125, "AC + compile + FSDP2, + DDP, and the other order"),
    "transformer_basics/pipeline_parallel.py": (125, "stages, schedule, tied weights, step loop"),
    "transformer_basics/tensor_parallel.py": (128, "block and model TP plans, SP, training loop"),
    # the whole recipe inline, as nanoGPT's train.py (issues 40, 50): data, model, parallelism,
    # AdamW and its schedule, resume, the bf16 choice, the evaluation, the loop, the checkpoint
    "transformer_basics/train.py": (192, "a whole training script, its recipe inline"),
    "transformer_basics/train_2d.py": (
        192,
        "train.py's recipe on a 2-D mesh, TP, FSDP, 2-mesh clip",
    ),
}


@pytest.mark.parametrize("lesson", lessons())
def test_lesson_first_then_its_checks(lesson):
    lines = (ROOT / lesson).read_text().splitlines()
    at = [i for i, line in enumerate(lines) if line.strip() == DIVIDER]
    assert len(at) == 1, f"{lesson}: the divider line occurs {len(at)} times, not once:\n{DIVIDER}"
    allowed = LONGER.get(lesson, (ABOVE_DIVIDER, ""))[0]
    assert at[0] <= allowed, f"{lesson}: {at[0]} lines above the divider, more than {allowed}"
    text = "\n".join(lines)
    assert "test_flags" not in text, f"{lesson} still has a test-only flag group"
    sets_up = "init_process_group=False" not in text  # rpc_pipeline: RPC needs no process group
    if "from launch.dist_setup import" in text and "run(main" in text and sets_up:
        docstring = text.split('"""')[1]
        assert SETUP_LINE in docstring, f"{lesson}: its docstring lacks the line\n{SETUP_LINE}"


# file: (lines allowed, why it cannot be split by topic)
LONGER_FILES = {
    # issue 50: a reader copies train.py with model.py, data.py, checkpointing.py and
    # launch/dist_setup.py, nothing else; so train.py holds, below its divider, its flags, its
    # timing (MFU, --profile) and its checks (resume, --async-save, DDP's replicas)
    "transformer_basics/train.py": (550, "the recipe, and its flags, timing and checks")
}


def test_no_file_is_too_long():
    files = [p for folder in FOLDERS for p in (ROOT / folder).glob("*.py")]
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in files}
    long = {f: n for f, n in lengths.items() if n > LONGER_FILES.get(f, (MAX_LINES, ""))[0]}
    assert not long, f"over {MAX_LINES} lines (or LONGER_FILES' allowance): {long}"


def test_longer_lessons_are_still_lessons():
    assert set(LONGER) <= set(lessons()), set(LONGER) - set(lessons())
