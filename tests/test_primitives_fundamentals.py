"""Issue 14 fundamentals: a broadcast whose shape only the source knows
(broadcast_unknown_shape.py), the memory and bytes of four collectives, measured
(collective_costs.py), and Work.get_future_result() in async_collectives.py at one rank (its
other runs, and the same line at 2 to 4 ranks, are in test_primitives.py). Each of the first
two: `python lesson.py --nproc 3`, and the warm launcher (torchrun's environment,
tests/warm_launcher.py) at 1, 2 and 4 ranks."""

import re

import pytest
from harness import assert_ok, run_lesson

T = 240  # seconds: generous, the CI machine is small and shared
LAUNCHERS = [
    (2, "warm"),
    (3, "python"),
    (1, "warm"),
    pytest.param(4, "warm", marks=pytest.mark.quick),
]


@pytest.mark.parametrize("nproc,launcher", LAUNCHERS)
def test_broadcast_unknown_shape(nproc, launcher):
    result = run_lesson(
        "primitives/broadcast_unknown_shape.py",
        "--seed",
        "3",
        nproc=nproc,
        launcher=launcher,
        timeout=T,
    )
    ok = assert_ok(result)
    second = min(1, nproc - 1)
    got = re.fullmatch(
        rf"OK: {nproc} rank\(s\) received float32 (\[[\d, ]+\]) from rank 0 then "
        rf"int64 (\[[\d, ]+\]) from rank {second}, .*",
        ok,
    )
    assert got, ok
    assert [s.count(",") + 1 for s in got.groups()] == [2, 3], ok  # a 2-D, then a 3-D tensor
    out = result.stdout
    for turn, (src, dtype, shape) in enumerate([(0, "float32", got[1]), (second, "int64", got[2])]):
        # what the source held before is what every rank holds after, shape, dtype and first values
        held = re.search(
            rf"^\[rank {src}\] turn {turn}, before: holds ({re.escape(f'{dtype} {shape}')}, .*)$",
            out,
            re.M,
        )
        assert held, out
        after = re.findall(
            rf"^\[rank (\d+)\] turn {turn}, after broadcast from rank {src}: (.*)$", out, re.M
        )
        assert sorted(int(r) for r, _ in after) == list(range(nproc)), out
        assert {v for _, v in after} == {held[1]}, out
        receivers = sum(
            f"turn {turn}, before: knows nothing of rank {src}'s tensor" in line
            for line in out.splitlines()
        )
        assert receivers == nproc - 1, out


def cost_tables(out):
    """{rank: {call: (allocated, sent, received) in KiB}} from the per-rank tables."""
    tables = {}
    for rank, call, *figures in re.findall(
        r"^\[rank (\d+)\] (\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M
    ):
        tables.setdefault(int(rank), {})[call] = tuple(map(float, figures))
    return tables


@pytest.mark.parametrize("nproc,launcher", LAUNCHERS)
def test_collective_costs(nproc, launcher):
    kib = 4 * 2**18 / 1024  # the default --size: 2**18 int32 per rank
    result = run_lesson("primitives/collective_costs.py", nproc=nproc, launcher=launcher, timeout=T)
    ok = assert_ok(result)
    # y, world*y gathered, the sum
    assert f"all_gather+sum allocated {nproc + 2:.1f}x all_reduce's memory" in ok, ok
    tables = cost_tables(result.stdout)
    assert sorted(tables) == list(range(nproc)), result.stdout
    for rank, t in tables.items():
        assert list(t) == ["scatter", "broadcast+slice", "all_reduce", "all_gather+sum"], t
        # storage sizes on CPU
        assert t["broadcast+slice"][0] == nproc * kib and t["all_reduce"][0] == kib, t
        assert t["all_gather+sum"][2] >= (nproc - 1) * kib, t  # received every other rank's piece
        if rank:
            assert (
                t["scatter"][0] == kib
                and t["scatter"][2] >= kib
                and t["broadcast+slice"][2] >= nproc * kib
            ), t
    if nproc == 1:
        assert "1 rank: nothing crosses a socket" in ok and all(
            v == 0 for v in tables[0]["scatter"][1:]
        ), ok
    else:
        root = tables[0]
        sent = re.search(r"root sent ([\d.]+) KiB to scatter, ([\d.]+) KiB to broadcast", ok)
        assert (
            sent
            and float(sent[1]) == root["scatter"][1]
            and float(sent[2]) == root["broadcast+slice"][1]
        ), ok
        assert (
            (nproc - 1) * kib <= root["scatter"][1] < nproc * kib <= root["broadcast+slice"][1]
        ), root
        assert "probe of 1048576 bytes counted within 4096" in ok, ok


def test_async_collectives_get_future_result_on_gloo_at_one_rank():
    # torch 2.13: Gloo's Work keeps the base Work::getFutureResult, which raises (Work.cpp); NCCL
    # gives a status code.
    result = run_lesson(
        "primitives/async_collectives.py",
        "--size",
        "1000",
        "--repeat",
        "1",
        nproc=1,
        launcher="warm",
        timeout=T,
    )
    assert_ok(result)
    lines = [line for line in result.stdout.splitlines() if line.startswith("get_future_result()")]
    assert lines == [
        "get_future_result(): not supported on gloo (Work::getFutureResult not implemented.); "
        "NCCL gives a status code"
    ], result.stdout
