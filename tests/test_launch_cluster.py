"""The launchers that need a real cluster, run for real on this machine: a single-node
Slurm cluster (munged, slurmctld, slurmd started here with a config of our own) that runs
launch/slurm.sbatch and launch/preemption.sbatch (a signal, a requeue, a resume), and two "hosts"
in network namespaces (launch/netns_two_hosts.sh).
Both need root; .ci/install_system_packages.sh installs the packages. Without them the
tests skip and say why."""

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

from harness import ROOT, free_port

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
SLURM_TOOLS = ["munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol"]
MISSING_SLURM = [t for t in SLURM_TOOLS if shutil.which(t) is None]


def run(command, env=None, timeout=120, cwd=ROOT):
    return subprocess.run(
        command, cwd=cwd, env=env, text=True, capture_output=True, timeout=timeout
    )


def stop(pid_file):
    try:
        pid = int(open(pid_file).read().strip())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
        for _ in range(50):  # up to 5 s, then no mercy
            os.kill(pid, 0)
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="session")  # session, not module: kept while the worker runs other modules
def slurm(tmp_path_factory):
    """Start munged, slurmctld and slurmd on free ports; yield the environment for sbatch."""
    if not IS_ROOT:
        pytest.skip("the Slurm test starts slurmctld/slurmd/munged itself and needs root")
    if MISSING_SLURM:
        pytest.skip(
            f"Slurm is not installed ({', '.join(MISSING_SLURM)} missing): "
            "run .ci/install_system_packages.sh as root"
        )
    d = tmp_path_factory.mktemp("slurm")
    (d / "state").mkdir()
    (d / "spool").mkdir()
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    host = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text(f"""ClusterName=tutorial
SlurmctldHost={host}
SlurmctldPort={free_port(hold=False)}
SlurmdPort={free_port(hold=False)}
AuthType=auth/munge
AuthInfo=socket={d}/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_CONF=str(conf), PYTHONUNBUFFERED="1")
    pid_files = [d / "slurmd.pid", d / "slurmctld.pid", d / "munged.pid"]
    try:
        started = [
            run(
                [
                    "munged",
                    "--force",
                    f"--key-file={key}",
                    f"--socket={d}/munge.socket",
                    f"--pid-file={d}/munged.pid",
                    f"--log-file={d}/munged.log",
                    f"--seed-file={d}/munged.seed",
                ]
            ),
            run(["slurmctld", "-i"], env=env),
            run(["slurmd"], env=env),
        ]
        for result in started:
            assert result.returncode == 0, f"{result.args} failed: {result.stderr}"
        deadline = time.monotonic() + 60
        while "idle" not in run(["sinfo", "-h", "-o", "%T"], env=env).stdout:
            assert time.monotonic() < deadline, (
                "the Slurm node never became idle:\n" + (d / "slurmd.log").read_text()[-2000:]
            )
            time.sleep(0.5)
        yield env, d
    finally:
        for pid_file in pid_files:
            stop(pid_file)


def sbatch(env, d, *args):
    env = dict(env, LOG_DIR=str(d / "logs"), MASTER_PORT=str(free_port()))
    out = d / f"job-{time.monotonic_ns()}.out"
    result = run(
        ["sbatch", "--wait", f"--output={out}", "launch/slurm.sbatch", *args], env=env, timeout=240
    )
    return result, out.read_text() if out.exists() else ""


def test_slurm_batch_job_runs_a_lesson(slurm):
    env, d = slurm
    result, output = sbatch(env, d, "primitives/hello_distributed.py")
    print(output)
    assert result.returncode == 0, f"{result.stdout}{result.stderr}\n{output}"
    assert "rendezvous" in output and "OK: 2 rank(s) said hello" in output, output
    assert "rank 0/2" in output and "rank 1/2" in output, output
    rank_logs = sorted(p.parent.name for p in (d / "logs").rglob("stdout.log"))
    assert rank_logs == ["0", "1"], rank_logs  # one log folder per local rank


def test_slurm_batch_job_with_a_missing_lesson_fails_in_one_line(slurm):
    env, d = slurm
    result, output = sbatch(env, d, "primitives/no_such_lesson.py")
    assert result.returncode != 0
    assert output.strip().startswith(
        "error: lesson file 'primitives/no_such_lesson.py' not found"
    ), output


def wait_until(condition, what, seconds=240, shown=lambda: ""):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}\n{shown()}"
        time.sleep(0.2)


def test_slurm_preemption_saves_requeues_and_resumes(slurm, tmp_path):
    """launch/preemption.sbatch, 2 ranks (tasks of srun): `scancel --signal=USR1` mid-run; the ranks
    stop after the same step, save and exit 75, srun passes the 75 on, the script requeues the job.
    Slurm holds a requeued job about 2 minutes (its BeginTime; 124 s measured here) before it runs
    again: the test moves that closer. The second run resumes from the checkpoint and ends with the
    weights of a run never interrupted, bit for bit.
    Not to the same second, though: slurmd refuses a credential made in the second it revoked the
    last run's ("Killing non-startable batch JobId=N: Job credential revoked" in slurmctld.log; the
    hold exists for this), which a loaded machine reaches. The test moves it to 3 s from now."""
    from harness import run_lesson
    from test_preemption import DIGEST, STOPPED

    env, d = slurm
    out, log = tmp_path / "out", tmp_path / "job.out"
    env = dict(env, OUT=str(out), MASTER_PORT=str(free_port()))
    steps = ("--steps", "200")  # 10 s of steps at least: time for the signal to get through Slurm
    submitted = run(["sbatch", "--parsable", f"--output={log}", "launch/preemption.sbatch", *steps],
                    env=env)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]

    def text():
        return log.read_text() if log.exists() else ""

    def state():
        return run(["squeue", "-h", "-j", job, "-o", "%T"], env=env).stdout.strip()

    def shown():  # the job's output, then what Slurm said about it
        slurmctld = (d / "slurmctld.log").read_text().splitlines()
        return text() + "\nslurmctld.log:\n" + "\n".join(slurmctld[-12:])

    try:
        wait_until(lambda: "starting at step 0" in text(), "the first step", shown=shown)
        signalled = run(["scancel", "--signal=USR1", job], env=env)
        assert signalled.returncode == 0, signalled.stderr
        wait_until(lambda: "srun exited" in text(), "the first run's end", shown=shown)
        requeued = lambda: state() == "PENDING" or "run 1:" in text()  # noqa: E731
        wait_until(requeued, "the requeue", 60, shown=shown)
        if state() == "PENDING":  # held until its BeginTime: let it start soon
            moved = run(["scontrol", "update", f"JobId={job}", "StartTime=now+3"], env=env)
            assert moved.returncode == 0, moved.stderr
        ended = lambda: state() in ("", "COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL")  # noqa: E731
        wait_until(ended, "the second run's end", shown=shown)
        assert "srun exited 0" in text(), (
            f"the second run failed (job {state() or 'gone'})\n{shown()}"
        )
    finally:
        run(["scancel", job], env=env)
    output = text()
    print(output)
    (stop,) = STOPPED.findall(output)
    assert stop[0] == "SIGUSR1" and 0 < int(stop[1]) < 200, output
    assert f"job {job} run 0: srun exited 75" in output, output
    assert f"job {job} run 1: 2 rank(s) --resume" in output, output
    assert f"resumed at step {stop[1]} of 200" in output, output
    uninterrupted = run_lesson("launch/preemption.py", *steps, "--out", tmp_path / "whole",
                               nproc=2, launcher="warm", timeout=180)  # fmt: skip
    (ok,) = [line for line in output.splitlines() if line.startswith("OK")]
    assert DIGEST.search(ok).group(1) == DIGEST.search(uninterrupted.stdout).group(1), output


def netns_usable():
    if not IS_ROOT:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2 (ip) or util-linux (unshare) is not installed"
    name = f"tdprobe{os.getpid()}"
    if run(["ip", "netns", "add", name]).returncode != 0:
        return "this machine does not allow creating network namespaces"
    run(["ip", "netns", "del", name])
    return None


def test_two_hosts_in_network_namespaces():
    reason = netns_usable()
    if reason:
        pytest.skip(reason)
    before = run(["ip", "netns", "list"]).stdout
    result = run(
        ["bash", "launch/netns_two_hosts.sh", "primitives/hello_distributed.py"], timeout=180
    )
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: 4 rank(s) said hello" in result.stdout
    assert "master=10.77.0.1:" in result.stdout  # node 1 met node 0 at its own address
    for rank, host in [(0, "node0"), (1, "node0"), (2, "node1"), (3, "node1")]:
        assert f"rank {rank}/4 local_rank {rank % 2} host {host} " in result.stdout, result.stdout
    assert run(["ip", "netns", "list"]).stdout == before  # namespaces torn down


def test_netns_script_refuses_a_missing_lesson():
    result = run(["bash", "launch/netns_two_hosts.sh", "primitives/no_such_lesson.py"])
    assert result.returncode == 2
    assert result.stderr.startswith("error: lesson file 'primitives/no_such_lesson.py' not found")
