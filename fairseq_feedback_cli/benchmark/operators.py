"""Operators per target step of a training step: on the CPU those dispatched (each would be a
kernel on a GPU), the feedback loop's as a GPU replays it; on a GPU the profiler's kernels and
the share of the step's wall time the GPU is busy."""

import collections
import contextlib
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from .graphs import awaiting_capture, graphs_state, loop_as_a_gpu_replays_it
from .measure import WARM_UP_CALLS, synchronize


class CountOps(TorchDispatchMode):
    """Operators that reach a backend (each would be a kernel on a GPU), views
    and allocations left out, by phase of a training step and by kind."""

    def __init__(self):
        super().__init__()
        self.kinds = collections.defaultdict(collections.Counter)  # phase -> operator -> count
        self.current = "training step"

    @property
    def count(self) -> int:
        return sum(sum(kinds.values()) for kinds in self.kinds.values())

    @contextlib.contextmanager
    def phase(self, name: str):
        previous, self.current = self.current, name
        try:
            yield
        finally:
            self.current = previous

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func.namespace == "profiler"  # record_function's markers
                or func._schema.name in ("aten::empty", "aten::empty_strided", "aten::detach")):
            self.kinds[self.current][func._schema.name.replace("aten::", "")] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def replayed_as_a_gpu_replays_it(model, work, warm_up: int = WARM_UP_CALLS):
    """Within, `work` (a training step) runs as a GPU replays it, on any
    device: the feedback loop through the graphs' path (on the CPU with the
    stand-in for capture), warmed up first. `warm_up`: calls at most
    before, through the graphs' path, until one captures nothing and checks
    nothing (a shape's first sighting runs eagerly, its second captures, a
    cache's first graphs are checked again at new inputs, and a stream's
    memory takes a few blocks to fill its span, a graph per length)."""
    work()
    with loop_as_a_gpu_replays_it(model):
        for _ in range(warm_up):
            before = graphs_state(model)
            work()
            if graphs_state(model) == before and not awaiting_capture(model):
                break
        yield


def counted_as_a_gpu_replays_it(model, work, warm_up: int = WARM_UP_CALLS) -> CountOps:
    """The operators of one call of `work` (a training step), on any device
    dispatched rather than launched: the feedback loop's as a GPU replays it
    (replayed_as_a_gpu_replays_it)."""
    with replayed_as_a_gpu_replays_it(model, work, warm_up), CountOps() as ops:
        work(ops)
    return ops


def busy_share(intervals, wall_us: float) -> float:
    """The share of `wall_us` covered by the kernels' (start, end) `intervals` (their union)."""
    busy, reach = 0.0, float("-inf")
    for begin, end in sorted(intervals):
        busy += max(0.0, end - max(begin, reach))
        reach = max(reach, end)
    return busy / wall_us


def kernels_and_busy_share(model, work, steps_per_call: int, device: torch.device):
    """Kernels per target step (one position of every row) of one call of
    `work`, and the share of its wall time that the GPU spends running them
    (measured under the profiler, so a lower bound; None on the CPU, where
    the count is of dispatched operators, the feedback loop's as a GPU
    replays it)."""
    if device.type != "cuda":
        return counted_as_a_gpu_replays_it(model, work).count / steps_per_call, None
    # CUDA only, from here: the profiler's kernels
    work()
    synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        work()
        synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    kernels = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return len(kernels) / steps_per_call, busy_share(kernels, wall_us)
