"""A test launcher that behaves like `torchrun --nproc_per_node=N --master_addr=127.0.0.1` but skips
the ~1.5 s `import torch` of every rank: a warm server process imports torch once, and each run's
ranks are forked from it.

    from warm_launcher import run    # tests/harness.run_lesson(..., launcher="warm") calls this
    command, returncode, stdout, stderr, timed_out, rank_codes = run(
        script, args, nproc, env, cwd, timeout
    )

    python tests/warm_launcher.py --nproc_per_node=3 primitives/broadcast.py   # the same, by hand

Processes of one run (the test's pytest process is the client):

    server (one per pytest process and start-up environment, torch imported, single-threaded)
      `- supervisor of run k  (fork; own session, so its pid is the run's process group)
           |- rank 0 ... rank N-1   (fork; environment as torchrun gives it; lesson run as __main__)
           `- hosts the "agent" TCPStore on MASTER_PORT, as torchrun's agent does

- Start: the client sends the request (script, args, nproc, env, cwd) over a Unix socket together
  with three file descriptors: the write ends of its stdout and stderr pipes and one end of a
  per-run socket. The server forks a supervisor, which binds MASTER_PORT (port 0: no free-port
  race), forks the ranks, then serves the TCPStore on that already-listening socket (ranks that
  connect earlier wait in the listen backlog) and reports {"pid", "port"} on the run socket.
- Each rank: the environment torchrun 2.13 gives a worker (RANK, LOCAL_RANK, GROUP_RANK,
  ROLE_RANK, ROLE_NAME, *_WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID=none,
  TORCHELASTIC_USE_AGENT_STORE=True, TORCHELASTIC_RESTART_COUNT/MAX_RESTARTS/ERROR_FILE/
  SIGNALS_TO_HANDLE, TORCH_NCCL_ASYNC_ERROR_HANDLING, OMP_NUM_THREADS=1 when N > 1 and not set),
  sys.argv = [script, *args], sys.path[0] = the script's folder, cwd as asked; then
  runpy.run_path(script, run_name="__main__") and an exit like the interpreter's (SystemExit
  codes, traceback and code 1 on an exception, non-daemon threads joined, atexit handlers run,
  streams flushed), then os._exit: objects still alive are not finalised (a FileStore left
  referenced does not remove its file: keep real torchrun for tests of that).
- Output: every rank writes straight into the client's two pipes (fd 1 and 2), as torchrun's workers
  write into torchrun's stdout/stderr: lines of different ranks interleave, nothing is lost or
  buffered by the launcher.
- Failures: like torchrun, the supervisor waits for every rank; the first rank that exits non-zero
  (or dies of a signal) makes it send SIGTERM to the others and SIGKILL after GRACE_S seconds. It
  then writes one summary line to stderr and reports every rank's exit code; the run's return code
  is 0 when all ranks exited 0, else 1 (torchrun's code for a failed worker).
- Time-outs: the client owns the clock. At the deadline it kills the run's whole process group
  (supervisor, ranks and anything they started) with SIGKILL. After a normal end it kills the group
  too, while the supervisor still waits for the client (so the group id cannot have been reused), so
  no process of a run outlives it. If the client dies, the supervisor sees its socket close and
  kills the group; the server exits when its control socket closes.

Fork safety: forking a process that has threads copies only the forking thread, and locks held by
the others stay locked forever in the child. `import torch` (+ numpy with OMP_NUM_THREADS=1) starts
no thread, so the SERVER MUST NEVER start one: it computes nothing with torch, creates no store,
sets no torch thread settings (each rank sets its own, as launch/dist_setup.py does) and checks
/proc/self/task before every fork (it refuses the run otherwise). The supervisor starts threads (the
TCPStore server) only after it has forked all its ranks.

What differs from real torchrun (keep real torchrun for tests that depend on it, and for each
lesson's reader-facing run):
- No agent: no --max-restarts / --standalone / rendezvous back-ends, no elastic restarts, no
  torchrun output (its "ChildFailedError" report with one Traceback: warm prints one summary line
  instead), GRACE_S is 5 s where torchrun waits 30 s; one node only.
- Each torchrun worker is its own session and process group (SIGTERM goes to the group); here all
  the ranks of a run share the supervisor's group, and their parent is the supervisor.
- All ranks of all runs of a server share one str hash seed (PYTHONHASHSEED): a bug that needs ranks
  to iterate a set in different orders shows under torchrun, not here.
- Variables read at process start (STARTUP_VARS: PYTHON*, OMP_*, TORCH_*, ...) work, but each
  distinct set costs a server start; OMP_NUM_THREADS=1 is in the server even for one rank
  (dist_setup sets the rank's torch threads anyway); stdin is /dev/null; `ps` shows ranks as
  `warm_launcher.py --serve`.
- The PRELOAD modules are already imported: a lesson's own start-up time is not what a reader sees.
- On a GPU machine the server must not touch CUDA before forking (it does not: import only); not
  tried on GPUs here.
"""

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

GRACE_S = 5  # SIGTERM -> SIGKILL, as torchrun does when one worker fails (it waits up to 30 s)
# What the lessons import that costs time (fsdp and pipelining pull in torch._dynamo: ~1 s each on
# an idle core). None of these starts a thread at import (serve() checks that before every fork).
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.multiprocessing",
    "numpy",
    "torch.nn.parallel",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
]
# Read once when a process (or torch/numpy/OpenMP/OpenBLAS) starts, so a forked rank cannot change
# them by setting os.environ: runs whose values differ get a server of their own.
STARTUP_VARS = (
    "PYTHON",
    "LD_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "MALLOC_",
    "TORCH_",
    "TORCHINDUCTOR_",
    "TORCHDYNAMO_",
    "CUDA_",
)
MAX_SERVERS = 3


# ------------------------------------------------------------------------------------------ server


def _threads():
    return len(os.listdir("/proc/self/task"))


def _send(sock, **message):
    sock.sendall((json.dumps(message) + "\n").encode())


def serve(control_fd):
    """Import torch once, then fork a supervisor per request until the control socket closes."""
    control = socket.socket(fileno=control_fd)
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    control.send(json.dumps({"ready": os.getpid(), "threads": _threads()}).encode())
    while True:
        while True:  # reap supervisors that have ended
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not select.select([control], [], [], 1.0)[0]:
            continue
        message, fds, _, _ = socket.recv_fds(control, 1 << 22, 3)
        if not message:
            return  # the client closed its end: the pytest process has ended
        request = json.loads(message)
        run_socket = socket.socket(fileno=fds[2])
        if _threads() != 1:  # see "Fork safety" above: never fork with threads
            _send(
                run_socket,
                error=f"warm launcher server has {_threads()} threads; forking it is unsafe",
            )
        elif os.fork() == 0:
            try:
                os.setsid()  # the run's process group: the client kills it as a whole
                control.close()
                _supervise(request, fds[0], fds[1], run_socket)
            except BaseException:
                import traceback

                traceback.print_exc()  # into the run's stderr once _supervise has redirected it
            finally:
                os.killpg(0, signal.SIGKILL)  # never leave ranks behind
        run_socket.close()
        os.close(fds[0])
        os.close(fds[1])


# -------------------------------------------------------------------------------------- supervisor


def _rank_env(request, rank, port, error_dir):
    nproc = request["nproc"]
    env = dict(request["env"])
    for key in [k for k in env if k.startswith("TORCHELASTIC_")]:
        del env[key]
    # torch/distributed/run.py: set to 1 "in default" when several workers share a node
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_NAME="default",
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_WORLD_SIZE="1",
        ROLE_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID="none",
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_ERROR_FILE=os.path.join(error_dir, "attempt_0", str(rank), "error.json"),
        TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
    )
    return env


def _supervise(request, out_fd, err_fd, run_socket):
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(512)
    port = listener.getsockname()[1]
    import tempfile

    error_dir = tempfile.mkdtemp(prefix="torchelastic_warm_")
    pids = {}
    for rank in range(request["nproc"]):
        env = _rank_env(request, rank, port, error_dir)
        os.makedirs(os.path.dirname(env["TORCHELASTIC_ERROR_FILE"]))
        pid = os.fork()
        if pid == 0:
            try:
                listener.close()
                run_socket.close()
                _rank_main(request, env)
            finally:
                os._exit(70)
        pids[pid] = rank
    _send(run_socket, pid=os.getpid(), port=port, ranks=sorted(pids, key=pids.get))
    # All ranks are forked: threads are allowed from here on. torchrun's agent hosts this store
    # (torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py) and its workers connect as
    # clients.
    import datetime
    import torch.distributed as dist

    try:  # the name keeps the store (and its server) alive while the ranks run
        store = dist.TCPStore(  # noqa: F841
            "127.0.0.1",
            port,
            1,
            True,
            datetime.timedelta(seconds=300),
            multi_tenant=True,
            master_listen_fd=listener.detach(),
        )
    except Exception as error:  # the ranks will fail to connect: say why
        os.write(2, f"warm_launcher: cannot host the store on port {port}: {error}\n".encode())
    codes, failed = _wait_for_ranks(pids, run_socket)
    if failed is not None:
        by_rank = [codes[r] for r in range(len(codes))]
        os.write(
            2,
            f"warm_launcher: rank {failed} failed first (exit code {codes[failed]}); the others "
            f"were stopped; exit codes by rank: {by_rank}\n".encode(),
        )
    import shutil

    shutil.rmtree(error_dir, ignore_errors=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # our copies of the pipes: the client reads to end of file
    os.dup2(devnull, 2)
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the ranks' CPU time, for measurements
    _send(
        run_socket,
        codes=[codes[r] for r in range(len(codes))],
        failed=failed,
        cpu_s=round(usage.ru_utime + usage.ru_stime, 3),
    )
    # wait until the client has killed our group (or gone): keeps the group id ours
    run_socket.recv(1)
    os._exit(0)


def _wait_for_ranks(pids, run_socket):
    """Wait for every rank like torchrun: the first failure stops the others.
    Returns (codes, failed)."""
    poller = select.poll()
    by_fd = {}
    for pid in pids:
        fd = os.pidfd_open(pid)
        by_fd[fd] = pid
        poller.register(fd, select.POLLIN)
    poller.register(run_socket.fileno(), select.POLLIN)
    codes, failed, kill_at = {}, None, None
    while len(codes) < len(pids):
        wait_ms = None if kill_at is None else max(0, int((kill_at - time.monotonic()) * 1000))
        for fd, _ in poller.poll(wait_ms):
            if fd == run_socket.fileno():  # the client is gone: end the run
                os.killpg(0, signal.SIGKILL)
            pid = by_fd[fd]
            poller.unregister(fd)
            os.close(fd)
            rank = pids[pid]
            codes[rank] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            if codes[rank] != 0 and failed is None:
                failed = rank
                kill_at = time.monotonic() + GRACE_S
                _signal([p for p, r in pids.items() if r not in codes], signal.SIGTERM)
        if kill_at is not None and time.monotonic() >= kill_at:
            _signal([p for p, r in pids.items() if r not in codes], signal.SIGKILL)
            kill_at = None
    return codes, failed


def _signal(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


# -------------------------------------------------------------------------------------------- rank


def _rank_main(request, env):
    """Become `python script args...` started by torchrun, run it, and exit the way python would."""
    script = request["script"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    sys.argv = [script, *request["args"]]
    sys.orig_argv = [sys.executable, "-u", script, *request["args"]]  # torchrun starts `python -u`
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    # a fresh process seeds numpy's global generator from the OS; do so too
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if not os.path.isfile(script):  # what `python missing.py` prints
        message = (
            f"{sys.executable}: can't open file {script!r}: [Errno 2] No such file or directory"
        )
        os.write(2, f"{message}\n".encode())
        os._exit(2)
    code = 0
    try:
        import runpy

        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except BaseException as error:
        code = 130 if isinstance(error, KeyboardInterrupt) else 1
        tb = error.__traceback__  # start the traceback at the script, as `python script` does
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next
        error.__traceback__ = tb or error.__traceback__  # what the default excepthook prints
        sys.excepthook(type(error), error, error.__traceback__)
    try:
        # what the interpreter does at exit: join non-daemon threads, run atexit
        threading._shutdown()
        import atexit as atexit_

        atexit_._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _exit_code(code):
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


# ------------------------------------------------------------------------------------------ client


class ServerGone(Exception):
    """The server ended before it started the run: a new one may run it."""


class Server:
    """Client side of one warm server process."""

    def __init__(self, env, cwd, start_timeout=300):
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server_env = dict(env)
        # else numpy's OpenBLAS starts threads at import
        server_env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", str(theirs.fileno())],
            env=server_env,
            cwd=cwd,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        self.control.settimeout(start_timeout)
        try:
            ready = self.control.recv(1 << 16)
        except socket.timeout:
            ready = b""
        self.control.settimeout(None)
        if not ready:
            self.close()
            raise RuntimeError(f"warm launcher server did not start within {start_timeout}s")
        self.threads = json.loads(ready)["threads"]

    def alive(self):
        return self.proc.poll() is None

    def close(self):
        self.control.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def run(self, script, args, nproc, env, cwd, timeout):
        """Returns (port, returncode, stdout, stderr, timed_out, rank_codes)."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        mine, theirs = socket.socketpair()
        request = json.dumps(dict(script=script, args=args, nproc=nproc, env=env, cwd=cwd)).encode()
        try:
            socket.send_fds(self.control, [request], [out_w, err_w, theirs.fileno()])
        except OSError as error:
            raise ServerGone(str(error)) from None
        finally:
            for fd in (out_w, err_w):
                os.close(fd)
            theirs.close()
        deadline = time.monotonic() + timeout
        chunks = {out_r: [], err_r: [], mine.fileno(): []}
        messages, group, timed_out = {}, None, False
        try:
            open_fds = set(chunks)
            while not ("codes" in messages and out_r not in open_fds and err_r not in open_fds):
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                for fd in select.select(list(open_fds), [], [], left)[0]:
                    data = os.read(fd, 1 << 16)
                    chunks[fd].append(data)
                    if not data:
                        open_fds.discard(fd)
                if chunks[mine.fileno()]:
                    for line in b"".join(chunks[mine.fileno()]).splitlines(keepends=True):
                        if line.endswith(b"\n"):
                            messages.update(json.loads(line))
                    group = messages.get("pid")
                if mine.fileno() not in open_fds and "codes" not in messages:
                    if "error" in messages:
                        raise RuntimeError(messages["error"])
                    if group is None:
                        raise ServerGone(
                            "the warm launcher ended before it started the run: "
                            + _text(chunks[err_r])[-2000:]
                        )
                    break  # the supervisor died without a verdict: its ranks get killed below
            if group is not None:  # every process of the run, whatever happened
                try:
                    os.killpg(group, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            # after the kill the write ends close; one that left our group could keep them open
            for fd in (out_r, err_r):
                end = time.monotonic() + 5
                while fd in open_fds and time.monotonic() < end:
                    if select.select([fd], [], [], end - time.monotonic())[0]:
                        data = os.read(fd, 1 << 16)
                        chunks[fd].append(data)
                        if not data:
                            open_fds.discard(fd)
        finally:
            if group is not None:
                try:
                    os.killpg(group, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            mine.close()
            os.close(out_r)
            os.close(err_r)
        codes = messages.get("codes")
        global last_cpu_s
        last_cpu_s = messages.get("cpu_s")
        if timed_out:
            returncode = -signal.SIGKILL
        elif codes is None:
            returncode = 1
            chunks[err_r].append(
                b"warm_launcher: the supervisor of the run died before all ranks ended\n"
            )
        else:
            returncode = 0 if all(c == 0 for c in codes) else 1
        return (
            messages.get("port"),
            returncode,
            _text(chunks[out_r]),
            _text(chunks[err_r]),
            timed_out,
            codes,
        )


def _text(chunks):
    """What Popen(text=True).communicate() makes of bytes: decoded, universal newlines."""
    return b"".join(chunks).decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


last_cpu_s = None  # CPU seconds (user + system) of the last run's ranks, for measurements
last_server_s = 0.0  # seconds the last run waited for a server to start (0.0: one was running)
_servers = {}  # start-up variables -> Server
_lock = threading.Lock()


def _startup_key(env):
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(STARTUP_VARS)))


def _close_all():
    for server in _servers.values():
        server.close()
    _servers.clear()


atexit.register(_close_all)


def run(script, args=(), nproc=2, env=None, cwd=None, timeout=120):
    """Run script on nproc forked ranks as torchrun would; see the module docstring.
    Returns (command, returncode, stdout, stderr, timed_out, rank_codes)."""
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    script = os.path.abspath(os.path.join(cwd, str(script)))
    args = [str(a) for a in args]
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    key = _startup_key(env)
    global last_server_s
    last_server_s = 0.0
    with _lock:
        for attempt in range(2):
            server = _servers.pop(key, None)
            if server is None or not server.alive():
                while len(_servers) >= MAX_SERVERS:  # drop the least recently used
                    _servers.pop(next(iter(_servers))).close()
                started = time.monotonic()
                server = Server(env, cwd)
                last_server_s = time.monotonic() - started
                # to count server starts (each imports PRELOAD)
                if os.environ.get("TEST_LAUNCH_LOG"):
                    settings = " ".join(f"{k}={v}" for k, v in key)
                    with open(os.environ["TEST_LAUNCH_LOG"], "a") as f:
                        f.write(f"warm-server {time.monotonic() - started:.1f} 0.0 {settings}\n")
            _servers[key] = server  # most recently used last
            try:
                port, *result = server.run(script, args, nproc, env, cwd, timeout)
                break
            except ServerGone:
                _servers.pop(key).close()
                if attempt:
                    raise
    command = [
        sys.executable,
        os.path.abspath(__file__),
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        script,
        *args,
    ]
    return (command, *result)


def main():
    if sys.argv[1:2] == ["--serve"]:
        return serve(int(sys.argv[2]))
    import argparse

    parser = argparse.ArgumentParser(
        description="torchrun for the tests, with ranks forked from a warm process"
    )
    parser.add_argument("--nproc_per_node", "--nproc-per-node", type=int, default=2)
    parser.add_argument(
        "--master_addr", "--master-addr", default="127.0.0.1", help="only 127.0.0.1"
    )
    parser.add_argument(
        "--master_port", "--master-port", help="ignored: a free port is always picked"
    )
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    _, code, out, err, timed_out, _ = run(
        options.script, options.args, options.nproc_per_node, timeout=options.timeout
    )
    sys.stdout.write(out)
    sys.stderr.write(err + ("warm_launcher: timed out\n" if timed_out else ""))
    return code


if __name__ == "__main__":
    sys.exit(main())
