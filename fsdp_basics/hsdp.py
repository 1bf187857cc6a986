"""HSDP: fully_shard on a 2-D mesh (replicate, shard): shard inside a group, replicate across.

With N = R x S ranks, init_device_mesh(..., (R, S), mesh_dim_names=("replicate", "shard")) puts the
ranks in a grid: row i is a shard group (S ranks that split the model between them, as FSDP does),
column j a replicate group (R ranks holding the same shard, as DDP does). fully_shard(m, mesh=mesh)
with a 2-D mesh gives every parameter the placements (Replicate(), Shard(0)); in backward each
block's gradients are reduce_scattered inside the shard group, then all_reduced across the
replicate group. R defaults to the smallest divisor of N above 1: 2 x 1 at 2 ranks (replicas
only), 2 x 2 at 4 (both). The lesson prints what each rank holds and which collectives ran on
which group, and checks that training equals one process on the whole batch (as DDP does); its
checks (below the divider) also train one step under each mesh mistake, neither of which raises:
a 2-D mesh where a 1-D one was meant, and the 1-D mesh["shard"] where the 2-D one was.

    torchrun --nproc_per_node=4 fsdp_basics/hsdp.py
    python fsdp_basics/hsdp.py --nproc 2 --replicas 2

run(): init_process_group, main(args, ctx), destroy_process_group. --nproc: for plain python.

Docs: https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html (the mesh argument: HSDP)
      https://pytorch.org/docs/stable/distributed.html#torch.distributed.device_mesh.init_device_mesh
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard

from launch.dist_setup import float_in, int_in, lesson_parser, print0, print_in_order, run
from toy import BlockMLP, make_data, rank_batch, train_one_process
from toy import record_collectives, storage_bytes  # for the checks


def main(args, ctx):
    n = ctx.world_size
    # R: unless asked, n's smallest divisor above 1 (2 x 1 at 2 ranks, 2 x 2 at 4; 1 x 1 at 1)
    R = args.replicas or min((r for r in range(2, n + 1) if n % r == 0), default=1)
    ctx.require(n % R == 0, f"--replicas {R} must divide the {n} ranks (the mesh is R x N/R)")
    ctx.require(args.batch % n == 0, f"--batch {args.batch} must divide by {n} ranks")
    x, y = (t.to(ctx.device) for t in make_data(args.batch * args.steps))
    torch.manual_seed(0)  # the same initial model on every rank (drawn on the CPU, then moved)
    model = BlockMLP(args.width, args.depth).to(ctx.device)
    reference = copy.deepcopy(model)  # for the checks

    # dim 0 replicates, dim 1 shards, by position: a 2-D mesh must be named, but the names are not
    # read (torch 2.13: _get_mesh_info in torch/distributed/fsdp/_fully_shard/_fsdp_init.py)
    mesh = init_device_mesh(
        ctx.device.type, (R, ctx.world_size // R), mesh_dim_names=("replicate", "shard")
    )
    for block in model.blocks:
        fully_shard(block, mesh=mesh)  # params: DTensors (Replicate(), Shard(0)) on the 2-D mesh
    fully_shard(model, mesh=mesh)  # the root: inp and head
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)  # after fully_shard: it sees the shards
    losses = []
    for step in range(args.steps):
        xb, yb = rank_batch(x, y, step, args.batch, ctx)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()  # per block: all_gather, gradients, reduce_scatter, then all_reduce
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())

    worst = check_matches_one_process(model, losses, reference, x, y, args)
    counts = check_collectives_per_step(model, R, x, y, args, ctx)
    check_mesh_and_shards(model, mesh, R, args, ctx)
    two_d, flat = measure_mesh_mistakes(reference, mesh, x, y, args, ctx)
    print0(
        f"OK: HSDP on {mesh.shape[0]}x{mesh.shape[1]} ranks trains like one process for "
        f"{args.steps} steps (max diff {worst:.1e}); per step {counts}; a 2-D mesh where a 1-D "
        f"was meant holds {two_d:.3f} of the model per rank instead of {flat:.3f}"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def expected_groups(R, world_size, rank):
    """{"shard": the ranks of this rank's row of the R x S grid, "replicate": those of its column},
    from R, S and the rank alone (not from the mesh)."""
    S = world_size // R
    row, column = divmod(rank, S)
    return {
        "shard": list(range(row * S, row * S + S)),
        "replicate": list(range(column, world_size, S)),
    }


def check_mesh_and_shards(model, mesh, R, args, ctx):
    """Read from the objects built: the mesh has the shape (R, N/R) and the dim names ("replicate",
    "shard") in that order, each name's group is this rank's row or column of the grid, and the
    parameters are (Replicate(), Shard(0)), this rank holding its torch.chunk of the rows among the
    S ranks of its row (its place there: rank % S), 1/S of the bytes. (A swapped shape or swapped
    names train and print, and are the other layout.)"""
    S, names, param = ctx.world_size // R, mesh.mesh_dim_names, model.blocks[0].fc.weight
    groups = {n: dist.get_process_group_ranks(mesh.get_group(n)) for n in names or ()}
    print0(f"mesh {tuple(mesh.shape)} {names}: {mesh.mesh.tolist()} (rows: the shard groups)")
    mine, whole = storage_bytes(model.parameters()), 4 * sum(p.numel() for p in model.parameters())
    print_in_order(
        f"groups {', '.join(f'{n} {g}' for n, g in sorted(groups.items(), reverse=True))}; "
        f"blocks.0.fc.weight {param.placements} local {tuple(param.to_local().shape)} of "
        f"{tuple(param.shape)}; params {mine} B of {whole} B ({mine / whole:.3f})"
    )
    chunk = -(-args.width // S)
    rows = len(range(args.width)[ctx.rank % S * chunk :][:chunk])
    built = (tuple(mesh.shape), names, groups, param.placements, param.to_local().shape[0])
    asked = ((R, S), ("replicate", "shard"), expected_groups(R, ctx.world_size, ctx.rank))
    asked += ((Replicate(), Shard(0)), rows)
    if built != asked:
        raise RuntimeError(
            f"[rank {ctx.rank}] mesh, groups, placements, local rows built {built}, asked for "
            f"{asked}"
        )


def check_matches_one_process(model, losses, reference, x, y, args):
    """HSDP reduces each gradient in two collectives (reduce_scatter over S ranks, all_reduce over
    R) where one process sums one batch: float32 rounding only, hence --tol 1e-4 (as in
    fsdp_minimal.py's check, and why it holds on GPUs too)."""
    ref_losses = train_one_process(reference, x, y, args.batch, args.steps, args.lr)
    losses = torch.stack(losses)
    dist.all_reduce(losses, op=dist.ReduceOp.AVG)  # equal shares: the loss of the global batch
    worst_loss = (losses - ref_losses).abs().max().item()
    # full_tensor() gathers the shards (over "shard"; "replicate" holds the same on each row)
    worst = max(
        (p.full_tensor() - q).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters())
    )
    print0(
        f"steps 0..{args.steps - 1}: loss HSDP {losses[0]:.6f} -> {losses[-1]:.6f}, one process "
        f"{ref_losses[0]:.6f} -> {ref_losses[-1]:.6f}; max |loss diff| {worst_loss:.2e}, "
        f"max |param diff| {worst:.2e} (tolerance {args.tol:g})"
    )
    if worst > args.tol or worst_loss > args.tol:
        raise RuntimeError(f"HSDP and one process differ by {max(worst, worst_loss):.2e}")
    return max(worst, worst_loss)


def check_collectives_per_step(model, R, x, y, args, ctx):
    """One more forward + backward, recorded: all_gather and reduce_scatter on the shard group,
    then one all_reduce per FSDP group (the depth blocks and the root) across the replicate group.
    The groups are named from R and the rank (expected_groups), not from the mesh."""
    xb, yb = rank_batch(x, y, 0, args.batch, ctx)
    with record_collectives([]) as log:
        F.cross_entropy(model(xb), yb).backward()
    model.zero_grad()
    # at R = 1 or S = 1 both name the same ranks: "replicate" (the all_reduce) wins
    names = {tuple(g): n for n, g in expected_groups(R, ctx.world_size, ctx.rank).items()}
    counts = {}
    for name, ranks in log:
        key = f"{name} ({names.get(ranks, list(ranks))})"
        counts[key] = counts.get(key, 0) + 1
    summary = ", ".join(f"{n} {key}" for key, n in counts.items())
    print_in_order(f"one step ran: {summary or 'no collective'}")
    # torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py: the all_reduce runs for
    # every 2-D mesh (HSDPMeshInfo), even across a replicate dim of 1 rank; all_gather and
    # reduce_scatter are skipped on a shard dim of 1 rank (there and in foreach_reduce).
    S, groups = ctx.world_size // R, args.depth + 1  # one FSDP group per block, and the root
    wrong = [
        key
        for key in counts
        if not (key == "all_reduce (replicate)" or key.endswith("(shard)") and S > 1)
    ]
    scatters = counts.get("reduce_scatter_single (shard)", 0)
    if counts.get("all_reduce (replicate)") != groups or scatters != groups * (S > 1) or wrong:
        raise RuntimeError(
            f"expected {groups} all_reduce (replicate) and {groups * (S > 1)} "
            f"reduce_scatter_single (shard), nothing on another group; got {summary}"
        )
    return summary


def measure_mesh_mistakes(reference, mesh, x, y, args, ctx):
    """One step of a copy of the model under each mesh. Neither mistake raises or warns: what shows
    them is the placements, the bytes, the all_reduces and the replicas disagreeing. Returns the
    share of the model per rank with the 2-D mesh and with the 1-D mesh of all ranks."""
    rows, flat_mesh = {}, init_device_mesh(ctx.device.type, (ctx.world_size,))
    for label, probe_mesh in (
        (f"1-D mesh of all {ctx.world_size} ranks", flat_mesh),
        (f"2-D mesh {tuple(mesh.shape)}", mesh),
        ('mesh["shard"]', mesh["shard"]),
    ):
        probe = copy.deepcopy(reference)
        for block in probe.blocks:
            fully_shard(block, mesh=probe_mesh)
        fully_shard(probe, mesh=probe_mesh)
        opt = torch.optim.Adam(probe.parameters(), lr=args.lr)
        xb, yb = rank_batch(x, y, 0, args.batch, ctx)  # each rank its own rows
        with record_collectives([]) as log:
            F.cross_entropy(probe(xb), yb).backward()
        opt.step()
        whole = torch.cat([p.full_tensor().flatten() for p in probe.parameters()])
        hi, lo = whole.clone(), whole.clone()  # each parameter's copies on the replicas: equal?
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=mesh.get_group("replicate"))
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=mesh.get_group("replicate"))
        share = storage_bytes(probe.parameters()) / (4 * whole.numel())
        all_reduces = sum(name == "all_reduce" for name, _ in log)
        placements = str(probe.blocks[0].fc.weight.placements)
        rows[label] = (placements, share, all_reduces, (hi - lo).abs().max().item())
    print0(
        f"fully_shard(model, mesh=M)   {'placements':<28} share/rank  all_reduce/step  "
        "replicas differ by"
    )
    for label, (placements, share, all_reduces, spread) in rows.items():
        print0(f"  {label:<26} {placements:<28} {share:>10.3f}  {all_reduces:>15}  {spread:.2e}")
    (_, flat, _, _), (_, two_d, _, _), (_, _, _, drift) = rows.values()
    # Adam's first step moves a weight by about lr whatever the size of its gradient: replicas that
    # saw different batches, unreduced, differ by up to 2 lr; lr / 10 tells that from rounding.
    # The demonstration must show both.
    if mesh.shape[0] > 1 and not (two_d > flat and drift > args.lr / 10):
        raise RuntimeError(
            f"expected the 2-D mesh to hold more than the 1-D ({two_d} vs {flat}) and "
            f'mesh["shard"] to let the replicas drift apart ({drift:.1e})'
        )
    return two_d, flat


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--replicas",
        type=int_in(1, 4096),
        default=None,
        help="R, the size of mesh dim 0 (default: the smallest divisor of N above 1; 1 at N = 1)",
    )
    parser.add_argument("--width", type=int_in(1, 4096), default=64)
    parser.add_argument("--depth", type=int_in(1, 64), default=2)
    parser.add_argument(
        "--batch", type=int_in(1, 65536), default=48, help="global batch, divisible by N"
    )
    parser.add_argument("--steps", type=int_in(1, 10_000), default=10)
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=1e-2)
    parser.add_argument(
        "--tol", type=float_in(0, 1, low_open=True), default=1e-4, help="max |HSDP - one process|"
    )
    run(main, parser.parse_args())
