"""How a graph cache does: the line logged after every epoch and validation,
the hit rate under which graphs do not pay, and its figures for a program to read."""

import collections
from dataclasses import dataclass
from typing import Hashable, Optional

# a hit rate under LOW_HIT_RATE over HIT_WINDOW lookups means shapes vary too much for graphs to pay
HIT_WINDOW, LOW_HIT_RATE = 256, 0.5


class CacheStatistics:
    def __init__(self):
        self.keys = set()  # every key seen
        self.calls = self.hits = 0  # since the last line
        self.recent = collections.deque(maxlen=HIT_WINDOW)  # hit or miss of the last lookups

    def lookup(self, key: Hashable, hit: bool) -> None:
        self.keys.add(key)
        self.calls += 1
        self.hits += hit
        self.recent.append(hit)

    def too_few_hits(self) -> Optional[str]:
        """Why graphs do not pay, or None."""
        if len(self.recent) == HIT_WINDOW and sum(self.recent) < LOW_HIT_RATE * HIT_WINDOW:
            return (f"only {sum(self.recent)} of the last {HIT_WINDOW} calls found their graph cached: "
                    "shapes vary too much for graphs to pay")
        return None

    def line(self) -> str:
        """One line for the log; calls and hits since the previous line, keys since the start."""
        rate = 100 * self.hits / self.calls if self.calls else 0.0
        line = f"graph cache | keys {len(self.keys)} | calls {self.calls} | hits {self.hits} | hit rate {rate:.1f}%"
        self.calls = self.hits = 0
        return line


@dataclass(frozen=True)
class GraphStatistics:
    """What a graph cache has done, as it stands (GraphCache.summary)."""

    captured: int  # graphs captured since the cache was made
    cached: int  # graphs it holds now
    nbytes: int  # what those hold: the static buffers they share, and what their captures left alive
    max_bytes: int  # the bound on nbytes
    static_bytes: int  # of nbytes, the static inputs and output gradients (static_buffers.py)
    pool_bytes: Optional[int]  # what the graphs' memory pool holds from the device (None: not known)
    calls: int  # calls since the last line logged (after every epoch and validation)
    hits: int  # of those, the calls replayed from a cached graph
    eager_passes: int  # eager passes the cached graphs cost beyond their calls' own (captures and checks)
    failed: Optional[str]  # why every call now runs eagerly (None: graphs serve)
