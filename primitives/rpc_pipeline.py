"""rpc_pipeline: a model split over workers, trained from one driver with torch.distributed.rpc.

RPC runs a function on another process and hands back its result (rpc_sync, rpc_async) or a
reference to it that stays where it was made (remote -> RRef; .to_here() fetches it). Distributed
autograd follows a forward pass across those calls, so one backward computes every worker's
gradients; the distributed optimizer then steps each parameter where it lives. Here rank 0 drives:
it sends its batch to stage 1 on worker 1, whose output (an RRef) goes to stage 2 on the last
worker; the loss, the backward and the optimizer step start from rank 0. No process group: RPC
needs none (run(..., init_process_group=False)).

RPC is in maintenance mode (the rpc docs page, torch 2.9 onwards), and on CUDA RRefs, distributed
autograd and the distributed optimizer are unsupported (same page): tensors stay on the CPU here.
Pipelines today use torch.distributed.pipelining (transformer_basics/pipeline_parallel.py); weights
reach inference workers by collectives (primitives/weight_sync.py). RPC unpickles what peers
send (any peer can run code in your process): listen only where trusted peers reach.

    torchrun --nproc_per_node=3 primitives/rpc_pipeline.py
    python primitives/rpc_pipeline.py --nproc 2      # both stages on worker 1

Docs: https://docs.pytorch.org/docs/stable/rpc.html
"""

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.optim import DistributedOptimizer

from launch.dist_setup import float_in, int_in, lesson_parser, run


class SGD(torch.optim.SGD):
    """For torch.optim.SGD itself DistributedOptimizer builds _FunctionalSGD (optimizer.py's
    functional_optim_map), by jit.script in torch 2.13 (deprecated: it warns), unscripted in 2.14.1
    but warning all the same; a subclass is stepped as it is. Importing torch.distributed.optim
    warns in 2.13 (@torch.jit.script on _FunctionalSGD), not in 2.14.1."""


class Stage(nn.Module):
    def __init__(self, dim_in, dim_out, seed):
        super().__init__()
        self.layer = nn.Linear(dim_in, dim_out, device="cpu")
        # the one-process check's weights; not torch.manual_seed: RPC threads build stages at once
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.layer.parameters():
                p.uniform_(-(dim_in**-0.5), dim_in**-0.5, generator=g)  # nn.Linear's range

    def forward(self, x_rref):
        return torch.tanh(self.layer(x_rref.to_here()))

    def parameter_rrefs(self):
        return [rpc.RRef(p) for p in self.parameters()]


def main(args, ctx):
    ctx.require(ctx.world_size >= 2, "needs at least 2 ranks: rank 0 drives, the others compute")
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=args.timeout)  # env:// rendezvous
    rpc.init_rpc(f"worker{ctx.rank}", rank=ctx.rank, world_size=ctx.world_size,
                 rpc_backend_options=options)  # fmt: skip
    if ctx.rank == 0:
        x, y = batch(args)
        stage1 = rpc.remote("worker1", Stage, args=(args.dim, args.hidden, 1))
        stage2 = rpc.remote(f"worker{ctx.world_size - 1}", Stage, args=(args.hidden, 1, 2))
        params = stage1.rpc_sync().parameter_rrefs() + stage2.rpc_sync().parameter_rrefs()
        optimizer = DistributedOptimizer(SGD, params, lr=args.lr)
        losses = []
        for step in range(args.steps):
            with dist_autograd.context() as context_id:
                hidden = stage1.remote().forward(rpc.RRef(x))  # stays on worker 1
                out = stage2.rpc_sync().forward(hidden)  # comes back to the driver
                loss = ((out - y) ** 2).mean()
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
            losses.append(loss.item())
            print(f"step {step}: loss {losses[-1]:.6f}", flush=True)
        check_against_one_process(args, x, y, losses, [stage1, stage2], ctx.world_size)
    rpc.shutdown()  # waits until every worker is done, then all leave together


# ---- The lesson ends here. What follows is how it checks itself. ----


def batch(args):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.dim, generator=g, device="cpu")
    return x, x.sum(1, keepdim=True).tanh()


def check_against_one_process(args, x, y, losses, stage_rrefs, world):
    """The same two stages in this process, trained by plain autograd and SGD."""
    stages = [Stage(args.dim, args.hidden, 1), Stage(args.hidden, 1, 2)]
    optimizer = torch.optim.SGD([p for s in stages for p in s.parameters()], lr=args.lr)
    expected = []
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = ((stages[1](rpc.RRef(stages[0](rpc.RRef(x)))) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    owners, asked = [r.owner_name() for r in stage_rrefs], ["worker1", f"worker{world - 1}"]
    if owners != asked:  # trains the same wherever the stages live: the owner says where
        raise RuntimeError(f"the stages live on {owners}, not on {asked} as the lesson says")
    remote = [p.to_here() for r in stage_rrefs for p in r.rpc_sync().parameter_rrefs()]
    local = [p.detach() for s in stages for p in s.parameters()]
    # float32, the same operations in the same order: only the order of a sum could differ
    loss_error = max(abs(a - b) for a, b in zip(losses, expected))
    param_error = max((a - b).abs().max().item() for a, b in zip(remote, local))
    if loss_error > 1e-6 or param_error > 1e-6:
        raise RuntimeError(
            f"RPC training differs from one process: losses by {loss_error:.1e}, "
            f"parameters by {param_error:.1e}"
        )
    if not losses[-1] < losses[0]:
        raise RuntimeError(f"the loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
    where = " and ".join(dict.fromkeys(owners))  # worker1, or worker1 and the last
    print(
        f"OK: the model on {where}, trained from rank 0 over RPC, matches one process "
        f"(losses within {loss_error:.1e}, parameters within {param_error:.1e})",
        flush=True,
    )


if __name__ == "__main__":
    parser = lesson_parser(__doc__, min_ranks=2)
    parser.add_argument("--steps", type=int_in(2, 1000), default=5)
    parser.add_argument("--batch", type=int_in(1, 100_000), default=16)
    parser.add_argument("--dim", type=int_in(1, 100_000), default=8)
    parser.add_argument("--hidden", type=int_in(1, 100_000), default=16)
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=0.1)
    args = parser.parse_args()
    run(main, args, init_process_group=False)
