"""Issue 15: HSDP (fsdp_basics/hsdp.py). Real torchrun at 4 ranks (2x2), `python lesson.py --nproc 2` as 2x1,
the warm launcher as 1x2 and at 1 rank; mesh["shard"] in place of the 2-D mesh (no all_reduce across replicas)
must fail the check against one process, and (that check loosened) the check of the collectives; a --replicas
that does not divide the world is refused."""

import json
import re

import pytest
from harness import assert_fails, assert_ok, run_lesson

LESSON = "fsdp_basics/hsdp.py"
T = 240  # seconds: generous, the CI machine is small and shared
RUNS = [
    (4, None, "torchrun"),
    (2, 2, "python"),
    pytest.param(2, 1, "warm", marks=pytest.mark.quick),
    (1, None, "warm"),
]


@pytest.mark.parametrize("nproc,replicas,launcher", RUNS)
def test_hsdp(nproc, replicas, launcher):
    args = ["--replicas", str(replicas)] if replicas else []
    result = run_lesson(LESSON, *args, nproc=nproc, launcher=launcher, timeout=T)
    ok = assert_ok(result)
    R = replicas or (2 if nproc % 2 == 0 and nproc >= 4 else 1)  # the lesson's default
    S = nproc // R
    assert ok.startswith(f"OK: HSDP on {R}x{S} ranks trains like one process for 10 steps"), ok
    out = result.stdout
    # each rank: its two groups, the placements, 1/S of the model (64 and 4 rows divide by S here: no padding)
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
        expected = (
            {"shard": shard, "replicate": replicate} if shard != replicate else {"replicate": shard}
        )
        found = {
            name: json.loads(ranks_) for name, ranks_ in re.findall(r"(\w+) (\[[\d, ]*\])", groups)
        }
        assert found == expected, (r, groups)
        assert int(rows) == 64 // S and int(mine) * S == int(whole), (r, rows, mine, whole)
    # the collectives of a step: 3 FSDP groups (2 blocks + root); gathers/scatters only where S > 1
    steps = re.findall(r"^\[rank \d+\] one step ran: (.+)$", out, re.M)
    gathers = "5 all_gather_single (shard), 3 reduce_scatter_single (shard), " if S > 1 else ""
    assert steps == [gathers + "3 all_reduce (replicate)"] * nproc, out
    # the mistakes table: the 2-D mesh holds 1/S, the 1-D mesh of all ranks 1/N; only mesh["shard"] drifts
    table = {
        label.strip(): (float(share), int(ar), float(spread))
        for label, share, ar, spread in re.findall(
            r"^  (.+?)  +\(.*?\)  +(\S+)  +(\d+)  +(\S+)$", out, re.M
        )
    }
    assert table[f"1-D mesh of all {nproc} ranks"][:2] == (pytest.approx(1 / nproc, abs=1e-3), 0), (
        table
    )
    assert table[f"2-D mesh ({R}, {S})"][:2] == (pytest.approx(1 / S, abs=1e-3), 3), table
    assert table['mesh["shard"]'][1] == 0 and (table['mesh["shard"]'][2] > 1e-3) == (R > 1), table
    assert table[f"1-D mesh of all {nproc} ranks"][2] == table[f"2-D mesh ({R}, {S})"][2] == 0, (
        table
    )


def test_shard_mesh_only_fails_the_check():
    """mesh["shard"] where the 2-D mesh was meant: each replica trains on its half of the batch alone."""
    result = run_lesson(LESSON, "--shard-mesh-only", nproc=4, launcher="warm", timeout=T)
    assert_fails(result, "RuntimeError: HSDP and one process differ by")
    got = re.search(r"max \|param diff\| (\S+) \(tolerance (\S+)\)", result.stdout)
    assert got and float(got[1]) > 100 * float(got[2]), result.output


def test_shard_mesh_only_fails_the_collectives_check():
    """The same, with the first check loosened (--tol 1): the recorded step has no all_reduce across replicas."""
    result = run_lesson(
        LESSON, "--shard-mesh-only", "--tol", "1", nproc=4, launcher="warm", timeout=T
    )
    assert_fails(
        result,
        "RuntimeError: expected 3 all_reduce (replicate) and 3 reduce_scatter_single (shard)",
    )
    assert re.search(
        r"^\[rank 0\] one step ran: 5 all_gather_single \(shard\), 3 reduce_scatter_single \(shard\)$",
        result.stdout,
        re.M,
    ), result.output


def test_the_mistakes_table_needs_different_batches_per_replica():
    """With one batch on every rank the replicas of mesh["shard"] agree without their all_reduce: the lesson's
    demonstration must then fail rather than print a table that shows nothing."""
    result = run_lesson(LESSON, "--same-probe-batch", nproc=4, launcher="warm", timeout=T)
    assert_fails(result, "RuntimeError: expected the 2-D mesh to hold more than the 1-D")
    assert re.search(r'mesh\["shard"\] to let the replicas drift apart \(0\.0', result.output), (
        result.output
    )


def test_replicas_must_divide_the_world():
    result = run_lesson(LESSON, "--replicas", "3", nproc=2, launcher="warm", timeout=T)
    assert_fails(result, "error: --replicas 3 must be at least 1 and divide the 2 ranks", within=2)
    assert "Traceback" not in result.output, result.output
