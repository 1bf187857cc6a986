"""Issue 16: expert parallelism (transformer_basics/expert_parallel.py). `python lesson.py
--nproc 1`, the warm launcher at 2, 4 and 3 (12 experts, top-3); 8 experts on 3 ranks is refused.
Each taught step removed on purpose (the count exchange, the differentiable all_to_all, the unsort
before the combine, the aux loss's gradient) is a source mutation in tests/test_mutations.py."""

import re

import pytest
from harness import assert_fails, assert_ok, run_lesson

LESSON = "transformer_basics/expert_parallel.py"
T = 240  # seconds: generous, the CI machine is small and shared
ROUTED = re.compile(
    r"^\[rank (\d+)\] experts (\d+)\.\.(\d+): sends \[([\d, ]+)\] rows to ranks 0\.\.\d+, "
    r"receives \[([\d, ]+)\]; its experts run on \[([\d, ]+)\] rows; aux loss (\S+)$",
    re.M,
)
ERRORS = re.compile(r"^\[rank (\d+)\] max relative error: (.+)$", re.M)
NAMES = ["output", "aux loss", "input gradient", "router gradient", "W1 gradient", "W2 gradient"]


def ints(text):
    return [int(v) for v in text.split(",")]


def check_routing(out, nproc, experts=8, top_k=2, tokens=16):
    rows = ROUTED.findall(out)
    assert [int(r[0]) for r in rows] == list(range(nproc)), out
    local = experts // nproc
    sends, recvs = {}, {}
    for rank, lo, hi, send, recv, per_expert, aux in rows:
        rank = int(rank)
        assert (int(lo), int(hi)) == (rank * local, rank * local + local - 1), out
        sends[rank], recvs[rank] = ints(send), ints(recv)
        assert sum(sends[rank]) == tokens * top_k, out  # dropless: every (token, choice) row leaves
        assert sum(ints(per_expert)) == sum(recvs[rank]) and len(ints(per_expert)) == local, out
        assert 0 < float(aux) <= experts, out  # E * sum f_e P_e with sum f_e = sum P_e = 1
    # pairwise agreement: what rank d receives from s is what s sends to d (the counts' exchange)
    assert all(recvs[d][s] == sends[s][d] for s in range(nproc) for d in range(nproc)), out


def check_errors(out, nproc):
    found = ERRORS.findall(out)
    assert [int(r) for r, _ in found] == list(range(nproc)), out
    for _, text in found:
        errors = {
            name: float(err) for name, err in (item.rsplit(" ", 1) for item in text.split(", "))
        }
        assert list(errors) == NAMES and max(errors.values()) < 1e-5, text


@pytest.mark.parametrize(
    "nproc,launcher,args",
    [
        (2, "warm", ()),
        (1, "python", ()),
        pytest.param(4, "warm", (), marks=pytest.mark.quick),
        (3, "warm", ("--experts", "12", "--top-k", "3")),
    ],
)
def test_expert_parallel(nproc, launcher, args):
    result = run_lesson(LESSON, *args, nproc=nproc, launcher=launcher, timeout=T)
    experts, top_k = (12, 3) if args else (8, 2)
    assert assert_ok(result).startswith(
        f"OK: expert parallelism over {nproc} rank(s), {experts} experts, "
        f"top-{top_k} dropless: output, aux loss and every gradient equal"
    ), result
    check_routing(result.stdout, nproc, experts, top_k)
    check_errors(result.stdout, nproc)


def test_experts_not_divisible_is_one_line():
    result = run_lesson(LESSON, nproc=3, launcher="warm", timeout=T)
    assert_fails(
        result, "--experts 8 must be a multiple of the 3 ranks: pick --experts 6 or 9", within=3
    )
    assert "Traceback" not in result.output, result
