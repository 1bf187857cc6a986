"""A lesson's start, run up to its first communication and no further (tests/test_refusals.py).

    warm_launcher.run("tests/start_probe.py", [LESSON, *ARGS], nproc=N, env=..., cwd=EMPTY_DIR)

Each rank (forked by tests/warm_launcher.py, torch already imported) runs LESSON as __main__ with
ARGS, exactly as under torchrun, and is stopped with `PROBE: rank R reached WHAT` and code 0 (the
lesson has accepted its world size and flags) at the first of:
- main passing the last line of its last call named *require* (ctx.require, require_*) or of a
  function of the lesson's folder that calls one (check_args): what the lesson refuses up front,
  it has refused by then (found in the source);
- the first call that would communicate with another rank (every collective and point-to-point
  call of torch.distributed, DDP's first broadcast, FSDP's all-gathers, functional collectives,
  init_rpc): a refusal cannot come after the ranks have started to talk and still be up front;
- PROBE_CPU_S seconds of CPU spent in main (SIGPROF ends the rank: the lesson is at work).

A refusal (launch/dist_setup.py: one line, exit 2) normally sleeps 3 s so that every rank prints
before the launcher stops the others; here each rank instead waits (at most 3 s) until every rank
of the run has printed, so a refused run ends at once. The lesson's temporary files go to TMPDIR
(the test gives each run an empty one, to see that a refused run writes nothing there either).
Each rank's memory is capped (cap_resources). The lessons hold no hook for this.
"""

import ast
import glob
import inspect
import os
import resource
import runpy
import signal
import sys
import tempfile
import textwrap
import time

# Communication, by the names the lessons and torch's DDP / FSDP2 / DTensor reach it through
DIST = """all_reduce all_reduce_coalesced all_gather all_gather_single all_gather_into_tensor
all_gather_coalesced all_gather_object all_to_all all_to_all_single barrier monitored_barrier
broadcast broadcast_object_list gather gather_object gather_single gather_into_tensor reduce
reduce_scatter reduce_scatter_single reduce_scatter_tensor scatter scatter_object_list send recv
isend irecv batch_isend_irecv send_object_list recv_object_list _broadcast_coalesced
_verify_params_across_processes""".split()
FUNCTIONAL = """all_reduce all_gather_tensor all_gather_tensor_autograd reduce_scatter_tensor
reduce_scatter_tensor_autograd all_to_all_single all_to_all_single_autograd broadcast
permute_tensor all_reduce_coalesced""".split()


def _reached(name):
    def stop(*args, **kwargs):
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(1, f"PROBE: rank {os.environ['RANK']} reached {name}\n".encode())
        _wait_for_peers("accepted", 10)  # a rank still setting up a group needs the others there
        os._exit(0)

    return stop


def stop_at_first_communication():
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d
    import torch.distributed.rpc as rpc

    for module, names in ((dist, DIST), (c10d, DIST), (funcol, FUNCTIONAL)):
        for name in names:
            if hasattr(module, name):
                setattr(module, name, _reached(name))
    if hasattr(rpc, "init_rpc"):
        rpc.init_rpc = _reached("init_rpc")


def _name(call):
    return getattr(call.func, "attr", None) or getattr(call.func, "id", "")


def _refusers(folder):
    """Names of the functions of the lesson's folder that call something named *require*
    (training.check_args, composition's check_args, ...)."""
    names = set()
    for path in glob.glob(os.path.join(folder, "*.py")):
        with open(path) as file:
            tree = ast.parse(file.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(
                isinstance(call, ast.Call) and "require" in _name(call) for call in ast.walk(node)
            ):
                names.add(node.name)
    return names


def last_refusal_line(main):
    """The last line of main's last call whose name holds "require" (ctx.require,
    require_checkpoint_fits, ...) or names a function of the lesson's folder that calls one: past
    it, main has refused everything it refuses up front."""
    lines, first = inspect.getsourcelines(main)
    refusers = _refusers(os.path.dirname(inspect.getsourcefile(main)))
    tree = ast.parse(textwrap.dedent("".join(lines)))
    ends = [
        node.end_lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ("require" in _name(node) or _name(node) in refusers)
    ]
    return first - 1 + max(ends, default=1)


def stop_after_the_refusals(setup):
    """run(main, ...) runs main under a tracer that ends the rank once main has passed its last
    refusal (last_refusal_line), and caps its CPU from there on (CPU_S)."""
    original = setup.run

    def run(main, *args, **kwargs):
        inner = inspect.unwrap(main)  # under a decorator (record_errors.py's @record), the lesson's
        end = last_refusal_line(inner)

        def in_main(frame, event, arg):
            if event == "line" and frame.f_lineno > end:
                _reached(f"line {frame.f_lineno} of main, past its refusals")()
            return in_main

        def calls(frame, event, arg):
            return in_main if frame.f_code is inner.__code__ else None

        def traced(*main_args):
            cpu = float(os.environ.pop("PROBE_CPU_S", "0"))
            if cpu:  # SIGPROF, whose default action ends the process, after cpu s of its CPU
                signal.setitimer(signal.ITIMER_PROF, cpu)
            sys.settrace(calls)
            try:
                return main(*main_args)
            finally:  # a refusal (UsageError) ends main: what follows is not main's CPU
                sys.settrace(None)
                signal.setitimer(signal.ITIMER_PROF, 0)

        return original(traced, *args, **kwargs)

    setup.run = run


def _wait_for_peers(what, seconds):
    """Mark this rank as done (`what`) and wait, at most `seconds`, until every rank is."""
    folder = os.environ["PROBE_PEERS"]
    open(os.path.join(folder, f"{what}.{os.environ['RANK']}"), "w").close()
    end, world = time.monotonic() + seconds, int(os.environ["WORLD_SIZE"])
    while len(os.listdir(folder)) < world and time.monotonic() < end:
        time.sleep(0.02)


class _RefusalWait:
    """launch.dist_setup's `time` during a refusal: sleep(3) waits until every rank has printed."""

    @staticmethod
    def sleep(seconds):
        _wait_for_peers("refused", seconds)


def cap_resources():
    """A start at the top of a flag's range (widths of 16384, 10**7 samples) may build a model or a
    data set far larger than this machine before it communicates: allocations past PROBE_GIB more
    GiB fail (torch raises "can't allocate memory")."""
    with open("/proc/self/status") as status:
        size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    room = size + int(float(os.environ.pop("PROBE_GIB", "3")) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (room, room))


def main():
    lesson, args = os.path.abspath(sys.argv[1]), sys.argv[2:]
    cap_resources()
    os.environ["TMPDIR"] = os.environ.pop("PROBE_TMPDIR")  # this start's own
    tempfile.tempdir = None  # the server may have cached its own: take this start's
    stop_at_first_communication()
    import launch.dist_setup as setup

    stop_after_the_refusals(setup)
    setup.time = _RefusalWait
    sys.argv = [lesson, *args]
    sys.path[0] = os.path.dirname(lesson)
    runpy.run_path(lesson, run_name="__main__")


if __name__ == "__main__":
    main()
