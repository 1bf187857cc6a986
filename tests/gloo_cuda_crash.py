"""Why the DeviceMesh and DTensor lessons crash on Gloo with CUDA tensors: one stage per run.

    torchrun --nproc_per_node=2 tests/gloo_cuda_crash.py STAGE [--device cuda]

On one H200 with torch 2.11.0+cu130 (2026-11-28, commit d01dd3b), every lesson that builds a
DeviceMesh or a DTensor on `--backend gloo --device cuda` died of SIGSEGV on both ranks, with no
Python traceback. Bisected there (one stage per run, faulthandler on): dist.all_gather_into_tensor
and dist.reduce_scatter_tensor on CUDA tensors work (Gloo stages them through the host); the
functional collectives' all_gather_tensor on a CUDA tensor crashes, and so does a DTensor's
full_tensor(), which calls it (the main thread waits in wait_tensor,
torch/distributed/_functional_collectives.py; the thread that crashes is Gloo's, no Python frame).
pytorch/pytorch#152645 (open) reports the same: ProcessGroupGloo's allgather_into_tensor_coalesced,
which the functional collectives call, memmoves CUDA pointers on the host.

The stages (each prints its tensors' addresses, then "stage S ok" if its result is right):
  all_gather_into_tensor  the control: dist.all_gather_into_tensor (works on 2.11)
  funcol_cpu              the control: funcol.all_gather_tensor on CPU tensors (works on 2.11)
  funcol_all_gather       funcol.all_gather_tensor on --device tensors (crashed on 2.11, CUDA)
  dtensor_full_tensor     a 2-rank DeviceMesh, distribute_tensor(Shard(0)), .full_tensor()
  selftest_native_crash   on rank 0, a segfault in a thread with no Python frame (a C thread calling
                          strlen(NULL)): shows what the reports below look like, on any machine

On SIGSEGV each rank prints, before it dies, the crashing thread's native frames (glibc's
backtrace: the library and symbol or offset of each frame) and the faulting address, named if it
falls inside one of the stage's tensors (a host copy from device memory), then faulthandler prints
the Python stack of every thread. On CUDA a watchdog (faulthandler's) ends a rank still in its
stage 5 s after the call, with every thread's Python stack, should the native report hang.
tests/test_gpu.py runs the stages in the node check (other-gloo_cuda_crash) and reports the frame;
tests/test_gpu_tiers.py runs them on the CPU.
"""

import argparse
import ctypes
import faulthandler
import os
import platform
import re
import threading
import time

import torch
import torch.distributed as dist

STAGES = ("all_gather_into_tensor", "funcol_cpu", "funcol_all_gather", "dtensor_full_tensor")
CONTROLS = STAGES[:2]  # must work wherever the script runs
SELFTEST = "selftest_native_crash"
# On CUDA: faulthandler's watchdog dumps every thread's Python stack and ends the rank if a stage
# is not done this many seconds after its call (its collectives take milliseconds): a crash whose
# native report cannot run (its handler needs the GIL) still shows where the rank stood
WATCHDOG_S = 5
TENSORS = []  # (name, first byte, end) of the stage's tensors, read by the SIGSEGV handler
_keep = []  # the handler and the old action, alive for the life of the process


def say(text):
    os.write(1, f"[rank {os.environ.get('RANK', '?')}] {text}\n".encode())


def track(name, tensor):
    start = tensor.data_ptr()
    TENSORS.append((name, start, start + tensor.numel() * tensor.element_size()))
    say(f"{name}: {tensor.device} [{start:#x}, +{tensor.numel() * tensor.element_size()} B)")
    return tensor


class SigAction(ctypes.Structure):  # glibc's struct sigaction (x86-64 and aarch64 Linux)
    _fields_ = [
        ("handler", ctypes.c_void_p),
        ("mask", ctypes.c_ulong * 16),
        ("flags", ctypes.c_int),
        ("restorer", ctypes.c_void_p),
    ]


class DlInfo(ctypes.Structure):  # dladdr's answer
    _fields_ = [
        ("fname", ctypes.c_char_p),
        ("fbase", ctypes.c_void_p),
        ("sname", ctypes.c_char_p),
        ("saddr", ctypes.c_void_p),
    ]


def describe(libc, pc):
    """The library, nearest exported symbol and library offset of a code address (dladdr)."""
    info = DlInfo()
    if not libc.dladdr(ctypes.c_void_p(pc), ctypes.byref(info)) or not info.fname:
        return f"pc {pc:#x} in no library dladdr knows"
    name = (info.sname or b"?").decode(errors="replace")
    symbol = f"{name}+{pc - (info.saddr or 0):#x}" if info.sname else "no exported symbol"
    library = info.fname.decode(errors="replace")
    return f"pc {pc:#x} in {library} ({symbol}), offset {pc - (info.fbase or 0):#x} in that file"


def native_report_on_segv():
    """On SIGSEGV: the faulting address, the faulting instruction's library and symbol, and the
    crashing thread's native frames from there, on stderr; then the previous action runs (install
    this after faulthandler: its Python stacks come next, then the default: death by SIGSEGV)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    frames = (ctypes.c_void_p * 128)()
    libc.backtrace(frames, 128)  # loads libgcc_s now, not inside the handler
    old = SigAction()
    handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)

    def on_segv(signum, info, context):
        address = ctypes.c_void_p.from_address(info + 16).value or 0  # siginfo_t.si_addr
        inside = [f"{name} [{a:#x}, {b:#x})" for name, a, b in TENSORS if a <= address < b]
        where = f"inside {inside[0]}" if inside else "in none of the stage's tensors"
        lines = [f"SIGSEGV at address {address:#x} ({where}), thread {threading.get_native_id()}"]
        count, first = libc.backtrace(frames, 128), 0
        if platform.machine() == "x86_64":  # ucontext_t.uc_mcontext.gregs[REG_RIP]
            pc = ctypes.c_void_p.from_address(context + 40 + 16 * 8).value or 0
            lines.append(describe(libc, pc))
            first = next((i for i in range(count) if frames[i] == pc), 0)
        lines.append("frames from the faulting one:" if first else "frames (the handler's first):")
        os.write(2, "".join(f"native: {line}\n" for line in lines).encode())
        size = ctypes.sizeof(ctypes.c_void_p)
        libc.backtrace_symbols_fd(ctypes.byref(frames, first * size), count - first, 2)
        libc.sigaction(signum, ctypes.byref(old), None)  # the fault repeats into faulthandler

    handler = handler_type(on_segv)
    action = SigAction(handler=ctypes.cast(handler, ctypes.c_void_p).value)
    action.flags = 0x4 | 0x40000000  # SA_SIGINFO | SA_NODEFER
    if libc.sigaction(11, ctypes.byref(action), ctypes.byref(old)) != 0:
        raise OSError(ctypes.get_errno(), "sigaction(SIGSEGV)")
    _keep.extend([handler, old, libc])


def crash_in_a_native_thread():
    """A thread with no Python frame that dereferences NULL: pthread_create(strlen, NULL)."""
    libc = ctypes.CDLL(None)
    thread = ctypes.c_ulong()
    start = ctypes.cast(libc.strlen, ctypes.c_void_p)
    libc.pthread_create(ctypes.byref(thread), None, start, None)
    time.sleep(30)  # the process dies first


def run_stage(stage, device, rank, world):
    full = torch.arange(4.0 * world, device=device)
    mine = track("input", full[4 * rank : 4 * rank + 4].clone())
    say(f"stage {stage}: calling")
    if device.type == "cuda":  # should the SIGSEGV handler wait for a GIL that never comes
        faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    if stage == "all_gather_into_tensor":
        out = track("output", torch.empty(4 * world, device=device))
        dist.all_gather_into_tensor(out, mine)
    elif stage in ("funcol_cpu", "funcol_all_gather"):
        import torch.distributed._functional_collectives as funcol

        mine = track("input on cpu", mine.cpu()) if stage == "funcol_cpu" else mine
        out = funcol.all_gather_tensor(mine, 0, dist.group.WORLD)
        out = out.wait() if hasattr(out, "wait") else out  # an AsyncCollectiveTensor
        out = out.to(device)
    elif stage == "dtensor_full_tensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh(device.type, (world,))
        shards = distribute_tensor(full.view(world, 4), mesh, [Shard(0)])
        track("local shard", shards.to_local())
        out = shards.full_tensor().flatten()
    elif stage == SELFTEST:  # one rank only: two crashing at once interleave their reports
        crash_in_a_native_thread() if rank == 0 else time.sleep(30)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if not torch.equal(out.cpu(), full.cpu()):
        raise SystemExit(f"stage {stage}: gathered {out.tolist()}, expected {full.tolist()}")
    faulthandler.cancel_dump_traceback_later()
    say(f"stage {stage} ok: {out.tolist()}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stage", choices=[*STAGES, SELFTEST])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    faulthandler.enable(all_threads=True)  # Python's stacks on a crash, after...
    native_report_on_segv()  # ...the native frames: the handler installed last runs first
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    say(f"torch {torch.__version__}, Gloo, {device} tensors, {world} ranks")
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=30))
    try:
        run_stage(args.stage, device, rank, world)
    finally:
        dist.destroy_process_group()


# ---- What follows reads a run's output: tests/test_gpu.py and tests/test_gpu_tiers.py ----


def read(stage, result):
    """(verdict, summary) of one stage's run: "ok" (every rank said so), "crashed" (a rank died of
    SIGSEGV: the summary names the fault address, the first native frames and the innermost
    Python frame) or "failed"."""
    text = result.stdout + result.stderr
    if result.returncode == 0 and text.count(f"stage {stage} ok") == 2:
        return "ok", f"{stage}: ok"
    codes = result.rank_codes or []
    # whole frames only: ranks that crash together write their reports into one stream, in pieces
    python = re.findall(r'File "[^"\n]+", line \d+ in \w+', text)
    if "Timeout (0:" in text and -11 not in codes:  # faulthandler's watchdog
        where = python[0] if python else "no Python frame printed"
        return "failed", f"{stage}: the watchdog ended a hung rank, ranks {codes}; Python: {where}"
    if -11 not in codes and "Segmentation fault" not in text:
        state = "timed out" if result.timed_out else f"exit code {result.returncode} {codes}"
        return "failed", f"{stage}: {state}"
    lines = text.splitlines()
    native = [line.removeprefix("native: ") for line in lines if line.startswith("native: ")]
    after = next((i for i, line in enumerate(lines) if line.startswith("native: frames")), None)
    frames = (
        [line.strip() for line in lines[after + 1 :] if "[0x" in line] if after is not None else []
    )
    summary = f"{stage}: ranks {codes}; " + "; ".join(native[:2] or ["no native report"])
    if frames:
        summary += "; native frames: " + " < ".join(frames[:4])
    summary += f"; Python: {python[0] if python else 'no Python frame printed'}"
    return "crashed", summary


if __name__ == "__main__":
    main()
