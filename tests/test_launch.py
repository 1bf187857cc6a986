"""Every way launch/ starts a job, run for real on this machine: print_env under torchrun,
two loopback "nodes" (static and c10d rendezvous), mp.spawn and mp.Process (with a failing
child: the parent fails and no child is left), torch.distributed.launch (with and without
--use-env), and elastic torchrun (a rank killed mid-run, then a node joining). The README's
environment-variable table is checked against what print_env prints.
Slurm and the network-namespace hosts are in test_launch_cluster.py."""

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from harness import ROOT, assert_fails, assert_ok, free_port, lesson_env, run_command, run_lesson

TIMEOUT = 180  # a launch takes seconds on an idle machine; a hang is caught, not waited out
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SHARED_STORE_OFF = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # see launch/elastic.py


@pytest.fixture(scope="session")  # session, not module: kept while the worker runs other modules
def print_env_3():
    return run_lesson("launch/print_env.py", nproc=3, timeout=TIMEOUT)


@pytest.mark.quick
def test_print_env_torchrun_one_node_three_ranks(print_env_3):
    ok = assert_ok(print_env_3)
    assert ok.startswith("OK: 3 rank(s) on 1 node(s) via torchrun"), ok
    out = print_env_3.stdout
    for r in range(3):
        assert (
            f"[rank {r}] RANK={r} LOCAL_RANK={r} GROUP_RANK=0 ROLE_RANK={r} LOCAL_WORLD_SIZE=3 "
            in out
        ), out
    shared = re.search(r"^shared by all ranks: (.*)$", out, re.M)
    assert shared and "WORLD_SIZE=3 GROUP_WORLD_SIZE=1 " in shared.group(1), out
    port = re.search(r"--master_port=(\d+)", " ".join(print_env_3.command)).group(1)
    assert f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} " in shared.group(1), out


def test_print_env_spawned_has_no_torchrun_variables():
    """`python launch/print_env.py --nproc 2`, as its docstring shows: the ranks come from
    mp.spawn."""
    result = run_lesson("launch/print_env.py", nproc=2, launcher="python", timeout=TIMEOUT)
    ok = assert_ok(result)
    assert ok.startswith("OK: 2 rank(s)") and "via torchrun" not in ok, ok


def test_print_env_check_catches_an_inconsistent_launch():
    # the lesson's own checks, fed environments that do not add up
    from launch.print_env import check

    good = [
        dict(
            RANK=str(r),
            LOCAL_RANK=str(r % 2),
            LOCAL_WORLD_SIZE="2",
            GROUP_RANK=str(r // 2),
            ROLE_RANK=str(r),
            WORLD_SIZE="4",
            GROUP_WORLD_SIZE="2",
            MASTER_PORT="29500",
        )
        for r in range(4)
    ]
    assert check(good, 4) == []
    swapped = [dict(v) for v in good]
    swapped[2]["GROUP_RANK"], swapped[0]["GROUP_RANK"] = "0", "1"  # node ranks mixed up
    assert any("RANK != GROUP_RANK" in p for p in check(swapped, 4))
    # two jobs, not one
    split = [dict(v, MASTER_PORT="29501") if int(v["RANK"]) >= 2 else v for v in good]
    assert any("disagree on MASTER_PORT" in p for p in check(split, 4))
    assert any("but the process group has 3" in p for p in check(good[:3], 3))


def readme_variables():
    """(variable, set by) for each row of the environment-variable table in launch/README.md."""
    text = (ROOT / "launch" / "README.md").read_text()
    table = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([A-Z_]+)` \| ([^|]+) \|", table, re.M)
    assert len(rows) > 10, table
    return {name: by.strip() for name, by in rows}


def test_readme_variable_table_matches_print_env(print_env_3):
    assert_ok(print_env_3)
    printed = set(re.findall(r"\b([A-Z][A-Z_]+)=", print_env_3.stdout))
    table = readme_variables()
    from_torchrun = {name for name, by in table.items() if "torchrun" in by}
    assert from_torchrun - printed == set(), (
        "in the README as set by torchrun, but not printed under torchrun"
    )
    assert printed - from_torchrun == set(), (
        "printed under torchrun, but missing from the README table"
    )
    slurm = {name for name, by in table.items() if "Slurm" in by}
    source = (ROOT / "launch" / "print_env.py").read_text()
    assert slurm and all(f'"{name}"' in source for name in slurm), (
        "print_env.py must print the Slurm rows"
    )


def multinode(mode, lesson, *args, nproc_per_node=2):
    port = free_port()
    result = run_command(
        ["bash", "launch/multinode_local.sh", mode, lesson, *args],
        timeout=TIMEOUT,
        env={"MASTER_PORT": str(port), "NPROC_PER_NODE": str(nproc_per_node)},
    )
    return result, port


@pytest.mark.quick
def test_two_loopback_nodes_static_rendezvous():
    result, port = multinode("static", "launch/print_env.py")
    assert f"2 nodes x 2 rank(s), static rendezvous on 127.0.0.1:{port}" in result.stdout, str(
        result
    )
    ok = assert_ok_line_of_node(result)
    assert "OK: 4 rank(s) on 2 node(s) via torchrun" in ok, ok
    for r in range(4):  # --node_rank fixed each node's block of ranks
        line = (
            f"[node0] [rank {r}] RANK={r} LOCAL_RANK={r % 2} GROUP_RANK={r // 2} ROLE_RANK={r} "
            "LOCAL_WORLD_SIZE=2 "
        )
        assert line in result.stdout, result.stdout
    # node 0's store
    assert f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} " in result.stdout, result.stdout


def assert_ok_line_of_node(result):
    assert not result.timed_out and result.returncode == 0, str(result)
    lines = [line for line in result.stdout.splitlines() if re.match(r"\[node[01]\] OK", line)]
    assert len(lines) == 1, str(result)
    return lines[0]


def test_two_loopback_nodes_c10d_rendezvous_trains():
    result, port = multinode(
        "c10d", "ddp_basics/manual_data_parallel.py", "--epochs", "1", nproc_per_node=1
    )
    assert f"2 nodes x 1 rank(s), c10d rendezvous on 127.0.0.1:{port}" in result.stdout, str(result)
    # one job of 2
    assert re.search(r"\[node[01]\] \[setup\] 2 rank\(s\)", result.stdout), result.stdout
    ok = assert_ok_line_of_node(result)
    assert (
        "OK: 2 ranks, 1 epochs, all_reduce SUM then /N of the gradients matches single-process"
        in ok
    ), ok


def test_multinode_script_refuses_a_missing_lesson():
    result = run_command(
        ["bash", "launch/multinode_local.sh", "static", "launch/no_such.py"], timeout=30
    )
    assert (
        result.returncode == 2
        and "error: lesson file 'launch/no_such.py' not found" in result.stderr
    )


FAKE_HOST_TOOLS = {
    # What netns_two_hosts.sh needs from the system, faked: root, iproute2, unshare and torchrun.
    "id": "echo 0",
    # run the command "in" the namespace
    "ip": '[ "$1 $2" = "netns exec" ] && { shift 3; exec "$@"; }; exit 0',
    "unshare": 'while [ "${1#--}" != "$1" ]; do shift; done; exec "$@"',
    "hostname": "exit 0",
    # Node 0 prints a line; node 1 prints only torchrun's notice, which the script filters out.
    "torchrun": 'case "$*" in *--node_rank=0*) echo "OK: node 0 on $GLOO_SOCKET_IFNAME";; '
    '*) echo "Setting OMP_NUM_THREADS environment variable for each process to be 1";; esac; '
    'exit "${FAKE_TORCHRUN_EXIT:-0}"',
}


@pytest.mark.parametrize("exit_code", [0, 3])
def test_netns_script_keeps_the_exit_code_of_its_nodes(tmp_path, exit_code):
    """A node whose every line is filtered out is not a failure (grep -v exits 1 then, and the
    script runs under set -o pipefail); a node that fails still fails the script with its code.
    The real run (root, namespaces) is tests/test_launch_cluster.py."""
    for name, body in FAKE_HOST_TOOLS.items():
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name).chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "FAKE_TORCHRUN_EXIT": str(exit_code)}
    result = run_command(
        ["bash", "launch/netns_two_hosts.sh", "primitives/hello_distributed.py"],
        timeout=30,
        env=env,
    )
    assert result.returncode == exit_code, str(result)
    assert "[node0] OK: node 0 on vA" in result.stdout, str(result)
    assert "[node1]" not in result.stdout, str(result)  # its only line was filtered


def children_left(marker):
    """Pids of live processes whose environment carries marker (waits up to 5 s for them to go)."""
    needle = f"LAUNCH_TEST_MARKER={marker}".encode()
    for _ in range(50):
        pids = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.append(int(pid))
            except OSError:  # gone already, or not ours to read
                pass
        if not pids:
            return []
        time.sleep(0.1)
    return pids


@pytest.mark.quick
@pytest.mark.parametrize("method,nproc", [("spawn", 2), ("process", 2)])
def test_spawn_template(method, nproc):
    result = run_command(
        [sys.executable, "launch/spawn_template.py", "--method", method, "--nproc", nproc],
        timeout=TIMEOUT,
    )
    assert (
        assert_ok(result) == f"OK: {nproc} rank(s) started with {method}, joined, all exit codes 0"
    )
    total = nproc * (nproc + 1) // 2
    assert sorted(
        re.findall(rf"^rank (\d): all_reduce of rank\+1 = {total}$", result.stdout, re.M)
    ) == [str(r) for r in range(nproc)], result.stdout


@pytest.mark.parametrize("method,nproc", [("spawn", 2), ("process", 3)])
@pytest.mark.skipif(
    not os.path.isdir("/proc"), reason="scanning for left-over children needs /proc"
)
def test_spawn_template_failing_child_stops_the_rest(method, nproc):
    marker = uuid.uuid4().hex
    result = run_command(
        [
            sys.executable,
            "launch/spawn_template.py",
            "--method",
            method,
            "--nproc",
            nproc,
            "--fail-rank",
            "1",
        ],
        timeout=TIMEOUT,
        env={"LAUNCH_TEST_MARKER": marker},
    )
    assert_fails(result, "RuntimeError: rank 1 fails on purpose (--fail-rank)")
    assert result.returncode == 1, str(result)
    if method == "spawn":
        assert (
            "parent: a rank failed, mp.spawn stopped the rest: RuntimeError: rank 1 fails"
            in result.stdout
        )
    else:  # the others were waiting in init_process_group and got SIGTERM
        assert (
            f"parent: exit codes by rank [-{signal.SIGTERM:d}, 1, -{signal.SIGTERM:d}]"
            in result.stdout
        )
    assert children_left(marker) == [], "children of the failed run are still running"


@pytest.mark.quick
@pytest.mark.parametrize("use_env", [False, True])
def test_legacy_torch_distributed_launch(use_env):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.launch",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *(["--use-env"] if use_env else []),
        "launch/legacy_launch.py",
    ]
    result = run_command(command, timeout=TIMEOUT)
    ok = assert_ok(
        result,
        deprecated_on_purpose=r"FutureWarning: The module torch.distributed.launch is deprecated",
    )
    source = "environment LOCAL_RANK" if use_env else "argument --local-rank"
    assert f"OK: 2 rank(s) found their local rank from the {source}" in ok, ok
    for r in range(2):
        assert f"[rank {r}] local rank {r} from the {source}; device cpu" in result.stdout, (
            result.stdout
        )


@pytest.mark.parametrize(
    "argument,env,source",
    [
        (
            ["--local_rank=0"],
            {},
            "argument --local-rank",
        ),  # a launcher that passes only the argument
        ([], {"LOCAL_RANK": "0"}, "environment LOCAL_RANK"),  # torchrun: only the variable
        (
            ["--local-rank=0"],
            {"LOCAL_RANK": "0"},
            "argument --local-rank",
        ),  # torch.distributed.launch: both
    ],
)
def test_legacy_launch_argument_else_local_rank(argument, env, source):
    """One rank started by hand with what a launcher sets, each way legacy_launch.py accepts."""
    started = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    result = run_command(
        [sys.executable, "launch/legacy_launch.py", *argument],
        timeout=TIMEOUT,
        env={**started, **env},
    )
    assert f"OK: 1 rank(s) found their local rank from the {source}" in assert_ok(result), str(
        result
    )
    assert f"[rank 0] local rank 0 from the {source}; device cpu" in result.stdout, str(result)


@pytest.mark.parametrize(
    "argument,env,error",
    [
        ([], {}, "error: no --local-rank argument and no LOCAL_RANK variable"),
        (
            ["--local-rank=1"],
            {"LOCAL_RANK": "0"},
            "error: --local-rank 1 disagrees with LOCAL_RANK=0",
        ),
    ],
)
def test_legacy_launch_refuses_a_missing_or_conflicting_local_rank(argument, env, error):
    started = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    result = run_command(
        [sys.executable, "launch/legacy_launch.py", *argument],
        timeout=TIMEOUT,
        env={**started, **env},
    )
    assert_fails(result, error)
    assert "Traceback" not in result.output, str(result)  # one line, as ctx.require prints it


def elastic_command(port, run_id, *args, nproc=2, max_restarts=1):
    return [
        *TORCHRUN,
        "--nnodes=1:2",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        "--rdzv-conf=last_call_timeout=1",
        "launch/elastic.py",
        "--timeout",
        "20",
        *args,
    ]


def serial_state(steps, batch=1000):
    from launch.elastic import serial  # the lesson's own reference, recomputed here

    return serial(steps, batch)


@pytest.mark.quick
def test_elastic_restart_after_a_rank_dies(tmp_path):
    command = elastic_command(
        free_port(), uuid.uuid4().hex[:8], "--fail-at-step", "5", "--ckpt-dir", tmp_path
    )
    result = run_command(command, timeout=TIMEOUT, env=SHARED_STORE_OFF)
    ok = assert_ok(result)
    assert "[rank 1] dying at step 5 (--fail-at-step)" in result.stdout, result.stdout
    assert "start: restart 1, world size 2, resuming at step 5" in result.stdout, result.stdout
    assert f"OK: 20 steps, final state {serial_state(20)} equals" in ok, ok
    assert "2 attempt(s): 2 ranks from step 0 -> 2 ranks from step 5" in ok, ok


def test_elastic_refuses_the_shared_agent_store():
    result = run_command(
        elastic_command(free_port(), "shared", nproc=1, max_restarts=0), timeout=TIMEOUT
    )
    assert_fails(result, "error: the agent shares its store")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in result.stderr


def test_elastic_membership_change_a_node_joins(tmp_path):
    """Agent A runs alone (1 rank); agent B joins mid-run: both restart as one job of 2 ranks."""
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    # A must still be running when B has imported torch and joined the rendezvous: 30 s of steps
    # (12 s was too short twice at load average 25, when B's start alone took longer)
    steps = 150
    args = ["--steps", steps, "--step-time", "0.2", "--ckpt-dir", tmp_path]

    def start():
        return subprocess.Popen(
            [str(c) for c in elastic_command(port, run_id, *args, nproc=1)],
            cwd=ROOT,
            env=lesson_env(SHARED_STORE_OFF),
            text=True,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    agents = [start()]
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (tmp_path / "elastic.pt").exists():  # A has done a step: it is running alone
            assert agents[0].poll() is None and time.monotonic() < deadline, agents[
                0
            ].communicate()[0]
            time.sleep(0.1)
        agents.append(start())
        outputs = [a.communicate(timeout=max(1, deadline - time.monotonic()))[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outputs)
    ok = [line for out in outputs for line in out.splitlines() if line.startswith("OK")]
    assert len(ok) == 1, "\n".join(outputs)
    grew = re.search(r"2 attempt\(s\): 1 ranks from step 0 -> 2 ranks from step (\d+)$", ok[0])
    # grew mid-run and went on from the checkpoint
    assert grew and 0 < int(grew.group(1)) < steps, ok[0]
    assert f"final state {serial_state(steps)} equals" in ok[0], ok[0]
