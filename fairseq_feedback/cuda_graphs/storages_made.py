"""What a capture leaves in the memory pool, counted from its tensors.

The allocator's own figures say nothing while graphs are captured
(torch.cuda.graph's __enter__ empties its cache), so a graph's bytes are
those of the storages its capture made that are still alive afterwards:
static outputs and gradients, and whatever its autograd graph keeps.
"""

from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StoragesMade(TorchDispatchMode):
    """The storages that operators make while active; `held()` counts those still alive."""

    def __init__(self):
        super().__init__()
        self.made = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (func.is_view or func._schema.is_mutable):
            for t in tree_leaves(out):
                if isinstance(t, Tensor):
                    storage = t.untyped_storage()
                    self.made.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
        return out

    def held(self) -> int:
        return sum(nbytes for ref, nbytes in self.made.values() if not ref.expired())
