"""HSDP: fully_shard on a 2-D mesh (replicate, shard): shard inside a group, replicate across groups.

With N = R x S ranks, init_device_mesh(..., (R, S), mesh_dim_names=("replicate", "shard")) puts the
ranks in a grid: row i is a shard group (S ranks that split the model between them, as FSDP does),
column j a replicate group (R ranks holding the same shard, as DDP does). fully_shard(m, mesh=mesh)
with a 2-D mesh gives every parameter the placements (Replicate(), Shard(0)); in backward each
block's gradients are reduce_scattered inside the shard group, then all_reduced across the
replicate group. The lesson prints what each rank holds and which collectives ran on which group,
checks that training equals one process on the whole batch (as DDP does), and measures the mesh
mistakes: a 2-D mesh where a 1-D one was meant, and the 1-D mesh["shard"] where the 2-D one was meant.

    torchrun --nproc_per_node=4 fsdp_basics/hsdp.py
    python fsdp_basics/hsdp.py --nproc 2 --replicas 2

Docs: https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html (the mesh argument: HSDP)
      https://pytorch.org/docs/stable/distributed.html#torch.distributed.device_mesh.init_device_mesh
"""

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from launch.dist_setup import lesson_parser, print0, print_in_order, run, test_flags
from toy import BlockMLP, make_data, rank_batch, storage_bytes, train_one_process


def main(args, ctx):
    R = (
        args.replicas
        if args.replicas is not None
        else 2
        if ctx.world_size % 2 == 0 and ctx.world_size >= 4
        else 1
    )
    ctx.require(
        R >= 1 and ctx.world_size % R == 0,
        f"--replicas {R} must be at least 1 and divide the "
        f"{ctx.world_size} ranks (the mesh is replicas x world_size/replicas)",
    )
    ctx.require(
        args.batch % ctx.world_size == 0,
        f"--batch {args.batch} must divide by {ctx.world_size} ranks",
    )
    x, y = (t.to(ctx.device) for t in make_data(args.batch * args.steps))
    torch.manual_seed(0)  # the same initial model on every rank (drawn on the CPU, then moved)
    model = BlockMLP(args.width, args.depth).to(ctx.device)
    reference = copy.deepcopy(model)  # for the checks

    # dim 0 replicates, dim 1 shards, by position: a 2-D mesh must be named, but the names are not read
    # (torch 2.13: _get_mesh_info and its checks in torch/distributed/fsdp/_fully_shard/_fsdp_init.py)
    mesh = init_device_mesh(
        ctx.device.type, (R, ctx.world_size // R), mesh_dim_names=("replicate", "shard")
    )
    dp_mesh = (
        mesh["shard"] if args.shard_mesh_only else mesh
    )  # the flag: no all_reduce across replicas
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)  # params: DTensors (Replicate(), Shard(0)) on the 2-D mesh
    fully_shard(model, mesh=dp_mesh)  # the root: inp and head
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)  # after fully_shard: it sees the shards
    losses = []
    for step in range(args.steps):
        xb, yb = rank_batch(x, y, step, args.batch, ctx)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()  # per block, last to first: all_gather, gradients, reduce_scatter, then all_reduce
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())

    print_mesh_and_shards(model, mesh)
    worst = check_matches_one_process(model, losses, reference, x, y, args)
    counts = check_collectives_per_step(model, mesh, x, y, args, ctx)
    two_d, flat = measure_mesh_mistakes(reference, mesh, x, y, args, ctx)
    print0(
        f"OK: HSDP on {R}x{ctx.world_size // R} ranks trains like one process for {args.steps} steps "
        f"(max diff {worst:.1e}); per step {counts}; a 2-D mesh where a 1-D was meant holds "
        f"{two_d:.3f} of the model per rank instead of {flat:.3f}"
    )


def group_names(mesh):
    """{ranks of this rank's group: name} for the two dims of the mesh (at 1 rank both are [0]: "replicate")."""
    return {
        tuple(dist.get_process_group_ranks(mesh.get_group(name))): name
        for name in ("shard", "replicate")
    }


def print_mesh_and_shards(model, mesh):
    print0(
        f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}: {mesh.mesh.tolist()} (rows: shard groups, "
        f"columns: replicate groups)"
    )
    param, whole = model.blocks[0].fc.weight, 4 * sum(p.numel() for p in model.parameters())
    mine = storage_bytes(model.parameters())
    print_in_order(
        f"groups {', '.join(f'{n} {list(g)}' for g, n in group_names(mesh).items())}; "
        f"blocks.0.fc.weight {param.placements} local {tuple(param.to_local().shape)} of "
        f"{tuple(param.shape)}; params {mine} B of {whole} B ({mine / whole:.3f})"
    )


def check_matches_one_process(model, losses, reference, x, y, args):
    """HSDP reduces each gradient in two collectives (reduce_scatter over S ranks, all_reduce over R) where one
    process sums one batch: float32 rounding only, as in fsdp_minimal.py's check, hence --tol 1e-4.
    float32 matmuls stay float32 on GPUs: TF32 is off by default (docs notes/cuda.html, TF32 section)."""
    ref_losses = train_one_process(reference, x, y, args.batch, args.steps, args.lr)
    losses = torch.stack(losses)
    dist.all_reduce(losses, op=dist.ReduceOp.AVG)  # equal shares: the loss of the global batch
    worst_loss = (losses - ref_losses).abs().max().item()
    # full_tensor() gathers the shards (over "shard"; "replicate" already holds the same on each row)
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


@contextlib.contextmanager
def record_collectives(log):
    """Append (name, ranks of its group) for each call FSDP2 makes: in torch 2.13 it calls these three
    through the torch.distributed module (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py),
    so wrapping the module's attributes sees them. (CommDebugMode in torch.distributed.tensor.debug
    counts them too, but does not say on which group.)"""
    saved = {
        name: getattr(dist, name)
        for name in ("all_gather_single", "reduce_scatter_single", "all_reduce")
    }

    def recorded(name, call):
        def wrapper(*a, group=None, **kw):
            log.append((name, tuple(dist.get_process_group_ranks(group or dist.group.WORLD))))
            return call(*a, group=group, **kw)

        return wrapper

    try:
        for name, call in saved.items():
            setattr(dist, name, recorded(name, call))
        yield log
    finally:
        for name, call in saved.items():
            setattr(dist, name, call)


def check_collectives_per_step(model, mesh, x, y, args, ctx):
    """One more forward + backward, recorded: all_gather and reduce_scatter on the shard group, then one
    all_reduce per FSDP group (the depth blocks and the root) across the replicate group."""
    xb, yb = rank_batch(x, y, 0, args.batch, ctx)
    with record_collectives([]) as log:
        F.cross_entropy(model(xb), yb).backward()
    model.zero_grad()
    names, counts = group_names(mesh), {}
    for name, ranks in log:
        key = f"{name} ({names.get(ranks, list(ranks))})"
        counts[key] = counts.get(key, 0) + 1
    summary = ", ".join(f"{n} {key}" for key, n in counts.items())
    print_in_order(f"one step ran: {summary or 'no collective'}")
    # torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py: the all_reduce runs for every
    # 2-D mesh (HSDPMeshInfo), even across a replicate dim of 1 rank; all_gather and reduce_scatter are
    # skipped on a shard dim of 1 rank (there and in _fsdp_collectives.py's foreach_reduce).
    S, groups = mesh.shape[1], args.depth + 1  # one FSDP group per block, and the root
    wrong = [
        key
        for key in counts
        if not (key == "all_reduce (replicate)" or key.endswith("(shard)") and S > 1)
    ]
    scatters = counts.get("reduce_scatter_single (shard)", 0)
    if counts.get("all_reduce (replicate)") != groups or scatters != groups * (S > 1) or wrong:
        raise RuntimeError(
            f"expected {groups} all_reduce (replicate) and {groups * (S > 1)} reduce_scatter_single "
            f"(shard), nothing on another group; got {summary}"
        )
    return summary


def measure_mesh_mistakes(reference, mesh, x, y, args, ctx):
    """One step of a copy of the model under each mesh. Neither mistake raises or warns: what shows them is
    the placements, the bytes, the all_reduces and the replicas disagreeing. Returns the share of the
    model per rank with the 2-D mesh and with the 1-D mesh of all ranks."""
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
        xb, yb = rank_batch(x, y, 0, args.batch, ctx)
        if (
            args.same_probe_batch
        ):  # every rank the same rows: replicas agree even without their all_reduce
            xb, yb = x[: len(xb)], y[: len(yb)]
        with record_collectives([]) as log:
            F.cross_entropy(probe(xb), yb).backward()
        opt.step()
        whole = torch.cat([p.full_tensor().flatten() for p in probe.parameters()])
        hi, lo = (
            whole.clone(),
            whole.clone(),
        )  # each parameter's copies on the replicas: equal after a step?
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=mesh.get_group("replicate"))
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=mesh.get_group("replicate"))
        share = storage_bytes(probe.parameters()) / (4 * whole.numel())
        rows[label] = (
            str(probe.blocks[0].fc.weight.placements),
            share,
            sum(name == "all_reduce" for name, _ in log),
            (hi - lo).abs().max().item(),
        )
    print0(
        f"fully_shard(model, mesh=M)   {'placements':<28} share/rank  all_reduce/step  replicas differ by"
    )
    for label, (placements, share, all_reduces, spread) in rows.items():
        print0(f"  {label:<26} {placements:<28} {share:>10.3f}  {all_reduces:>15}  {spread:.2e}")
    (_, flat, _, _), (_, two_d, _, _), (_, _, _, drift) = rows.values()
    # Adam's first step moves a weight by about lr whatever the size of its gradient: replicas that saw
    # different batches, unreduced, differ by up to 2 lr; lr / 10 tells that from rounding.
    if mesh.shape[0] > 1 and not (
        two_d > flat and drift > args.lr / 10
    ):  # the demonstration must show both
        raise RuntimeError(
            f"expected the 2-D mesh to hold more than the 1-D ({two_d} vs {flat}) and "
            f'mesh["shard"] to let the replicas drift apart ({drift:.1e})'
        )
    return two_d, flat


if __name__ == "__main__":
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="R, the size of mesh dim 0 (default: 2 if the world size is even and >= 4, else 1)",
    )
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument(
        "--batch", type=int, default=48, help="global batch, divisible by the world size"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument(
        "--tol", type=float, default=1e-4, help="largest |HSDP - one process| (loss, params)"
    )
    broken = test_flags(parser)
    broken.add_argument(
        "--shard-mesh-only",
        action="store_true",
        help='train with mesh["shard"] (1-D): no all_reduce across replicas',
    )
    broken.add_argument(
        "--same-probe-batch",
        action="store_true",
        help="the mistakes table's probes all see one batch: the missing all_reduce goes unseen",
    )
    run(main, parser.parse_args())
