"""What transformer_basics/pipeline_schedules.py measures with: what each pipeline stage ran and
when (F, B, I, W), and the order each rank ran replayed in ticks. Not a lesson: imported."""

import time

import torch.distributed as dist


def record_timeline(stages):
    """Wrap the stage methods the schedule calls (torch 2.13, schedules.py) to note what ran when:
    F, B, I (input gradient), W (weight gradient); and count the sends it hands to the batch."""
    dist.barrier()  # the ranks start the step together: their seconds count from here
    timeline = dict(t0=time.perf_counter(), events=[], sends=0)
    for stage in stages:
        for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            wrap(stage, method, timeline)
        for method in ("get_fwd_send_ops", "get_bwd_send_ops"):
            wrap(stage, method, timeline)
    return timeline


def wrap(stage, method, timeline):
    call = getattr(stage, method)
    kind = {"forward_one_chunk": "F", "backward_weight_one_chunk": "W"}.get(method, "B")

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = call(*args, **kwargs)
        if method.endswith("send_ops"):
            timeline["sends"] += len(out)
        else:  # backward_one_chunk(full_backward=False): the input gradient only
            split = kind == "B" and not kwargs.get("full_backward", True)
            event = ("I" if split else kind, args[0], stage.stage_index, start)
            timeline["events"].append((*event, time.perf_counter()))
        return out

    setattr(stage, method, wrapper)


TICKS = {"F": 1, "I": 1, "W": 1, "B": 2}  # a full backward = input gradient + weight gradient


def replay(orders, n):
    """Run each rank's recorded order again, each action costing TICKS and sends free: an action
    starts when its rank is free and its inputs exist (F of stage s needs F of s-1; I or B of s
    needs F of s and I of s+1; W needs I). Per rank: [(start tick, kind, micro-batch, stage)]."""
    done, free, at, slots = {}, [0] * len(orders), [0] * len(orders), [[] for _ in orders]
    while any(at[r] < len(order) for r, order in enumerate(orders)):
        before = sum(at)
        for r, order in enumerate(orders):
            while at[r] < len(order):
                kind, mb, s = order[at[r]]
                needs = [("F", s - 1, mb)] if kind == "F" and s > 0 else []
                needs += [("F", s, mb)] + [("G", s + 1, mb)] * (s < n - 1) if kind in "BI" else []
                needs += [("G", s, mb)] if kind == "W" else []
                if not all(d in done for d in needs):
                    break
                start = max([free[r]] + [done[d] for d in needs])
                free[r] = start + TICKS[kind]
                for key in {"F": "F", "I": "G", "W": "W", "B": "GW"}[kind]:
                    done[(key, s, mb)] = free[r]
                slots[r].append((start, kind, mb, s))
                at[r] += 1
        if sum(at) == before:
            raise RuntimeError(f"the recorded orders cannot be replayed: {orders}")
    return slots
