"""The CUDA primitives that graphs need, and a stand-in that runs them on any device.

Everything about a graph (warm-up, capture, replay, the checks, the cache,
falling back to eager) is one code path, whatever the device
(graphed_function.py, graph_cache.py). What differs is only this: capturing
and replaying a graph, the stream that warms up before capture, the random
generator that dropout draws from, and the device's memory.

`CudaGraphBackend` makes the CUDA calls themselves: the only lines that the
CPU tests cannot run. `RecordedGraphBackend` (--cuda-graphs emulate, and the
CPU tests) stands in for it so that what would go wrong on a GPU goes wrong
here too:

- capture records the function (and runs it once, as capture's kernels
  would fill the pool);
- replay runs it again into the same static output tensors, so that a result
  read after a later replay shows as a wrong number;
- every graph's outputs and gradients lie in one shared storage, each
  graph's laid out from its start, as graphs that share a memory pool may
  reuse each other's memory: what a graph leaves there is overwritten when
  another replays.
"""

import contextlib
import os
import weakref
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

Outputs = Tuple[Optional[Tensor], ...]


def default_generator(device: torch.device) -> torch.Generator:
    """The generator that dropout on `device` draws from."""
    if device.type == "cuda":  # CUDA only
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":  # CUDA only
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class CudaGraphBackend:
    """torch.cuda's graphs, all on one memory pool, warmed up on a side
    stream. CUDA only: the CPU tests run RecordedGraphBackend in its place."""

    def __init__(self, device: torch.device):
        self.device, self.generator = device, default_generator(device)
        self.pool = torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def side_stream(self):
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def capture(self, fn: Callable[[], Sequence[Optional[Tensor]]], owner) -> Tuple[object, Outputs]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = tuple(fn())
        return graph, outputs

    def replay(self, graph) -> None:
        graph.replay()


class RecordedGraph:
    def __init__(self, fn: Callable[[], Sequence[Optional[Tensor]]], outputs: Outputs):
        self.fn, self.outputs = fn, outputs


class RecordedGraphBackend:
    """A graph is its function, recorded; its outputs live in a storage
    shared by every graph (SharedPool)."""

    def __init__(self, device: torch.device):
        self.device, self.generator = device, default_generator(device)
        self.pool = SharedPool(device)

    def side_stream(self):
        return contextlib.nullcontext()

    def capture(self, fn: Callable[[], Sequence[Optional[Tensor]]], owner) -> Tuple[RecordedGraph, Outputs]:
        graph = RecordedGraph(fn, self.pool.place(owner, tuple(fn())))
        return graph, graph.outputs

    def replay(self, graph: RecordedGraph) -> None:
        for static, new in zip(graph.outputs, graph.fn()):
            if static is not None:
                static.copy_(new)


class SharedPool:
    """One storage for the outputs of every graph: each owner's tensors are
    laid out one after the other from the start, so that different owners'
    overlap. The storage grows as needed, the tensors already handed out
    moved onto the larger one (Tensor.set_), so that they keep overlapping."""

    ALIGNMENT = 64

    def __init__(self, device: torch.device):
        self.bytes = torch.empty(0, dtype=torch.uint8, device=device)
        self.ends: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()  # each owner's next offset
        self.placed: List[Tuple["weakref.ref[Tensor]", int]] = []  # (tensor, byte offset) handed out

    def place(self, owner, tensors: Outputs) -> Outputs:
        """Copies of `tensors` in the shared storage, after what `owner` holds there already."""
        offset, placed = self.ends.get(owner, 0), []
        for t in tensors:
            if t is None:
                placed.append(None)
                continue
            t = t.detach().contiguous()
            offset = -(-offset // self.ALIGNMENT) * self.ALIGNMENT
            end = offset + t.numel() * t.element_size()
            if end > len(self.bytes):
                self._grow(end)
            static = t.new_empty(0).set_(self.bytes.untyped_storage(), offset // t.element_size(), t.shape, t.stride())
            static.copy_(t)
            self.placed.append((weakref.ref(static), offset))
            placed.append(static)
            offset = end
        self.ends[owner] = offset
        return tuple(placed)

    def _grow(self, nbytes: int) -> None:
        grown = self.bytes.new_empty(2 * nbytes)
        grown[: len(self.bytes)] = self.bytes
        self.placed = [(ref, offset) for ref, offset in self.placed if ref() is not None]
        for ref, offset in self.placed:
            t = ref()
            t.set_(grown.untyped_storage(), offset // t.element_size(), t.shape, t.stride())
        self.bytes = grown
