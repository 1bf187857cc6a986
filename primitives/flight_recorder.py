"""flight_recorder: a job hangs; find the rank and the collective from what each rank recorded.

Each process group records every collective it issues (name, sequence number, sizes, Python stack)
in a ring buffer, the flight recorder: on by default in torch 2.13, on Gloo as on NCCL
(TORCH_FR_BUFFER_SIZE, default 2000: torch/csrc/distributed/c10d/FlightRecorder.hpp). When a job
hangs, every rank dumps its buffer, and torch's analyzer, `torchfrtrace DIR --prefix rank_`
(torch/distributed/flight_recorder/fr_trace.py), lines the dumps up by sequence number.

Here one rank (--culprit) goes wrong in the last step of a small job, as readers' jobs do
(--fault): skip = it has one batch fewer; order = it calls broadcast before all_reduce; size = its
all_reduce is shorter. The others time out, every rank dumps, and rank 0 reads the dumps its own way
and with torch's analyzer (primitives/README.md, "My job hangs: which rank?"). Each job is a Gloo
group on CPU tensors, on a GPU node too (the default group may be NCCL there).

    torchrun --nproc_per_node=3 primitives/flight_recorder.py --fault order
    python primitives/flight_recorder.py --nproc 4          # every fault in turn

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://docs.pytorch.org/tutorials/unstable/flight_recorder_tutorial.html
"""

import datetime
import os
import pickle
import re
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
from launch.dist_setup import float_in, int_in, lesson_parser, print_rank, run

FAULTS = ["skip", "order", "size"]


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: one of them breaks the pattern")
    culprit = ctx.world_size - 1 if args.culprit is None else args.culprit
    ctx.require(culprit < ctx.world_size, f"--culprit must be a rank below {ctx.world_size}")
    jobs = {}
    for fault in FAULTS if args.fault == "all" else [args.fault]:
        timeout = datetime.timedelta(seconds=args.hang_timeout)
        # Gloo on CPU tensors whatever the default group is: on NCCL the watchdog would end a rank
        # whose collective times out before Python could catch the error and dump
        jobs[fault] = dist.new_group(backend="gloo", timeout=timeout, group_desc=f"job_{fault}")
        mine = fault if ctx.rank == culprit else None
        try:
            train(jobs[fault], args.steps, args.size, mine, torch.device("cpu"))
        except RuntimeError as error:  # Gloo: "Timed out waiting 3000ms for recv operation ..."
            print_rank(f"{fault}: {str(error).splitlines()[0][-60:]}")
        dist.barrier()  # on the default group (its own timeout): the next job starts together
    dump_dir = [tempfile.mkdtemp(prefix="flight_recorder_") if ctx.rank == 0 else None]
    dist.broadcast_object_list(dump_dir, src=0)  # one directory for all dumps: one node here
    dump_flight_record(jobs.values(), dump_dir[0], ctx.rank)
    dist.barrier()  # every rank's dump is written
    if ctx.rank == 0:
        analysis = torch_analyzer(dump_dir[0])
        check_reading(jobs, analysis, args, ctx.world_size, dump_dir[0])


def train(group, steps, size, fault, device):
    grad, params = torch.ones(size, device=device), torch.zeros(size, device=device)
    src = dist.get_global_rank(group, 0)
    for step in range(steps):
        if fault is not None and step == steps - 1:
            return faulty_step(fault, grad, params, group)
        dist.all_reduce(grad, group=group)
        dist.broadcast(params, src=src, group=group)


def faulty_step(fault, grad, params, group):
    """What the culprit does in the last step instead of all_reduce then broadcast."""
    src = dist.get_global_rank(group, 0)
    if fault == "order":
        dist.broadcast(params, src=src, group=group)
        dist.all_reduce(grad, group=group)
    elif fault == "size":
        # one element short: one element more makes Gloo abort the receiving rank at 2 ranks
        # (gloo::EnforceNotMet in its transport thread, std::terminate), which then dumps nothing
        dist.all_reduce(torch.ones(grad.numel() - 1, device=grad.device), group=group)
        dist.broadcast(params, src=src, group=group)
    # "skip": nothing; this rank's data ran out one batch early


def dump_flight_record(groups, dump_dir, rank):
    """Gloo has no dump on timeout (NCCL's watchdog has: TORCH_NCCL_DUMP_ON_TIMEOUT=1), so each
    rank dumps on demand. torch 2.13's Gloo record leaves pg_config empty, which the analyzer needs
    for each group's ranks (else a KeyError in its components/builder.py): fill it in."""
    record = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, True, False))
    config = {g.group_name: (g.group_desc, dist.get_process_group_ranks(g)) for g in groups}
    record["entries"] = [e for e in record["entries"] if e["process_group"][0] in config]
    record["pg_config"] = {
        name: {"name": name, "desc": desc, "ranks": str(ranks)}
        for name, (desc, ranks) in config.items()
    }
    with open(os.path.join(dump_dir, f"rank_{rank}"), "wb") as f:
        pickle.dump(record, f)


def torch_analyzer(dump_dir):
    """What `torchfrtrace DIR --prefix rank_` prints. It unpickles the dumps, which can run code
    they hold: analyze only dumps that your own job wrote."""
    command = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", dump_dir]
    done = subprocess.run(command + ["--prefix", "rank_"], capture_output=True, text=True)
    return [line for line in (done.stdout + done.stderr).splitlines() if "tabulate" not in line]


# ---- The lesson ends here. What follows is how it checks itself. ----


def read_record(group, dump_dir, world):
    """{rank: [(sequence number, collective, input sizes), ...]} of `group`, from every dump."""
    calls = {}
    for rank in range(world):
        with open(os.path.join(dump_dir, f"rank_{rank}"), "rb") as f:
            entries = pickle.load(f)["entries"]
        calls[rank] = [
            (e["collective_seq_id"], e["profiling_name"].split(":")[-1], e["input_sizes"])
            for e in entries
            if e["process_group"][0] == group.group_name
        ]
    return calls


def odd_one_out(calls):
    """The first sequence number at which the ranks disagree, what each called there, and the
    rank(s) that differ from the rest: the one missing, else the one outvoted."""
    last = max(seq for entries in calls.values() for seq, _, _ in entries)
    for seq in range(1, last + 1):
        at = {
            r: next((c[1:] for c in entries if c[0] == seq), None) for r, entries in calls.items()
        }
        votes = [repr(call) for call in at.values()]
        if len(set(votes)) > 1:
            missing = [r for r, call in at.items() if call is None]
            odd = [r for r, call in at.items() if votes.count(repr(call)) == 1]
            return seq, at, missing or (odd if len(calls) > 2 else sorted(at))
    raise RuntimeError("every rank recorded the same collectives: nothing went wrong")


def analyzer_blocks(analysis):
    """torchfrtrace's findings: {group: (sequence number, the ranks it blames or finds missing)}."""
    found, seq = {}, None
    for line in analysis:
        if m := re.search(r"sequence number: (\d+)", line):
            seq = int(m.group(1))
        elif (m := re.match(r"group info: \S+?:(\S+)", line)) and m.group(1) not in found:
            desc = m.group(1)
        elif line.startswith(("error msg:", "missing ranks:")) and seq is not None:
            ranks = {int(r) for r in re.findall(r"(?:Culprit rank |[{ ,])(\d+)", line)}
            found.setdefault(desc, (seq, ranks))
    return found


def check_reading(jobs, analysis, args, world, dump_dir):
    culprit = world - 1 if args.culprit is None else args.culprit  # what the reader asked for
    keys = ("Collective sequence", "Not all ranks", "group info", "error msg", "missing ranks")
    print(f"$ torchfrtrace {dump_dir} --prefix rank_", flush=True)
    print("\n".join(line[:160] for line in analysis if line.startswith(keys)), flush=True)
    torch_says = analyzer_blocks(analysis)
    for fault, group in jobs.items():
        calls = read_record(group, dump_dir, world)
        seq, at, odd = odd_one_out(calls)
        last = {r: entries[-1][0] if entries else 0 for r, entries in calls.items()}
        calls_at = ", ".join(
            f"rank {r} {c[0]} {c[1]}" if c else f"rank {r} -" for r, c in at.items()
        )
        print(f"[{fault}] last collective per rank {last}; first disagreement #{seq}: {calls_at}")
        print(f"[{fault}] odd rank(s) out {odd}; torchfrtrace: {torch_says.get(f'job_{fault}')}")
        n = args.size
        expected = {"skip": None, "order": ("broadcast", [[n]]), "size": ("all_reduce", [[n - 1]])}
        want_odd = [culprit] if world > 2 or fault == "skip" else [0, 1]
        found = (seq, at[culprit], odd)
        want = (2 * args.steps - 1, expected[fault], want_odd)  # the last step goes wrong
        if found != want:
            raise RuntimeError(f"{fault}: the record shows {found}, the lesson broke {want}")
        # torch's analyzer takes the first dump it reads as the reference, so it may blame the
        # ranks that agree: either way it must split the ranks where the culprit stands apart
        split = ({culprit}, set(range(world)) - {culprit})
        if torch_says.get(f"job_{fault}", (None, None)) not in [(seq, s) for s in split]:
            raise RuntimeError(f"{fault}: torchfrtrace says {torch_says.get(f'job_{fault}')}")
    print(f"OK: the flight record names the culprit, rank {culprit}, and its collective")


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument("--fault", choices=FAULTS + ["all"], default="all")
    parser.add_argument(
        "--culprit",
        type=int_in(0, 4095),
        default=None,
        help="the rank that goes wrong (default: the last)",
    )
    parser.add_argument("--steps", type=int_in(1, 100), default=3, help="steps of each job")
    parser.add_argument("--size", type=int_in(2, 1_000_000), default=4, help="elements reduced")
    parser.add_argument(
        "--hang-timeout",
        type=float_in(0.5, 600),
        default=3.0,
        help="seconds a collective of the job waits before it fails",
    )
    args = parser.parse_args()
    if args.steps == 1 and args.fault in ("skip", "all"):  # its culprit records no collective
        parser.error(f"--steps 1 with --fault {args.fault}: skip needs --steps 2 or more")
    if args.hang_timeout > args.timeout / 2:  # the barrier between two jobs waits out each hang
        parser.error(
            f"--hang-timeout {args.hang_timeout:g}: at most half of --timeout {args.timeout:g}"
        )
    run(main, args)
