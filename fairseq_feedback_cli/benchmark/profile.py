"""Where a training step's time goes, kernel by kernel: one step profiled (torch.profiler), each
kernel (on a GPU) or operator (on the CPU: those that ops/step counts, each a kernel on a GPU) with
its count per target step, its time, its share of the step and the shapes it ran at. The next speed
step (fused attention over the span, epilogues, a fused step) is chosen from this table."""

import collections
import time
from typing import Dict, List

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from .measure import synchronize
from .operators import CountOps, busy_share, replayed_as_a_gpu_replays_it

TOP = 15  # the kernels or operators listed, by time; the rest summed in one line


def shapes_text(shapes) -> str:
    """[[8, 64], [64, 64], []] as "8x64, 64x64" (scalars and None left out)."""
    return ", ".join("x".join(map(str, shape)) for shape in shapes if shape) or "-"


def where_the_time_goes(model, work, steps_per_call: int, device: torch.device) -> dict:
    """One call of `work` (a training step, as a GPU replays it) profiled:
    its kernels (CUDA) or operators (elsewhere) grouped by name, the most
    time first, each with its count and time per target step (a position of
    every row), its share of the step's wall time and its most frequent
    shapes (a kernel's: those of the operator that launched it, where the
    profiler links them; a graph's replayed kernels have none). Also the
    kernels/step and GPU busy columns' figures ("counted per step": on the
    CPU the operators that ops/step counts, in a call of their own; "busy")."""
    gpu = device.type == "cuda"
    with replayed_as_a_gpu_replays_it(model, work):
        if not gpu:  # the operators that ops/step counts: the profiler also lists the calls around them
            with CountOps() as counted:
                work(counted)
            names = {f"aten::{kind}" for kinds in counted.kinds.values() for kind in kinds}
            counted_per_step, busy = counted.count / steps_per_call, None
        synchronize()
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if gpu else [])]
        with profile(activities=activities, record_shapes=True) as prof:
            start = time.perf_counter()
            work()
            synchronize()
            wall_us = (time.perf_counter() - start) * 1e6
    events = prof.events()
    if gpu:
        timed = kernels_and_their_shapes(events)
        counted_per_step = len(timed) / steps_per_call
        busy = busy_share([(e.time_range.start, e.time_range.end) for e in events
                           if e.device_type == DeviceType.CUDA], wall_us)
    else:
        def outermost(e) -> bool:
            parent = e.cpu_parent
            while parent is not None:
                if parent.name in names:
                    return False
                parent = parent.cpu_parent
            return True

        timed = [(e.name.replace("aten::", ""), e.cpu_time_total, shapes_text(e.input_shapes))
                 for e in events if e.name in names and outermost(e)]
    return {**profile_table(timed, steps_per_call, wall_us, "kernel" if gpu else "operator"),
            "counted per step": counted_per_step, "busy": busy}


def kernels_and_their_shapes(events) -> list:
    """(name, microseconds, shapes) of each CUDA kernel among a profile's events: the shapes of the
    operator that launched it (the one its record links to), or "(replayed from a graph)" where none did."""
    # Operators link to nothing. A CUDA runtime call (cudaLaunchKernel) is a CPU event too, but linked to
    # its operator as its kernel is, and its id is CUDA's correlation id, another counter than the
    # operators': among them, it would pass for the operator that has its number
    operators = {e.id: e for e in events if e.device_type == DeviceType.CPU and e.linked_correlation_id == 0}
    kernels = []
    for e in events:
        if e.device_type == DeviceType.CUDA:
            op = operators.get(e.linked_correlation_id)
            shapes = "(replayed from a graph)" if op is None else \
                f"{op.name.replace('aten::', '')} {shapes_text(op.input_shapes)}"
            kernels.append((e.name, e.time_range.elapsed_us(), shapes))
    return kernels


def profile_table(timed, steps_per_call: int, wall_us: float, kind: str) -> dict:
    """`timed`: (name, microseconds, shapes) of each kernel or operator of a step of `wall_us`."""
    count, total, shapes = collections.Counter(), collections.Counter(), collections.defaultdict(collections.Counter)
    for name, us, shape in timed:
        count[name] += 1
        total[name] += us
        shapes[name][shape] += 1
    rows: List[Dict] = [{kind: name, "per step": count[name] / steps_per_call,
                         "us per step": total[name] / steps_per_call, "share": total[name] / wall_us,
                         "shapes": "; ".join(s for s, _ in shapes[name].most_common(2))}
                        for name, _ in total.most_common()]
    rest = rows[TOP:]
    return {"kind": kind, "step ms": wall_us / 1000, "per step": len(timed) / steps_per_call,
            "share": sum(total.values()) / wall_us, "rows": rows[:TOP],
            "others": {"count": len(rest), "per step": sum(r["per step"] for r in rest),
                       "us per step": sum(r["us per step"] for r in rest), "share": sum(r["share"] for r in rest)}}


def print_profile(title: str, table: dict) -> None:
    kind = table["kind"]
    print(f"{title}: {table['step ms']:.1f} ms a step, {table['per step']:.1f} {kind}s per target step, "
          f"{table['share']:.0%} of the step in them")
    width = max([len(kind), *(len(row[kind][:60]) for row in table["rows"])]) + 2
    print(f"{kind:{width}s}{'per step':>10s}{'us/step':>10s}{'share':>8s}  shapes")
    for row in table["rows"]:
        print(f"{row[kind][:60]:{width}s}{row['per step']:10.1f}{row['us per step']:10.1f}{row['share']:8.1%}  "
              f"{row['shapes']}")
    others = table["others"]
    if others["count"]:
        name = f"{others['count']} others"
        print(f"{name:{width}s}{others['per step']:10.1f}{others['us per step']:10.1f}{others['share']:8.1%}")
    print()
