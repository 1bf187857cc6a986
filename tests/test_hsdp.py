"""Issue 15: HSDP (fsdp_basics/hsdp.py). `python lesson.py --nproc 2` as 2x1, the warm launcher at 4
ranks (2x2), as 1x2 (--replicas 1) and at 1 rank; a --replicas that does not divide the world is
refused. The mistakes its checks catch (mesh["shard"] where the 2-D mesh was meant, with and
without the first check loosened; one probe batch for every replica; a transposed mesh; swapped dim
names) are rows of tests/test_mutations.py."""

import json
import re

import pytest

from harness import assert_fails, assert_ok, run_lesson

LESSON = "fsdp_basics/hsdp.py"
T = 240  # seconds: generous, the CI machine is small and shared
RUNS = [
    (4, None, "warm"),
    (2, 2, "python"),
    pytest.param(2, 1, "warm", marks=pytest.mark.quick),
    (1, None, "warm"),
]


@pytest.mark.parametrize("nproc,replicas,launcher", RUNS)
def test_hsdp(nproc, replicas, launcher):
    args = ["--replicas", str(replicas)] if replicas else []
    result = run_lesson(LESSON, *args, nproc=nproc, launcher=launcher, timeout=T)
    ok = assert_ok(result)
    # the lesson's default: the smallest divisor of N above 1 (1 at N = 1)
    R = replicas or min((r for r in range(2, nproc + 1) if nproc % r == 0), default=1)
    S = nproc // R
    assert ok.startswith(f"OK: HSDP on {R}x{S} ranks trains like one process for 10 steps"), ok
    out = result.stdout
    assert f"mesh {(R, S)} ('replicate', 'shard'): " in out, out
    # each rank: its two groups, the placements, 1/S of the model (64 and 4 rows divide by S here)
    ranks = re.findall(
        r"^\[rank (\d+)\] groups (.+?); blocks\.0\.fc\.weight \(Replicate\(\), Shard\(dim=0\)\) "
        r"local \((\d+), 64\) of \(64, 64\); params (\d+) B of (\d+) B",
        out,
        re.M,
    )
    assert len(ranks) == nproc, out
    for rank, groups, rows, mine, whole in ranks:
        r = int(rank)
        shard, replicate = list(range(r // S * S, r // S * S + S)), list(range(r % S, nproc, S))
        found = {name: json.loads(g) for name, g in re.findall(r"(\w+) (\[[\d, ]*\])", groups)}
        assert found == {"shard": shard, "replicate": replicate}, (r, groups)
        assert int(rows) == 64 // S and int(mine) * S == int(whole), (r, rows, mine, whole)
    # the collectives of a step: 3 FSDP groups (2 blocks + root); gathers/scatters only where S > 1
    steps = re.findall(r"^\[rank \d+\] one step ran: (.+)$", out, re.M)
    gathers = "5 all_gather_single (shard), 3 reduce_scatter_single (shard), " if S > 1 else ""
    assert steps == [gathers + "3 all_reduce (replicate)"] * nproc, out
    # the mistakes table: the 2-D mesh holds 1/S, the 1-D mesh of all ranks 1/N; only
    # mesh["shard"] drifts
    table = {
        label.strip(): (float(share), int(ar), float(spread))
        for label, share, ar, spread in re.findall(
            r"^  (.+?)  +\(.*?\)  +(\S+)  +(\d+)  +(\S+)$", out, re.M
        )
    }
    flat, two_d = table[f"1-D mesh of all {nproc} ranks"], table[f"2-D mesh ({R}, {S})"]
    assert flat[:2] == (pytest.approx(1 / nproc, abs=1e-3), 0), table
    assert two_d[:2] == (pytest.approx(1 / S, abs=1e-3), 3), table
    assert table['mesh["shard"]'][1] == 0 and (table['mesh["shard"]'][2] > 1e-3) == (R > 1), table
    assert flat[2] == two_d[2] == 0, table


def test_replicas_must_divide_the_world():
    result = run_lesson(LESSON, "--replicas", "3", nproc=2, launcher="warm", timeout=T)
    assert_fails(result, "error: --replicas 3 must divide the 2 ranks", within=2)
    assert "Traceback" not in result.output, result.output
