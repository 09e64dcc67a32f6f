"""Graphed functions by shape, bounded in graphs and bytes, on one memory pool.

A shape is captured at its second sighting: the first runs eagerly (a shape
seen once would not repay its capture, and that first run is the warm-up
capture needs). A capture that needs larger static buffers drops the
graphs over the smaller ones, to be captured again at their next call
(static_buffers.py). What the graphs hold is counted from their tensors (the
static inputs and output gradients that they share, and what each capture
leaves alive: static outputs, gradients, activations its autograd graph
keeps), since the allocator's own figures say nothing while graphs are
captured; the pool's own bytes are the backend's (pool_bytes). Evicting a
graph releases it at once (never during a capture) into the graphs' shared
pool, where later captures reuse its memory; the device gets that memory
back when the cache gives up.

The cache decides; its graphs only report. A graph whose capture fails
raises; one that fails later gives its call the eager result and records
why, and the cache gives up at its next call. A failed capture resets the
device's random generator (backends.py), so every cache on that device,
whose graphs drew from the old one, gives up with it.
"""

import gc
import logging
import weakref
from collections import OrderedDict
from typing import Hashable, List, Optional, Sequence, Set

from torch import Tensor

from .backends import device_memory
from .checks import FULLY_CHECKED
from .failure import GraphFailure
from .graphed_function import GraphedFunction
from .pool_ledger import PoolLedger
from .statistics import CacheStatistics, GraphStatistics

logger = logging.getLogger(__name__)

_CACHES: "weakref.WeakSet[GraphCache]" = weakref.WeakSet()  # every cache, for a device's failed capture
_UNSUPPORTED_SAID: Set[str] = set()  # what a torch lacks is said once in the process, not by every cache


def _log_last_line(statistics: CacheStatistics) -> None:
    if statistics.calls:
        logger.info(statistics.line())


class GraphCache:
    """Functions captured as graphs by `backend` (backends.py), by shape key,
    the least recently used dropped past `max_graphs` or `max_bytes`
    (default: a quarter of the device's memory). With `max_graphs` 0, every
    call runs eagerly, at the shapes the graphs would have: the reference
    that graphs are compared with where dropout draws by shape."""

    def __init__(self, backend, name: str, max_graphs: int = 64, max_bytes: Optional[int] = None):
        self.backend, self.name, self.max_graphs = backend, name, max_graphs
        self.max_bytes = max_bytes if max_bytes is not None else device_memory(backend.device) // 4
        self.graphs: "OrderedDict[Hashable, GraphedFunction]" = OrderedDict()
        self.sighted: "OrderedDict[Hashable, None]" = OrderedDict()  # keys seen once, not captured yet
        self.last: Optional[GraphedFunction] = None  # the graph called last
        self.ledger = PoolLedger()
        self.statistics = CacheStatistics()
        self.captured = 0
        # why every call now runs eagerly; from the start where this torch lacks what the device's graphs need
        self.failed: Optional[str] = backend.unsupported()
        _CACHES.add(self)
        # the last line when the cache goes, or at the program's end (fairseq-train's
        # last validation is followed by no call that could log it)
        weakref.finalize(self, _log_last_line, self.statistics)
        if self.failed is not None:
            self._say_failed("", logging.DEBUG if self.failed in _UNSUPPORTED_SAID else logging.WARNING)
            _UNSUPPORTED_SAID.add(self.failed)

    def __call__(self, key: Hashable, fn, inputs: Sequence[Optional[Tensor]], params: Sequence[Tensor] = (),
                 state: Sequence[Tensor] = (), shape: str = ""):
        """fn(*inputs, *params), from the graph cached for `key` (captured
        now at the key's second sighting), or eagerly at its first, once the
        cache has failed, or while another forward awaits its backward.
        `params`: what fn reads besides its inputs (GraphedFunction);
        `shape`: the key in words, for the log."""
        self._give_up_if_the_last_graph_failed()
        if self.failed is not None or self.max_graphs == 0 or self.ledger.awaiting_backward():
            return tuple(fn(*inputs, *params))
        graphed = self.graphs.get(key)
        self.statistics.lookup(key, hit=graphed is not None)
        if graphed is None and self._first_sighting(key):
            outputs = tuple(fn(*inputs, *params))
        elif graphed is None:
            graphed = self._capture(key, fn, inputs, params, state, shape or str(key))
            outputs = tuple(fn(*inputs, *params)) if graphed is None else graphed(fn, *inputs)
        else:
            self.graphs.move_to_end(key)
            outputs = graphed(fn, *inputs)
        if graphed is not None:
            self.last = graphed
        self._give_up_if_the_last_graph_failed()
        too_few_hits = self.statistics.too_few_hits()
        if too_few_hits:
            self.fail("", GraphFailure(too_few_hits))
        return outputs

    def _first_sighting(self, key: Hashable) -> bool:
        if key in self.sighted:
            del self.sighted[key]
            return False
        self.sighted[key] = None
        while len(self.sighted) > 4 * self.max_graphs:
            self.sighted.popitem(last=False)
        return True

    def _capture(self, key, fn, inputs, params, state, shape: str) -> Optional[GraphedFunction]:
        """A new graph for `key`, cached; None if its capture failed (the cache has given up)."""
        if self.captured == 0:
            gc.collect()  # what dropped models left to the collector goes before this cache takes memory
        failure = None
        try:
            graphed = GraphedFunction(fn, inputs, params, self.backend, self.ledger, state, shape,
                                      fully_checked=self.captured < FULLY_CHECKED)
        except GraphFailure as e:
            failure = e
        if failure is not None:
            self._device_reset(shape, failure)
            return None
        self.graphs[key] = graphed
        self.captured += 1
        # graphs over storages that this capture replaced by larger ones: captured again at their next call
        # (they were sighted), so that one set of static buffers is held (static_buffers.py)
        static = self.ledger.static
        outdated = [k for k, g in self.graphs.items() if not static.current((*g.inputs, *g.grad_outputs))]
        for old in outdated:
            self.graphs.pop(old).release()
            self.sighted[old] = None
        while len(self.graphs) > 1 and (len(self.graphs) > self.max_graphs or self.nbytes() > self.max_bytes):
            _, evicted = self.graphs.popitem(last=False)
            evicted.release()
        dropped = f", {len(outdated)} dropped for its larger buffers" if outdated else ""
        logger.info(f"{self.name}: captured graph {self.captured} for {graphed.shape} "
                    f"({graphed.nbytes / 2**20:.1f} MB; {len(self.graphs)} cached{dropped}, "
                    f"{self.nbytes() / 2**20:.1f} MB)")
        return graphed

    def cached_keys(self) -> List[Hashable]:
        return list(self.graphs)

    def nbytes(self) -> int:
        return self.ledger.static.nbytes() + sum(g.nbytes for g in self.graphs.values())

    def eager_passes(self) -> int:
        """Eager passes the cached graphs cost beyond their calls' own (captures and checks)."""
        return sum(g.eager_passes for g in self.graphs.values())

    def summary(self) -> GraphStatistics:
        return GraphStatistics(captured=self.captured, cached=len(self.graphs), nbytes=self.nbytes(),
                               max_bytes=self.max_bytes, static_bytes=self.ledger.static.nbytes(),
                               pool_bytes=self.backend.pool_bytes(), calls=self.statistics.calls,
                               hits=self.statistics.hits, eager_passes=self.eager_passes(), failed=self.failed)

    def _give_up_if_the_last_graph_failed(self) -> None:
        """The graph called last failed in its call, or in its backward since
        (no other graph is called while a backward is awaited): the cache gives up."""
        if self.last is not None and self.last.failure is not None:
            self.fail(self.last.shape, self.last.failure)

    def fail(self, shape: str, failure: GraphFailure, level: int = logging.WARNING) -> None:
        """Every later call runs eagerly, said once (at `level`); the graphs are released now."""
        if self.failed is not None:
            return
        self.failed = str(failure)
        self._say_failed(shape, level)
        for graphed in self.graphs.values():
            graphed.release()
        self.graphs.clear()
        self.last = None
        self.ledger.static.release()
        self.backend.release_pool()

    def _say_failed(self, shape: str, level: int) -> None:
        where = f" for {shape}" if shape else ""
        logger.log(level, f"{self.name}: CUDA graph{where}: {self.failed}; running eagerly from now on")

    def _device_reset(self, shape: str, failure: GraphFailure) -> None:
        """A capture failed: the device's random generator was given a fresh
        state (backends.py), and graphs captured before it would draw from the
        old one. This cache and every other on the device give up."""
        self.fail(shape, failure)
        reset = GraphFailure(f"a capture failed on {self.backend.device}, which reset its random generator")
        for cache in list(_CACHES):
            if cache.backend.device == self.backend.device:
                cache.fail("", reset, level=logging.INFO)  # the failed capture's warning says why

    def log_statistics(self) -> None:
        if self.statistics.calls or self.statistics.keys:
            logger.info(self.statistics.line())
