"""The static inputs and output gradients of a cache's graphs, one set shared by every graph.

A graph reads its inputs at fixed addresses, copied in at each call, and its
backward reads its output gradients the same way. No two graphs of a cache
need theirs at once: a call copies its inputs in and replays at once, its
backward copies the gradients in and replays at once, and while a training
forward awaits its backward every other call runs eagerly (pool_ledger.py).
So each input and output gradient of every graph lies at the start of one
storage per position, the largest graph's size: a cache of many shapes holds
one set, as its largest graph needs it, rather than one per graph (at IWSLT
sizes the encoder's keys and values alone are 100 MB a graph in fp16). A
graph that needs more than a storage holds gets a larger one, and the
graphs captured over the smaller one read addresses of their own, which a
replay cannot move: the cache drops them (graph_cache.py), and captures
each again over the larger storages at its next call. So the set is the
largest's whatever order shapes come in, for one more capture of a cached
graph each time a storage grows (rarely: shapes come in buckets, buckets.py).
Outside the graphs' memory pool, as torch.cuda.make_graphed_callables keeps
its static inputs: capture and replay never allocate them.

What this costs: a second backward over a call's outputs (retain_graph) is
refused once another call has copied its inputs over the call's
(graphed_function.py), where each graph kept its own before.
"""

from typing import Dict, Hashable, Iterable, List, Optional, Tuple

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef


class StaticBuffers:
    def __init__(self):
        self.storages: Dict[Hashable, torch.UntypedStorage] = {}  # position -> the largest storage so far
        self.made: List[Tuple[StorageWeakRef, int]] = []  # every storage made, and its bytes
        self.writes = 0  # calls and captures that copied inputs in

    def holding(self, position: Hashable, x: Tensor) -> Tensor:
        """A contiguous tensor shaped and typed as `x`, holding its values, at
        the start of the storage of `position` (made larger where `x` needs it)."""
        nbytes = x.numel() * x.element_size()
        storage = self.storages.get(position)
        if storage is None or storage.nbytes() < nbytes or storage.device != x.device:
            storage = torch.empty(nbytes, dtype=torch.uint8, device=x.device).untyped_storage()
            self.storages[position] = storage
            self.made.append((StorageWeakRef(storage), nbytes))
        static = x.new_empty(0).set_(storage, 0, x.shape)
        return static.copy_(x)

    def current(self, tensors: Iterable[Optional[Tensor]]) -> bool:
        """Whether every one of `tensors` (a graph's static inputs and output
        gradients) lies on a storage still in use, none replaced by a larger."""
        in_use = {storage.data_ptr() for storage in self.storages.values()}
        return all(t is None or t.untyped_storage().data_ptr() in in_use for t in tensors)

    def written(self) -> int:
        """Inputs were copied in (by a call or a capture): the count so far."""
        self.writes += 1
        return self.writes

    def release(self) -> None:
        """The storages go with the graphs that read them (a cache that gave up has none)."""
        self.storages.clear()

    def nbytes(self) -> int:
        """What the storages still alive hold."""
        self.made = [(ref, nbytes) for ref, nbytes in self.made if not ref.expired()]
        return sum(nbytes for _, nbytes in self.made)
