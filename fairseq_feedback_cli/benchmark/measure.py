"""Rates measured as the models' calls run in turns: each call timed (on a GPU, between
synchronizations), its result checked to be finite before a rate is reported, its peak memory
charged to its model; warm-up calls until graphs stop capturing."""

import argparse
import collections
import contextlib
import statistics
import time
from typing import Callable, Dict, Optional

import torch
from torch import Tensor

from .graphs import awaiting_capture, feedback_loop_in_mode, graph_statistics, graphs_captured


def synchronize():
    if torch.cuda.is_initialized():  # CUDA only
        torch.cuda.synchronize()


class NotFinite(Exception):
    """A result that is not finite: one line naming the model and the phase."""


class FiniteResults:
    """Whether each model's results of each phase were all finite, gathered
    on the device as the calls run (a timed call never waits for the GPU)
    and checked before a rate is reported."""

    def __init__(self):
        self.finite: Dict[tuple, Tensor] = {}  # (model, phase) -> a boolean on the device

    def record(self, model: str, phase: str, result: Tensor) -> None:
        finite = torch.isfinite(result).all()
        key = (model, phase)
        self.finite[key] = finite if key not in self.finite else self.finite[key] & finite

    def check(self) -> None:
        for (model, phase), finite in self.finite.items():
            if not finite:
                raise NotFinite(f"{model}: {phase} gave values that are not finite, so no rate is reported "
                                "(in fp16, try bf16 or fp32)")


class PeakMemory:
    """Each model's peak device memory in each phase, as
    torch.cuda.max_memory_allocated would read it with the model alone on
    the device, though the models run in turns in one process: what the
    model's own building and calls left allocated (weights, gradients,
    optimizer state, graphs, carried memory), plus the most that one of its
    calls allocated beyond what was allocated as that call began. The
    inputs, which all models share, are left out. Bytes, by (model, phase).

    `allocator`: the device's allocated() and peak() bytes and
    reset_peak(); None where nothing is measured (off CUDA)."""

    def __init__(self, allocator=None):
        self.allocator = allocator
        self.resident = collections.Counter()  # model -> bytes its building and calls left allocated
        self.peak: Dict[tuple, int] = {}

    @classmethod
    def on(cls, device: torch.device) -> "PeakMemory":
        if device.type != "cuda":
            return cls()
        # CUDA only: the caching allocator's figures (kept on the host: no synchronization needed)
        return cls(argparse.Namespace(allocated=torch.cuda.memory_allocated, peak=torch.cuda.max_memory_allocated,
                                      reset_peak=torch.cuda.reset_peak_memory_stats))

    def copy(self) -> "PeakMemory":
        """Another count, from what this one's models hold now (their weights): the peaks of a batch of its own."""
        other = PeakMemory(self.allocator)
        other.resident = collections.Counter(self.resident)
        return other

    @contextlib.contextmanager
    def charged(self, model: str, phase: Optional[str] = None):
        """What the block allocates, charged to `model`; with `phase`, its peak counted as one of that phase's."""
        if self.allocator is None:
            yield
            return
        before = self.allocator.allocated()
        self.allocator.reset_peak()
        yield
        if phase is not None:
            peak = self.resident[model] + self.allocator.peak() - before
            self.peak[model, phase] = max(self.peak.get((model, phase), 0), peak)
        self.resident[model] += self.allocator.allocated() - before

    def column(self, phase: str) -> Optional[Dict[str, float]]:
        """MB (2**20 bytes) by model of `phase`; None where nothing is measured."""
        if self.allocator is None:
            return None
        return {model: peak / 2**20 for (model, measured), peak in self.peak.items() if measured == phase}


@torch.no_grad()
def check_before_search(name: str, phase: str, model, forward: Callable[[], Tensor]) -> None:
    """The weights and the logits of `forward()` are finite: a search over
    non-finite ones ends in a device-side assert on a GPU (sampling) or a
    search that never finishes, neither naming the model. The forward runs
    eagerly: no graph is captured outside the timed calls."""
    model.eval()
    with feedback_loop_in_mode(model, "off"):
        values = [*model.parameters(), forward()]
    if not torch.stack([torch.isfinite(v).all() for v in values]).all():
        raise NotFinite(f"{name}: its weights or logits are not finite before {phase}, so no rate is reported "
                        "(in fp16, try bf16 or fp32)")


WARM_UP_CALLS = 8  # at most, while calls keep capturing graphs (a stream's memory filling its span: a graph per length)


def timed_call(name, work, phase: str, finite: FiniteResults, memory: Optional[PeakMemory] = None):
    """(seconds, tokens) of one call of `name`'s workload `work` (which
    returns the tokens it processed and a result to check), its result
    recorded in `finite` and its memory in `memory` as one of `phase`'s."""
    with (memory or PeakMemory()).charged(name, phase):
        synchronize()
        start = time.perf_counter()
        try:
            tokens, result = work()
        except FloatingPointError as error:  # fp16's loss scale fell to fairseq's minimum
            raise NotFinite(f"{name}: {phase}: {error}") from error
        synchronize()
        seconds = time.perf_counter() - start
    finite.record(name, phase, result)
    return seconds, tokens


def interleaved_rates(built, workloads, repeats, phase: str, finite: FiniteResults,
                      memory: Optional[PeakMemory] = None):
    """Tokens per second of each workload (a call returning the tokens it
    processed and a result to check), from the median of `repeats` calls
    made in turns after warm-up calls (one, or where graphs run, until a
    call after the first capture captures none); and for each, the seconds
    that its warm-up calls, and any later call that captured a graph, took
    beyond the median call.
    `built`: the models, by name; `memory`: where each call's memory is counted."""
    times = {name: [] for name in workloads}
    beyond_steady = {name: [] for name in workloads}  # the times of warm-up calls and of calls that captured
    tokens = {}

    def call(name) -> bool:
        """One timed call of `name`'s workload; whether it captured graphs."""
        captured = graphs_captured(built[name])
        seconds, tokens[name] = timed_call(name, workloads[name], phase, finite, memory)
        times[name].append(seconds)
        return graphs_captured(built[name]) > captured

    for name in workloads:
        for _ in range(WARM_UP_CALLS):
            if not call(name) and not awaiting_capture(built[name]):
                break
        beyond_steady[name], times[name] = times[name], []
    for _ in range(repeats):
        for name in workloads:
            if call(name):
                beyond_steady[name].append(times[name][-1])
    finite.check()
    median = {name: statistics.median(times[name]) for name in workloads}
    rates = {name: tokens[name] / median[name] for name in workloads}
    return rates, {name: sum(t - median[name] for t in beyond_steady[name]) for name in workloads}


FIRST_PASSES = 4  # at most, over the first batches, until a pass captures nothing


def first_batches(built, workloads, count: int, finite: FiniteResults, memory: Optional[PeakMemory] = None):
    """Each model's first `count` training calls, from its first (a first
    epoch's view): tokens per second over them, every capture and first
    sighting included; and for each graphed model, the seconds that each
    new shape (each graph captured) cost: what its passes over the same
    calls took beyond a pass that captured nothing, per graph captured.
    `workloads`: each model's training step, a new batch at each call,
    its `count` batches again at the next `count` calls."""
    rates, per_shape = {}, {}
    for name, work in workloads.items():
        model, passes, captured_before = built[name], [], graphs_captured(built[name])
        while len(passes) < FIRST_PASSES:
            captured, seconds, tokens = graphs_captured(model), 0.0, 0
            for _ in range(count):
                took, processed = timed_call(name, work, "training", finite, memory)
                seconds, tokens = seconds + took, tokens + processed
            passes.append(seconds)
            if len(passes) == 1:
                rates[name] = tokens / seconds
            if graph_statistics(model) is None or (graphs_captured(model) == captured and not awaiting_capture(model)):
                break
        new_graphs = graphs_captured(model) - captured_before
        if new_graphs:
            per_shape[name] = (sum(passes[:-1]) - (len(passes) - 1) * passes[-1]) / new_graphs
    finite.check()
    return rates, per_shape
