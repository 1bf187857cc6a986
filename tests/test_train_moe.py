"""Issue 16: the GPT with MoE blocks on a dp x ep mesh (transformer_basics/train_moe.py).
`python lesson.py --nproc 4` (dp 2 x ep 2), the warm launcher at 2 (dp 1 x ep 2), 1 and 4 with
--ep 4; --ep that does not divide the ranks, --experts not a multiple of --ep, --top-k out of range
and a --block-size longer than the corpus allows are refused in one line. The experts' gradient
sum broken two ways (/ dp instead of / N, over the world instead of dp) is a pair of source
mutations in tests/test_mutations.py."""

import re

import pytest
from harness import assert_fails, assert_ok, run_lesson

LESSON = "transformer_basics/train_moe.py"
T = 240  # seconds: generous, the CI machine is small and shared
LAYERS, EXPERTS, EMBD, HIDDEN, STEPS = 2, 8, 32, 64, 3  # the lesson's defaults
ROWS = re.compile(
    r"^\[rank (\d+)\] dp (\d+), ep (\d+): experts (\d+)\.\.(\d+) of each layer; rows sent to / "
    r"received from the other ep ranks per step: \[([\d, ]+)\] / \[([\d, ]+)\]$",
    re.M,
)
STATE = re.compile(
    r"^\[rank (\d+)\] state ([\d,]+) B = parameters ([\d,]+) \(experts ([\d,]+)\) \+ gradients "
    r"\+ AdamW's 2 moments; per step: (\S+) all_to_all, (\S+) all_reduce$",
    re.M,
)
DIFFS = re.compile(
    r"^\[rank (\d+)\] largest difference from one process: loss (\S+), parameters (\S+)$", re.M
)


def number(text):
    return int(text.replace(",", ""))  # 820,224 -> 820224


def check_report(out, nproc, ep):
    rows = ROWS.findall(out)
    assert [int(r[0]) for r in rows] == list(range(nproc)), out
    local, sent, received = EXPERTS // ep, {}, {}
    for rank, dp_rank, ep_rank, lo, hi, s, r in rows:
        rank = int(rank)
        # rows of the mesh: neighbouring ranks
        assert (int(dp_rank), int(ep_rank)) == divmod(rank, ep), out
        assert (int(lo), int(hi)) == (rank % ep * local, rank % ep * local + local - 1), out
        sent[rank], received[rank] = (
            [int(v) for v in s.split(", ")],
            [int(v) for v in r.split(", ")],
        )
        assert len(sent[rank]) == STEPS and (
            ep > 1 or sent[rank] == received[rank] == [0] * STEPS
        ), out
    # inside each ep row, what leaves a rank arrives at another, step by step
    for row in range(nproc // ep):
        members = range(row * ep, row * ep + ep)
        assert [sum(sent[m][i] for m in members) for i in range(STEPS)] == [
            sum(received[m][i] for m in members) for i in range(STEPS)
        ], out
    states = STATE.findall(out)
    assert [int(s[0]) for s in states] == list(range(nproc)), out
    for _, state, params, experts, all_to_all, all_reduce in states:
        # float32 parameters, their gradients and AdamW's two moments: four times the parameters
        assert number(state) == 4 * number(params), out
        # W1 and W2 of E/ep experts, 4 B each
        assert number(experts) == LAYERS * 2 * local * EMBD * HIDDEN * 4, out
        # per MoE layer: counts, tokens, results in forward and the two token exchanges' gradients
        # in backward; one all_reduce for the dense gradients, one for the experts'
        assert (float(all_to_all), float(all_reduce)) == (5 * LAYERS, 2), out


@pytest.mark.parametrize(
    "nproc,launcher,args,ep",
    [
        (2, "warm", (), 2),
        (4, "python", (), 2),
        pytest.param(1, "warm", (), 1, marks=pytest.mark.quick),
        (4, "warm", ("--ep", "4"), 4),
    ],
)
def test_train_moe(nproc, launcher, args, ep):
    result = run_lesson(LESSON, *args, nproc=nproc, launcher=launcher, timeout=T)
    assert assert_ok(result).startswith(
        f"OK: MoE GPT on a {nproc // ep}x{ep} (dp x ep) mesh, {EXPERTS} experts "
        f"top-2: the losses of {STEPS} steps and the parameters equal"
    ), result
    check_report(result.stdout, nproc, ep)
    diffs = DIFFS.findall(result.stdout)
    assert [int(d[0]) for d in diffs] == list(range(nproc)), result
    assert all(float(loss) <= 2e-5 and float(params) <= 2e-5 for _, loss, params in diffs), result


@pytest.mark.parametrize(
    "args,message",
    [
        (("--ep", "3"), "--ep 3 must divide the 2 ranks: pick a divisor of 2"),
        (("--experts", "7"), "--experts 7 must be a multiple of --ep 2: pick --experts 6"),
        (("--top-k", "9"), "--top-k must be between 1 and --experts (8), got 9"),
        # the generated corpus (67,258 tokens) holds no 10 windows of 10,000 tokens
        (("--block-size", "10000"), "shorter than the 100010 needed"),
    ],
)
def test_bad_flags_are_one_line(args, message):
    result = run_lesson(LESSON, *args, nproc=2, launcher="warm", timeout=T)
    assert_fails(result, message, within=2)
    assert "Traceback" not in result.output, result
