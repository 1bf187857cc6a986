"""Training that goes on when a replica dies: no restart; survivors regroup, a replacement joins.

N replicas train one small MLP, each on a batch of its own, gradients averaged by all_reduce over
a Gloo group. At --kill-step replica --kill-rank SIGKILLs its own process. The survivors see their
all_reduce fail, free the old group, agree in the store on who is left, build a new Gloo group
(the next generation, ranks renumbered) and redo the failed step among themselves; --rejoin-after
steps later a replacement joins and receives the weights and momentum by broadcast before its
first step. A death is seen at once (the kernel closes the dead process's sockets, and each
survivor closes its own by freeing the old group); what closes none (a lost machine) only after
--timeout.

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


# Every key of the store, in one place (gen: a generation, one group of replicas; rid: a replica's
# id, never reused). The launcher writes gen 0's members, DEAD and JOINER; the replicas the rest.
MEMBERS = "gen{gen}/members"  # generation gen's replica ids, in rank order (JSON)
DEAD = "dead/{rid}"  # the launcher saw replica rid SIGKILLed
JOINER = "joiner"  # the id of the replacement the launcher started
GROUP = "gen{gen}/group"  # the prefix of the keys that generation gen's Gloo group makes
HERE = "gen{gen}/here/{rid}"  # replica rid, a survivor, is ready for generation gen
ADMITTED = "admitted/{rid}"  # the generation the replacement rid joins
PROGRESS = "progress"  # steps completed: the launcher times the recovery by it
STARTED = "gen{gen}/start"  # the step generation gen started at (for the check)
FINAL = "final/{rid}"  # replica rid's final weights and momentum (for the check)


def launch(args):
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    store.set(MEMBERS.format(gen=0), json.dumps(list(range(args.nproc))))
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
                    died = time.monotonic()  # within 10 ms of the death (this loop's sleep)
                    store.set(DEAD.format(rid=rid), "")  # survivors stop waiting for it
                    store.set(JOINER, str(args.nproc))  # a new id: the dead one's stays dead
                    start(args.nproc)
        if died and not resumed and int(store.get(PROGRESS)) > args.kill_step:
            resumed = time.monotonic()  # the failed step, redone, has completed
        time.sleep(0.01)
    return store, codes, resumed - died if resumed else None


def replica(args, rid, port):
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    torch.manual_seed(0)  # every replica builds the same model; a replacement is overwritten
    model, momenta = build()
    # the replacement waits until the survivors admit it into generation gen
    gen, step = (0, 0) if rid < args.nproc else (int(store.get(ADMITTED.format(rid=rid))), -1)
    members = json.loads(store.get(MEMBERS.format(gen=gen)))
    while step < args.steps:
        group_store = dist.PrefixStore(GROUP.format(gen=gen), store)  # apart from older groups'
        pg = dist.ProcessGroupGloo(group_store, members.index(rid), len(members), timeout)
        step = sync_state(model, momenta, pg, step)
        store.set(STARTED.format(gen=gen), str(step))  # for the check: which steps, which members
        admit = args.kill_step + args.rejoin_after if len(members) < args.nproc else args.steps
        new = None
        try:
            while step < min(admit, args.steps):
                if (rid, step) == (args.kill_rank, args.kill_step):
                    os.kill(os.getpid(), signal.SIGKILL)  # a real death: no exception, no exit
                train_step(model, momenta, pg, args, step)
                step += 1
                store.set(PROGRESS, str(step))
            new = members + [int(store.get(JOINER))] if step < args.steps else members
        except RuntimeError as error:  # the all_reduce failed: the next group redoes this step
            why = str(error).split("] ", 1)[-1].split(". ")[0]  # Gloo's message, less its path
            sys.stdout.write(f"[replica {rid}] step {step} failed: {why}\n")
        # Free the group: its destructor closes its sockets, so a member still waiting in it for
        # us fails now, not at its timeout. (pg.abort() does nothing on Gloo in torch 2.13.)
        del pg
        if new is None:
            new = survivors(store, gen, rid, members, args.timeout)
        store.compare_set(MEMBERS.format(gen=gen + 1), "", json.dumps(new))  # first writer wins
        old, members = members, json.loads(store.get(MEMBERS.format(gen=gen + 1)))
        gen += 1
        for joined in set(members) - set(old):
            store.set(ADMITTED.format(rid=joined), str(gen))
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
    rng = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(size, 8, generator=rng, dtype=torch.float64, device="cpu")
    return x, torch.sin(x.sum(1, keepdim=True))


def train_step(model, momenta, pg, args, step):
    x, y = batch(step, pg.rank(), args.batch)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    # raises at once if a member died (the kernel closed its sockets) or freed the group
    dist.all_reduce(flat, group=pg)
    torch.nn.utils.vector_to_parameters(flat / pg.size(), [p.grad for p in model.parameters()])
    sgd_step(model, momenta, args.lr)  # after a completed all_reduce: a failed step changes nothing


def survivors(store, gen, rid, members, seconds):
    """Who arrives, once the others are reported dead by the launcher, or after `seconds`."""
    store.set(HERE.format(gen=gen + 1, rid=rid), "")
    deadline = time.monotonic() + seconds
    while True:
        here = [m for m in members if store.check([HERE.format(gen=gen + 1, rid=m)])]
        dead = [m for m in members if store.check([DEAD.format(rid=m)])]
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
    store.set(FINAL.format(rid=rid), buffer.getvalue())


def generations(store, steps):
    """[(first step, end step, members)] of every generation that took a step, from the store."""
    gens, gen = [], 0
    while store.check([STARTED.format(gen=gen)]):
        members = json.loads(store.get(MEMBERS.format(gen=gen)))
        gens.append((int(store.get(STARTED.format(gen=gen))), members))
        gen += 1
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
    # Nothing in the regroup waits for --timeout: the death closes the dead replica's sockets, the
    # survivors free the old group (closing theirs), the launcher reports the death at once
    if recovery_s is not None and not recovery_s < args.timeout / 2:
        raise RuntimeError(
            f"recovery took {recovery_s:.2f} s, not under half of --timeout {args.timeout:g}: "
            "a wait ran out its timeout instead of seeing the death"
        )
    n, killed = args.nproc, args.kill_rank
    expected = {**{rid: 0 for rid in range(n + 1)}, killed: -signal.SIGKILL}
    if codes != expected:  # a replica missing: the launcher's deadline ended it
        raise RuntimeError(f"replica exit codes {codes}, expected {expected}")
    gens = generations(store, args.steps)
    if [len(m) for _, _, m in gens] != [n, n - 1, n] or n not in gens[-1][2]:
        raise RuntimeError(f"generations {gens}: expected {n}, {n - 1}, {n} ranks (with {n})")
    live = gens[-1][2]
    blobs = [io.BytesIO(store.get(FINAL.format(rid=m))) for m in live]
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
    if args.backend not in (None, "gloo"):
        raise UsageError(f"--backend {args.backend}: Gloo groups only; NCCL: see launch/README.md")
    if args.device not in (None, "cpu"):
        raise UsageError(f"--device {args.device}: CPU tensors only (Gloo); see launch/README.md")
    if args.timeout < 2:  # the check wants a recovery under half of it: 0.1 s at most, measured
        raise UsageError(f"--timeout {args.timeout:g}: use 2 s or more (see launch/README.md)")
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
