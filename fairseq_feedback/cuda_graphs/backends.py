"""The CUDA primitives that graphs need, and a stand-in that runs them on any device.

Everything about a graph (capture, replay, the checks, the cache, falling
back to eager) is one code path, whatever the device (graphed_function.py,
checks.py, graph_cache.py). What differs is only this: capturing, replaying and
releasing a graph, putting the device right after a capture that failed,
the random generator that dropout draws from, and the device's memory.

`CudaGraphBackend` makes the CUDA calls themselves: the only lines that the
CPU tests cannot run. `RecordedGraphBackend` (--cuda-graphs emulate, and the
CPU tests) stands in for it, and keeps the rules a GPU keeps, so that what
would go wrong on a GPU goes wrong here too:

- capture records the function (and runs it once, as capture's kernels
  would fill the pool); replay runs it again into the same static output
  tensors, so that a result read after a later replay shows as a wrong
  number;
- every graph's outputs and gradients lie in one shared storage, each
  graph's laid out from its start, as graphs that share a memory pool may
  reuse each other's memory: what a graph leaves there is overwritten when
  another replays;
- a graph freed while a capture is under way (by the cyclic garbage
  collector, say) invalidates that capture, which then fails at its end,
  as CUDA's does ("operation not permitted when stream is capturing"); the
  collector, where it is enabled, runs in the middle of every capture, the
  worst moment it could;
- a gradient taken inside a capture with respect to a leaf tensor (a
  parameter) invalidates it: on a GPU autograd waits there on the stream
  where the leaf's AccumulateGrad node was made, which may be the default
  stream whenever a graph made outside the capture still holds the node (a
  loss the caller keeps; DDP's reducer, always), and that wait invalidates
  the capture (autograd_pass.py's `run_pass` differentiates aliases made in
  the pass instead); the stand-in refuses every leaf, since which nodes
  are held cannot be seen;
- a failed capture leaves the device's random generator in capture mode,
  as torch before 2.13 leaves CUDA's: every random operator raises until the
  backend recovers it;
- a recorded graph holds only its function and outputs (no reference back
  to what owns it), as a CUDA graph holds only kernels and addresses;
- the pool's bytes are counted as CUDA's caching allocator keeps them
  (PoolAccount): what a capture allocates comes from the pool, and what it
  frees goes back to the pool for later captures, never to the device, so
  the pool holds the most that was ever alive in it at once; a capture's
  outputs, handed out as unowned views on a GPU (`unowned`), go back too.

A failed capture is recovered in one place, `capture`, whichever backend:
what the device needs (`recover`) before anything else runs.
"""

import contextlib
import gc
import os
import warnings
import weakref
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import (TorchDispatchMode, _disable_current_modes, _len_torch_dispatch_stack,
                                         _pop_mode, _push_mode)

from .capabilities import cuda_graphs_unsupported, end_allocating_to_pool
from .pool_account import PoolAccount

Outputs = Tuple[Optional[Tensor], ...]
CapturedFunction = Callable[[], Sequence[Optional[Tensor]]]


def default_generator(device: torch.device) -> torch.Generator:
    """The generator that dropout on `device` draws from."""
    if device.type == "cuda":  # CUDA only
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":  # CUDA only
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class GraphBackend:
    """A device's graphs: capture, replay, release. A capture that fails
    leaves the device as it was before it (`recover`), then raises."""

    def __init__(self, device: torch.device):
        self.device, self.generator = device, default_generator(device)

    def capture(self, fn: CapturedFunction, owner) -> Tuple[object, Outputs]:
        """A graph of fn(), and fn's outputs as the graph's replays will write
        them, owning no memory: the pool takes theirs back for later
        captures, and what a replay writes there is read before any other
        replay (graphed_function.py). `owner`'s graphs never overlap one
        another in the pool."""
        try:
            return self.capture_graph(fn, owner)
        except BaseException:
            self.recover()
            raise

    def unsupported(self) -> Optional[str]:
        """Why this device cannot capture safely in this process, or None."""
        return None

    def capture_graph(self, fn: CapturedFunction, owner) -> Tuple[object, Outputs]:
        """The device's capture, which may fail as the device's fail."""
        raise NotImplementedError

    def recover(self) -> None:
        """What the device needs after a failed capture, before anything else runs."""
        raise NotImplementedError

    def pool_bytes(self) -> Optional[int]:
        """What the graphs' memory pool holds from the device (None: not known)."""
        raise NotImplementedError


class CudaGraphBackend(GraphBackend):
    """torch.cuda's graphs, all on one memory pool, captured on a stream of
    their own. CUDA only: the CPU tests run RecordedGraphBackend in its place.

    Captured by hand rather than with torch.cuda.graph, whose __enter__
    synchronizes and empties the allocator's cache at every capture, and
    whose __exit__ leaves the capture stream current when capture_end raises."""

    def __init__(self, device: torch.device):  # CUDA only
        super().__init__(torch.device("cuda", torch.cuda._get_device_index(device, optional=True)))
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(self.device)  # captures may not run on the default stream
        self.reserved: Optional[int] = 0  # the pool's bytes, read after each capture (the only time they grow)

    def unsupported(self) -> Optional[str]:  # CUDA only
        return cuda_graphs_unsupported(self.generator)

    def capture_graph(self, fn: CapturedFunction, owner) -> Tuple[torch.cuda.CUDAGraph, Outputs]:  # CUDA only
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):  # the current stream comes back however the capture ends
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                outputs = tuple(fn())
            finally:
                graph.capture_end()  # ends an invalidated capture too (and raises)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.reserved = self.pool_segments_bytes()
        return graph, unowned(outputs)

    def recover(self) -> None:  # CUDA only
        # The allocator stops routing the capture stream's allocations to the
        # pool (capture_end raised before it could), and the generator gets a
        # fresh state: before torch 2.13 the old one stays in capture mode, and
        # every random operator raises "Offset increment outside graph capture".
        # Graphs captured before drew from the old state: the cache gives them up.
        with contextlib.suppress(RuntimeError):  # a torch whose capture_end did it itself
            end_allocating_to_pool()(self.device.index, self.pool)
        self.generator.graphsafe_set_state(self.generator.clone_state())

    def release(self, graph: torch.cuda.CUDAGraph) -> None:  # CUDA only
        graph.reset()

    def release_pool(self) -> None:  # CUDA only
        """Once every graph of the pool is released: what the pool still holds
        goes back to the device (a failed capture's share of it too, which
        torch does not release: PyTorch PRs 180395 and 190308)."""
        with contextlib.suppress(RuntimeError):  # no failed capture held it
            torch._C._cuda_releasePool(self.device.index, self.pool)
        torch.cuda.empty_cache()
        self.pool, self.reserved = torch.cuda.graph_pool_handle(), 0

    def replay(self, graph: torch.cuda.CUDAGraph) -> None:  # CUDA only
        graph.replay()

    def pool_bytes(self) -> Optional[int]:  # CUDA only
        return self.reserved

    def pool_segments_bytes(self) -> Optional[int]:  # CUDA only
        """The bytes of the allocator's segments of the pool (None: a torch whose snapshot does not say)."""
        segments = torch.cuda.memory_snapshot()  # a pool's id is unique across devices
        if any("segment_pool_id" not in s for s in segments):
            return None
        return sum(s["total_size"] for s in segments if tuple(s["segment_pool_id"]) == tuple(self.pool))


def unowned(tensors: Outputs) -> Outputs:
    """Each tensor again, over the same memory, owning none of it (as torch's
    cudagraph trees rebuild a graph's outputs): once the originals go, the
    caching allocator takes their memory back into the graphs' pool, which
    keeps it while any of its graphs lives, for later captures to reuse,
    while this graph's replays still write there. So graphs of every shape
    share their outputs' and gradients' memory, as they share their working
    memory, rather than each keeping its own."""
    storages, views = {}, []
    for t in tensors:
        if t is None:
            views.append(None)
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in storages:
            storages[storage.data_ptr()] = torch._C._construct_storage_from_data_pointer(
                storage.data_ptr(), t.device, storage.nbytes())
        views.append(t.detach().new_empty(0).set_(storages[storage.data_ptr()], t.storage_offset(), t.shape,
                                                  t.stride()))
    return tuple(views)


# --- the stand-in ------------------------------------------------------------------------------------

class _Capture:
    """A capture under way; invalidated by what CUDA forbids during one."""

    def __init__(self):
        self.error: Optional[str] = None


_capturing: List[_Capture] = []  # the capture under way in this process (stream capture is one at a time)


def _forbidden_during_capture(operation: str) -> Optional[str]:
    """Invalidates the capture under way, if any, as CUDA does; returns CUDA's error."""
    if not _capturing:
        return None
    error = f"operation not permitted when stream is capturing ({operation})"
    _capturing[-1].error = _capturing[-1].error or error
    return error


class _GradientsOfLeavesForbidden(TorchFunctionMode):
    """During a capture: torch.autograd.grad with respect to a leaf tensor
    invalidates it, as the wait on the leaf's AccumulateGrad stream does on a GPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.autograd.grad:
            inputs = kwargs.get("inputs", args[1] if len(args) > 1 else ())
            if any(t.is_leaf for t in ([inputs] if isinstance(inputs, Tensor) else inputs)):
                _forbidden_during_capture("a gradient with respect to a leaf, whose AccumulateGrad node's stream "
                                          "is not the capture's")
        return func(*args, **kwargs)


class RecordedGraph:
    """A graph is its function, recorded, and the static outputs it writes."""

    def __init__(self, fn: CapturedFunction, outputs: Outputs):
        self.fn, self.outputs = fn, outputs

    def release(self) -> None:
        """As CUDAGraph.reset: during a capture, a warning, and the capture is lost."""
        if self.fn is not None:
            error = _forbidden_during_capture("function reset")
            if error:
                warnings.warn(error, RuntimeWarning)
        self.fn, self.outputs = None, ()

    def __del__(self):  # a CUDA graph's destructor resets it
        self.release()


class _GeneratorInCaptureMode(TorchDispatchMode):
    """A generator that a failed capture left in capture mode: every random operator raises."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise RuntimeError("Offset increment outside graph capture encountered unexpectedly.")
        return func(*args, **(kwargs or {}))


def _push_beneath(mode: TorchDispatchMode) -> None:
    """`mode` at the bottom of the dispatch-mode stack: it outlives the modes
    entered around the failed capture, which leave as they came."""
    above = [_pop_mode() for _ in range(_len_torch_dispatch_stack())]
    _push_mode(mode)
    for m in reversed(above):
        _push_mode(m)


def _remove(mode: TorchDispatchMode) -> None:
    stack = [_pop_mode() for _ in range(_len_torch_dispatch_stack())]
    for m in reversed(stack):
        if m is not mode:
            _push_mode(m)


class RecordedGraphBackend(GraphBackend):
    """A graph is its function, recorded; its outputs live in a storage
    shared by every graph (SharedPool). Keeps a GPU's rules (module docstring)."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.pool = SharedPool(device)
        self.account = PoolAccount()
        self.stuck: Optional[_GeneratorInCaptureMode] = None  # what a failed capture left on the generator

    def capture_graph(self, fn: CapturedFunction, owner) -> Tuple[RecordedGraph, Outputs]:
        capture = _Capture()
        _capturing.append(capture)
        try:
            with _GradientsOfLeavesForbidden(), self.account:
                outputs = tuple(fn())
            if gc.isenabled():
                gc.collect()  # the collector may run at any moment of a capture: here, at the worst one
            if capture.error:
                raise RuntimeError(f"operation failed due to a previous error during capture ({capture.error})")
        except BaseException:
            self.stuck = _GeneratorInCaptureMode()
            _push_beneath(self.stuck)
            raise
        finally:
            _capturing.remove(capture)
        with _disable_current_modes():  # the stand-in's own storage is no tensor of the capture's (PoolAccount)
            graph = RecordedGraph(fn, self.pool.place(owner, outputs))
        return graph, graph.outputs

    def recover(self) -> None:
        if self.stuck is not None:
            _remove(self.stuck)
            self.stuck = None

    def release(self, graph: RecordedGraph) -> None:
        graph.release()

    def release_pool(self) -> None:
        self.pool, self.account = SharedPool(self.device), PoolAccount()

    def pool_bytes(self) -> int:
        return self.account.reserved

    def replay(self, graph: RecordedGraph) -> None:
        if graph.fn is None:
            raise RuntimeError("replay of a released graph")
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
