"""Training that goes on when a replica dies: no restart; survivors regroup, a replacement joins.

N replicas train one small MLP, each on a batch of its own, gradients averaged by all_reduce over
a Gloo group. At --kill-step replica --kill-rank SIGKILLs its own process. The survivors see their
all_reduce fail, agree in the store on who is left, build a new Gloo group (generation g+1, ranks
renumbered) and redo the failed step among themselves; --rejoin-after steps later a replacement
joins and receives the weights and momentum by broadcast before its first step. A death is seen
at once (the kernel closes its sockets); what closes none (a lost machine) only after --timeout.

    python launch/fault_tolerant_ddp.py --nproc 3                  # the last replica dies at step 6
    python launch/fault_tolerant_ddp.py --nproc 4 --kill-rank 0 --kill-step 3

Not one torchrun job (its agent stops every worker when one dies): this script is the launcher.
It hosts the TCPStore (rank 0's would die with rank 0), forks the replicas, says in the store when
one dies and starts the replacement. Across machines: launch/README.md, "Keep going".
Docs: https://pytorch.org/docs/stable/distributed.html#torch.distributed.Store
"""

import datetime
import io
import json
import multiprocessing
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from launch.dist_setup import UsageError, float_in, int_in, lesson_parser


def launch(args):
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    store.set("gen0/members", json.dumps(list(range(args.nproc))))
    forks = multiprocessing.get_context("forkserver")  # torch imported once, each replica forked
    multiprocessing.set_forkserver_preload(["torch"])
    procs = {}

    def start(rid):  # daemon: ended when the launcher exits (its deadline, an error, Ctrl-C)
        procs[rid] = forks.Process(target=replica, args=(args, rid, store.port), daemon=True)
        procs[rid].start()

    for rid in range(args.nproc):
        start(rid)
    limit = 30 + 4 * args.timeout + 0.1 * args.steps  # every wait bounded, this one too
    deadline, codes, died, resumed = time.monotonic() + limit, {}, None, None
    while len(codes) < len(procs) and time.monotonic() < deadline:
        for rid, p in list(procs.items()):
            if rid not in codes and p.exitcode is not None:
                codes[rid] = p.exitcode
                if p.exitcode == -signal.SIGKILL and args.nproc not in procs:
                    store.set(f"dead/{rid}", "")  # survivors stop waiting for it
                    store.set("joiner", str(args.nproc))  # a new id: the dead one's stays dead
                    start(args.nproc)
                    died = time.monotonic()
        if died and not resumed and int(store.get("progress")) > args.kill_step:
            resumed = time.monotonic()  # the failed step, redone, has completed
        time.sleep(0.01)
    return store, codes, resumed - died if resumed else None


def replica(args, rid, port):
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    torch.manual_seed(0)  # every replica builds the same model; a replacement is overwritten
    model, momenta = build()
    # the replacement waits until the survivors admit it into generation g
    g, step = (0, 0) if rid < args.nproc else (int(store.get(f"admitted/{rid}")), -1)
    members = json.loads(store.get(f"gen{g}/members"))
    while step < args.steps:
        pg = dist.ProcessGroupGloo(
            dist.PrefixStore(f"gen{g}", store), members.index(rid), len(members), timeout
        )
        step = sync_state(model, momenta, pg, step)
        store.set(f"gen{g}/start", str(step))  # for the check: which steps had which members
        admit = args.kill_step + args.rejoin_after if len(members) < args.nproc else args.steps
        try:
            while step < min(admit, args.steps):
                if (rid, step) == (args.kill_rank, args.kill_step):
                    os.kill(os.getpid(), signal.SIGKILL)  # a real death: no exception, no exit
                train_step(model, momenta, pg, store, g, args, step)
                step += 1
            new = members + [int(store.get("joiner"))] if step < args.steps else members
        except RuntimeError as error:  # the all_reduce failed: the next group redoes this step
            store.set(f"gen{g}/failed", "")  # tell the members still waiting in it
            why = str(error).split("] ", 1)[-1].split(". ")[0]  # Gloo's message, less its path
            sys.stdout.write(f"[replica {rid}] step {step} failed: {why}\n")
            pg.abort()  # close its connections now rather than at its timeout
            new = survivors(store, g, rid, members, args.timeout)
        store.compare_set(f"gen{g + 1}/members", "", json.dumps(new))  # the first writer wins
        old, members, g = members, json.loads(store.get(f"gen{g + 1}/members")), g + 1
        for joined in set(members) - set(old):
            store.set(f"admitted/{joined}", str(g))
    report(store, rid, model, momenta)


def build():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = model.to(torch.float64)
    return model, [torch.zeros_like(p) for p in model.parameters()]  # the optimizer's state


@torch.no_grad()
def sgd_step(model, momenta, lr):  # torch.optim.SGD(momentum=0.9), written out
    for p, m in zip(model.parameters(), momenta):
        m.mul_(0.9).add_(p.grad)
        p.add_(m, alpha=-lr)


def batch(step, rank, size):  # each rank of each step draws its own batch
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(size, 8, generator=g, dtype=torch.float64, device="cpu")
    return x, torch.sin(x.sum(1, keepdim=True))


def train_step(model, momenta, pg, store, g, args, step):
    x, y = batch(step, pg.rank(), args.batch)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    work = dist.all_reduce(flat, group=pg, async_op=True)
    while not work.is_completed():  # a peer that saw the failure first says so in the store
        if store.check([f"gen{g}/failed"]):
            raise RuntimeError(f"generation {g} failed on another replica")
        time.sleep(0.001)
    work.wait()  # raises here if the all_reduce failed ("Connection reset by peer")
    torch.nn.utils.vector_to_parameters(flat / pg.size(), [p.grad for p in model.parameters()])
    sgd_step(model, momenta, args.lr)  # after a completed all_reduce: a failed step changes nothing
    store.set("progress", str(step + 1))  # the launcher times the recovery by it


def survivors(store, g, rid, members, seconds):
    """Who arrives, once the others are reported dead by the launcher, or after `seconds`."""
    store.set(f"gen{g + 1}/here/{rid}", "")
    deadline = time.monotonic() + seconds
    while True:
        here = [m for m in members if store.check([f"gen{g + 1}/here/{m}"])]
        dead = [m for m in members if store.check([f"dead/{m}"])]
        if len(here) + len(dead) == len(members) or time.monotonic() > deadline:
            return here
        time.sleep(0.005)


def sync_state(model, momenta, pg, step):
    """The most advanced member sends weights and momentum to all; returns the step to resume."""
    steps = torch.zeros(pg.size(), dtype=torch.int64, device="cpu")
    steps[pg.rank()] = step
    dist.all_reduce(steps, group=pg)
    src = int(steps.argmax())  # a replacement (step -1) never sends
    for t in [*model.parameters(), *momenta]:
        dist.broadcast(t.detach(), group_src=src, group=pg)
    return int(steps[src])


# ---- The lesson ends here. What follows is how it checks itself. ----


def report(store, rid, model, momenta):
    buffer = io.BytesIO()
    torch.save([t.detach() for t in [*model.parameters(), *momenta]], buffer)
    store.set(f"final/{rid}", buffer.getvalue())


def generations(store, steps):
    """[(first step, end step, members)] of every generation that took a step, from the store."""
    gens, g = [], 0
    while store.check([f"gen{g}/start"]):
        gens.append((int(store.get(f"gen{g}/start")), json.loads(store.get(f"gen{g}/members"))))
        g += 1
    ends = [start for start, _ in gens[1:]] + [steps]
    return [(s, e, m) for (s, m), e in zip(gens, ends) if e > s]


def replay(args, gens):
    """One process, no group: each step on the batches of the ranks that step had."""
    torch.manual_seed(0)
    model, momenta = build()
    for step, members in [(s, m) for first, end, m in gens for s in range(first, end)]:
        xs, ys = zip(*(batch(step, r, args.batch) for r in range(len(members))))
        model.zero_grad()
        torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        sgd_step(model, momenta, args.lr)
    return [t.detach() for t in [*model.parameters(), *momenta]]


def check(args, store, codes, recovery_s):
    n, killed = args.nproc, args.kill_rank
    expected = {**{rid: 0 for rid in range(n + 1)}, killed: -signal.SIGKILL}
    if codes != expected:  # a replica missing: the launcher's deadline ended it
        raise RuntimeError(f"replica exit codes {codes}, expected {expected}")
    gens = generations(store, args.steps)
    if [len(m) for _, _, m in gens] != [n, n - 1, n] or n not in gens[-1][2]:
        raise RuntimeError(f"generations {gens}: expected {n}, {n - 1}, {n} ranks (with {n})")
    live = gens[-1][2]
    blobs = [io.BytesIO(store.get(f"final/{m}")) for m in live]
    finals = [torch.load(b, weights_only=True, map_location="cpu") for b in blobs]
    for m, state in zip(live, finals):
        if not all(torch.equal(a, b) for a, b in zip(state, finals[0])):
            raise RuntimeError(f"replica {m}'s weights or momentum differ from replica {live[0]}'s")
    worst = max((a - b).abs().max().item() for a, b in zip(finals[0], replay(args, gens)))
    if worst > 1e-9:
        raise RuntimeError(f"the final state differs from the one-process replay by {worst:.2e}")
    history = ", ".join(f"steps {s}-{e - 1} on replicas {m}" for s, e, m in gens)
    print(f"replica {killed} killed at step {args.kill_step}; {history}")
    print(f"recovery: {recovery_s:.3f} s from the death to the next completed step")
    ok = f"OK: {args.steps} steps, replica {killed} SIGKILLed and replaced without a restart; "
    print(ok + f"the {n} live replicas are identical and equal a one-process replay ({worst:.1e})")


def refuse(args):
    if "RANK" in os.environ:  # started by torchrun (or a platform): each rank would launch N
        why = "the replicas cannot be one torchrun job (its agent stops every worker when one dies)"
        raise UsageError(f"{why}: run python launch/fault_tolerant_ddp.py --nproc N")
    if args.nproc < 2:
        raise UsageError(f"--nproc {args.nproc}: needs 2 replicas or more (one dies, one goes on)")
    if args.backend not in (None, "gloo") or args.device not in (None, "cpu"):
        raise UsageError("Gloo groups on CPU tensors only; for NCCL see launch/README.md")
    if args.kill_rank >= args.nproc:
        raise UsageError(f"--kill-rank {args.kill_rank}: there are replicas 0..{args.nproc - 1}")
    if args.kill_step + args.rejoin_after >= args.steps:
        raise UsageError(f"--kill-step + --rejoin-after leave no step of --steps {args.steps}")


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.set_defaults(timeout=os.environ.get("DIST_TIMEOUT", "10"))
    parser.add_argument("--steps", type=int_in(2, 10_000), default=12, help="training steps")
    parser.add_argument("--kill-rank", type=int_in(0, 4095), help="default: the last replica")
    parser.add_argument("--kill-step", type=int_in(1, 10_000), help="default: --steps // 2")
    parser.add_argument("--rejoin-after", type=int_in(1, 10_000), default=2,
                        help="steps on the survivors before the replacement joins")  # fmt: skip
    parser.add_argument("--batch", type=int_in(1, 4096), default=8, help="rows per replica")
    parser.add_argument("--lr", type=float_in(0, 1, low_open=True), default=0.05, help="SGD lr")
    args = parser.parse_args()
    args.nproc = args.nproc or 2
    args.kill_rank = args.nproc - 1 if args.kill_rank is None else args.kill_rank
    args.kill_step = args.steps // 2 if args.kill_step is None else args.kill_step
    try:
        refuse(args)
    except UsageError as error:
        sys.stderr.write(f"error: {error}\n")
        sys.exit(2)
    check(args, *launch(args))
