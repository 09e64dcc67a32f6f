"""The bytes that captures leave in a graphs' memory pool, counted from their tensors.

The allocator's own figures say nothing while graphs are captured
(torch.cuda.graph's __enter__ empties its cache), so the pool is counted
from the storages that operators make: what a graph holds is what its
capture made that is still alive afterwards (static outputs and gradients,
whatever its autograd graph keeps), and the stand-in's pool (backends.py)
the most that was ever alive in it at once.
"""

import weakref

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PoolAccount(TorchDispatchMode):
    """The bytes of a graphs' memory pool, as CUDA's caching allocator keeps
    them (fragmentation and rounding aside: a lower bound of CUDA's). While
    active (during captures), every storage that operators make is counted
    from then until it is freed, in `live`; the pool holds the most that
    was ever live at once, `reserved`, since what a capture frees goes back
    to the pool, not to the device.

    A storage is watched through its Python object, which lives exactly as
    long as the storage does (torch keeps it while a tensor holds the
    storage): a weak reference to the storage itself (StorageWeakRef) would,
    before torch 2.7, keep that object, and the count, until the reference went."""

    def __init__(self):
        super().__init__()
        self.live = self.reserved = 0
        self.counted: "weakref.WeakSet" = weakref.WeakSet()  # of torch.UntypedStorage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (func.is_view or func._schema.is_mutable):
            read = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, Tensor):
                    storage = t.untyped_storage()
                    if storage.nbytes() and storage.data_ptr() not in read and storage not in self.counted:
                        self.counted.add(storage)
                        weakref.finalize(storage, self._freed, storage.nbytes())
                        self.live += storage.nbytes()
                        self.reserved = max(self.reserved, self.live)
        return out

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes
