"""What the graphs of one memory pool must know of each other.

Every graph of a cache shares one memory pool, so a replay may overwrite
memory that another graph left there. The ledger counts the pool's replays
(a graph's leftovers may have been overwritten since its own: checks.py
checks a graph again after another's replay), knows of the training
forward whose backward is still to come (its activations are in the pool,
and its inputs in the static buffers every graph shares: every other call
runs eagerly meanwhile, graph_cache.py), and holds those buffers
(static_buffers.py).
"""

import weakref
from typing import Callable, Optional

from .static_buffers import StaticBuffers


class _PendingBackward:
    """Held by a replay's autograd node: alive while its backward may come."""


class PoolLedger:
    """Held by every graph of the pool and by their cache; it holds no graph."""

    def __init__(self):
        self.replays = 0
        self.static = StaticBuffers()
        self._pending: Optional[Callable] = None  # weak reference to the token of a forward awaiting its backward

    def replayed(self) -> int:
        self.replays += 1
        return self.replays

    def await_backward(self) -> _PendingBackward:
        """A token for the replay's autograd node to hold: while it lives (and
        its backward has not run), the graph's saved activations are in the pool."""
        token = _PendingBackward()
        self._pending = weakref.ref(token)
        return token

    def backward_done(self) -> None:
        self._pending = None

    def awaiting_backward(self) -> bool:
        return self._pending is not None and self._pending() is not None
