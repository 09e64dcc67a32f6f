"""What each step of a block reads of the memory's slots, keys with
relative positions, and where their gradients go (a piece as operators.py
describes them)."""

from typing import List, Optional, Sequence

import torch
from torch import Tensor


class MemoryWindows:
    """What each step of a block reads of the memory's slots, laid out for
    attention, [planes, bsz, num_heads, slots, head_dim]: the last `span` slots
    before its own, one [bsz * num_heads, slots, head_dim] view per plane (a
    key or a value of one key/value projection), and the keys with relative
    positions (memory_view.py), p [span, head_dim] of a full window:

        key_j = k_j + p[S - 1 - e_j]
        g_k_j = g_key_j,   g_p[S - 1 - e_j] = sum_{rows, heads} g_key_j

    With positions, the keys of each projection are written into room
    reused from step to step, and their gradient, summed over the layers
    that read them, is added to the slots' and the positions' gradients at
    the end of the step (finish_key_grads).

    Args:
        slots: the block's keys and values, [planes, bsz, num_heads, initial + tgt_len, head_dim].
        slot_grads: where the backward adds their gradients (None forward).
        initial: the slots before the block's first step.
        span: how many slots a step reads at most.
        num_heads: the heads.
        positions: the relative positions of a full window, [span, head_dim], or None.
        position_grads: where the backward adds their gradients (None forward).
    """

    def __init__(self, slots: Tensor, slot_grads: Optional[Tensor], initial: int, span: int, num_heads: int,
                 positions: Optional[Tensor], position_grads: Optional[Tensor] = None):
        self.slots, self.slot_grads, self.initial, self.span, self.num_heads = slots, slot_grads, initial, span, num_heads
        self.positions, self.position_grads = positions, position_grads

        def room():
            """A [bsz * num_heads, span, head_dim] per key projection, with positions."""
            if positions is None:
                return []
            return [slots.new_empty(slots.size(1) * num_heads, span, slots.size(-1)) for _ in range(slots.size(0) // 2)]

        self.keys_room = room()
        self.key_grads_room = [] if slot_grads is None else room()

    def _window(self, slots: Tensor, t: int) -> List[Tensor]:
        filled = self.initial + t
        return list(slots[:, :, :, max(0, filled - self.span): filled].flatten(1, 2).unbind(0))

    def planes(self, t: int) -> List[Tensor]:
        """Step t's window of every plane."""
        return self._window(self.slots, t)

    def keys(self, planes: Sequence[Tensor]) -> List[Tensor]:
        """The keys of each projection in a window (planes[0::2]), plus the positions."""
        keys = planes[0::2]
        if self.positions is None:
            return list(keys)
        return [torch.add(k.view(-1, self.num_heads, *k.shape[1:]), self.positions[-k.size(1):],
                          out=out[:, : k.size(1)].view(-1, self.num_heads, *k.shape[1:])).flatten(0, 1)
                for k, out in zip(keys, self.keys_room)]

    def grads(self, t: int):
        """Step t's gradients: of every plane of its window (added into), of
        the keys of each projection, and whether the first layer to read
        those keys writes their gradient rather than adds (with positions,
        where they are summed apart first: finish_key_grads)."""
        planes = self._window(self.slot_grads, t)
        if self.positions is None:
            keys = planes[0::2]
            return planes, keys, [False] * len(keys)
        read = planes[0].size(1)
        return planes, [g[:, :read] for g in self.key_grads_room], [True] * len(self.key_grads_room)

    def finish_key_grads(self, plane_grads: Sequence[Tensor], key_grads: Sequence[Tensor],
                         overwrite: Sequence[bool]) -> None:
        """With positions: the keys' gradient of each projection that a layer
        read (no longer to be overwritten) to its slots and to the positions."""
        if self.positions is None:
            return
        for plane, summed, unread in zip(plane_grads[0::2], key_grads, overwrite):
            if not unread:
                plane += summed
                self.position_grads[-summed.size(1):] += summed.sum(0)
