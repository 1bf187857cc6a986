"""Hello, distributed: a process group set up entirely by hand.

Every other lesson lets launch/dist_setup.py do what this file does in plain sight:
read what the launcher handed over, pick a device and backend, init_process_group,
run, and destroy_process_group on every path.

    torchrun --nproc_per_node=4 primitives/hello_distributed.py
    python primitives/hello_distributed.py --nproc 4      # spawns the 4 ranks itself

Docs: https://pytorch.org/docs/stable/distributed.html#initialization
"""

import argparse
import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# argparse types with a range (launch/dist_setup.py): a bad value stops where it is parsed
from launch.dist_setup import float_in, int_in

NAME_BYTES = 128  # collectives move tensors of one size: strings travel padded to this


def encode(text, device):
    data = list(text.encode()[:NAME_BYTES])
    return torch.tensor(data + [0] * (NAME_BYTES - len(data)), dtype=torch.uint8, device=device)


def decode(tensor):
    return bytes(tensor.tolist()).rstrip(b"\0").decode(errors="replace")


def worker(args):
    # 1. What the launcher handed over (torchrun sets these; the spawn path below does too).
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))

    # 2. Device and backend: NCCL needs one GPU per rank on this node; Gloo runs anywhere.
    has_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size
    backend = args.backend or ("nccl" if has_gpus else "gloo")
    if backend == "nccl" and not has_gpus:
        sys.exit(
            f"[rank {rank}] error: NCCL needs one CUDA GPU per rank ({local_world_size} ranks "
            f"here, {torch.cuda.device_count()} GPU(s)): use --backend gloo"
        )
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # N ranks on one machine share its cores but one (launch/dist_setup.py says why)
        torch.set_num_threads(max(1, ((os.cpu_count() or 1) - 1) // local_world_size))

    # 3. Join the group: init_method "env://" reads MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE.
    #    The timeout bounds every collective, so a missing peer is an error, not a hang.
    dist.init_process_group(
        backend,
        timeout=datetime.timedelta(seconds=args.timeout),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        check_group(rank, world_size)
        me = (
            f"rank {rank}/{world_size} local_rank {local_rank} host {socket.gethostname()} "
            f"pid {os.getpid()} device {device}"
        )
        # 4. Gather every description with a tensor collective: strings as fixed-size byte tensors.
        gathered = [
            torch.empty(NAME_BYTES, dtype=torch.uint8, device=device) for _ in range(world_size)
        ]
        dist.all_gather(gathered, encode(me, device))
        by_tensor = [decode(t) for t in gathered]

        # 5. The same with all_gather_object: shorter to write, but it pickles (trust your peers).
        by_object = [None] * world_size
        dist.all_gather_object(by_object, me)

        # 6. A sum every rank can check: 0 + 1 + ... + (n-1) = n(n-1)/2.
        total = torch.tensor([rank], device=device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        check_and_print(rank, world_size, by_tensor, by_object, total.item())
    finally:
        dist.destroy_process_group()


def spawned(local_rank, args, nproc, port):
    # What torchrun would have set, for a single machine.
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    worker(args)


def main(args):
    if "RANK" in os.environ:  # started by torchrun: this process is one rank
        worker(args)
        return
    # A free port on loopback for the rendezvous, held (bound, not listening) while the ranks
    # start: the OS gives it to no other process meanwhile, and rank 0's store can still bind it
    # (both set SO_REUSEADDR).
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        try:
            mp.spawn(spawned, args=(args, args.nproc, s.getsockname()[1]), nprocs=args.nproc)
        except mp.ProcessExitedException as error:  # the rank already printed why
            sys.exit(error.exit_code if error.exit_code and error.exit_code > 0 else 1)


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_group(rank, world_size):
    """The group joined is the one the launcher described."""
    if not (
        dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) == (rank, world_size)
    ):
        raise RuntimeError(
            f"rank {rank}/{world_size}: the group says rank {dist.get_rank()} of "
            f"{dist.get_world_size()}"
        )
    if rank == 0:
        print(
            f"backend={dist.get_backend()} world_size={world_size} "
            f"torchrun={dist.is_torchelastic_launched()} "
            f"master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            flush=True,
        )


def check_and_print(rank, world_size, by_tensor, by_object, total):
    """Both gathers agree; the sum is n(n-1)/2."""
    if by_tensor != by_object:
        raise RuntimeError(f"all_gather and all_gather_object disagree: {by_tensor} vs {by_object}")
    expected = world_size * (world_size - 1) // 2
    if total != expected:
        raise RuntimeError(f"rank {rank}: all_reduce gave {total}, expected {expected}")
    if rank == 0:
        print("\n".join(by_tensor), flush=True)
        print(
            f"OK: {world_size} rank(s) said hello; all_reduce of ranks = {expected} = n(n-1)/2",
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--nproc",
        type=int_in(1, 4096),
        default=2,
        help="ranks to spawn when not under torchrun (an integer in [1, 4096])",
    )
    parser.add_argument(
        "--backend", choices=["gloo", "nccl"], help="default: nccl with a GPU per rank, else gloo"
    )
    parser.add_argument(
        "--timeout",
        type=float_in(0, 86_400, low_open=True),
        default=60,
        help="seconds a collective may wait (a number in (0, 86400])",
    )
    main(parser.parse_args())
