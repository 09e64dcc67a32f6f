"""Graphed functions by shape, bounded in graphs and bytes, on one memory pool.

What a graph holds is counted from its tensors (static inputs and output
gradients, and what its capture leaves alive: static outputs, gradients,
activations its autograd graph keeps), since the allocator's own figures
say nothing while graphs are captured. Evicting a graph frees its tensors
into the graphs' shared pool, where later captures reuse them; the device
gets that memory back only when every graph of the pool is gone.
"""

import logging
import weakref
from collections import OrderedDict
from typing import Callable, Hashable, Optional, Sequence

from torch import Tensor

from .backends import device_memory
from .graphed_function import GraphedFunction, GraphFailure
from .statistics import CacheStatistics

logger = logging.getLogger(__name__)

_CACHES: "weakref.WeakSet[GraphCache]" = weakref.WeakSet()


def log_statistics_of_every_cache() -> None:
    """Each live cache's statistics line: for a program's end (fairseq-train's
    last validation is followed by no other call)."""
    for cache in list(_CACHES):
        cache.log_statistics()


class _PendingBackward:
    """Held by a replay's autograd node: alive while its backward may come."""


class GraphCache:
    """Functions captured as graphs by `backend` (backends.py), by shape key,
    the least recently used dropped past `max_graphs` or `max_bytes`
    (default: a quarter of the device's memory)."""

    def __init__(self, backend, name: str, max_graphs: int = 64, max_bytes: Optional[int] = None):
        self.backend, self.name, self.max_graphs = backend, name, max_graphs
        self.max_bytes = max_bytes if max_bytes is not None else device_memory(backend.device) // 4
        self.graphs: "OrderedDict[Hashable, GraphedFunction]" = OrderedDict()
        self.statistics = CacheStatistics()
        self.captured = 0
        self.replays = 0  # of every graph, forward and backward
        self.pending: Optional[Callable] = None  # weak reference to the node of a forward awaiting its backward
        self.failed: Optional[str] = None  # why every call now runs eagerly
        _CACHES.add(self)

    def __call__(self, key: Hashable, fn, inputs: Sequence[Optional[Tensor]], params: Sequence[Tensor] = (),
                 state: Sequence[Tensor] = (), shape: str = ""):
        """fn(*inputs), from the graph cached for `key` (captured now if
        missing), or eagerly once the cache has failed or while another
        forward awaits its backward. `shape`: the key in words, for the log."""
        if self.failed is not None or self.awaiting_backward():
            return tuple(fn(*inputs))
        graphed = self.graphs.get(key)
        self.statistics.lookup(key, hit=graphed is not None)
        if graphed is None:
            try:
                graphed = GraphedFunction(fn, inputs, params, self, state, shape or str(key))
            except GraphFailure as failure:
                self.fail(shape or str(key), failure)
                return tuple(fn(*inputs))
            self._insert(key, graphed)
        self.graphs.move_to_end(key)
        outputs = graphed(fn, *inputs)
        too_few_hits = self.statistics.too_few_hits()
        if too_few_hits:
            self.fail("", GraphFailure(too_few_hits))
        return outputs

    def _insert(self, key, graphed: GraphedFunction) -> None:
        self.graphs[key] = graphed
        self.captured += 1
        while len(self.graphs) > 1 and (len(self.graphs) > self.max_graphs or self.nbytes() > self.max_bytes):
            self.graphs.popitem(last=False)
        logger.info(f"{self.name}: captured graph {self.captured} for {graphed.shape} "
                    f"({graphed.nbytes / 2**20:.1f} MB; {len(self.graphs)} cached, {self.nbytes() / 2**20:.1f} MB)")

    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.graphs.values())

    def replayed(self, graphed: GraphedFunction) -> None:
        self.replays += 1
        graphed.replays_seen = self.replays

    def fail(self, shape: str, failure: GraphFailure) -> None:
        """Every later call runs eagerly; said once."""
        if self.failed is None:
            self.failed = str(failure)
            where = f" for {shape}" if shape else ""
            logger.warning(f"{self.name}: CUDA graph{where}: {failure}; running eagerly from now on")
            self.graphs.clear()

    # --- a forward awaiting its backward ----------------------------------------------------------

    def backward_pending(self) -> _PendingBackward:
        """A token for the replay's autograd node to hold: while it lives (and
        its backward has not run), the graph's saved activations are in the pool."""
        token = _PendingBackward()
        self.pending = weakref.ref(token)
        return token

    def awaiting_backward(self) -> bool:
        return self.pending is not None and self.pending() is not None

    def forget(self, captured_over: Callable[[Hashable], bool]) -> None:
        """Drops the graphs whose key says they were captured over buffers that are gone."""
        for key in [key for key in self.graphs if captured_over(key)]:
            del self.graphs[key]

    def log_statistics(self) -> None:
        if self.statistics.calls or self.statistics.keys:
            logger.info(self.statistics.line())
