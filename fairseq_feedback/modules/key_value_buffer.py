"""Preallocated keys and values of a memory, and their cache between decoding calls.

A decoder appends memory slots as it goes and reads a window of the last
ones. Concatenating a growing tensor each step costs O(t) copies and keeps
every intermediate alive for backward (O(T^2) memory); here each append
writes in place and reads a view, so a block of T steps costs O(T).

Layout: [slots, planes, bsz, num_heads, head_dim]. Slots come first so that the
filled part is contiguous (one copy on reorder, one block in backward); a plane
is a key or a value of one key/value projection (2 when all layers share it).
"""

import weakref
from typing import Dict, Optional, Tuple

import torch
from fairseq.incremental_decoding_utils import FairseqIncrementalState
from torch import Tensor


class KeyValueBuffer:
    """The last slots of a memory, written in place, read as windows.

    Args:
        slots: [capacity, planes, bsz, num_heads, head_dim], of which [:length] are filled.
        length: the slots filled.
    """

    __slots__ = ("slots", "length", "grad", "__weakref__")

    def __init__(self, slots: Tensor, length: int):
        self.slots = slots  # capacity along dim 0; only [:length] is filled
        self.length = length
        self.grad: Optional[Tensor] = None  # allocated by the first backward

    @classmethod
    def empty(cls, capacity: int, like: Tensor) -> "KeyValueBuffer":
        return cls(like.new_empty((capacity,) + like.shape[1:]), 0)

    @property
    def capacity(self) -> int:
        return self.slots.size(0)

    @property
    def resumed(self) -> bool:
        """Whether autograd still holds this buffer from an earlier decoding
        call (see CachedKeyValues): then gradients reach its earlier slots
        through `grad`."""
        return _BUFFERS.get(id(self.slots)) is self

    def append(self, new: Tensor, window: int) -> Tuple[Tensor, ...]:
        """Writes `new` after the filled slots (with a gradient, through _AppendToBuffer).

        Args:
            new: the new slots' keys and values, [n, planes, bsz, num_heads, head_dim].
            window: how many of the last slots to return.

        Returns:
            the last `window` slots, one [bsz, num_heads, slots, head_dim] view per plane.
        """
        if self.length + new.size(0) > self.capacity:
            self._make_room(new.size(0), window)
        if torch.is_grad_enabled() and new.requires_grad:
            return _AppendToBuffer.apply(new, self, window)
        self._write(new)
        return self.window(window)

    def extend(self, new: Tensor, window: int) -> None:
        """Writes `new` after the filled slots, outside autograd: for a
        caller that computes its slots' gradients itself (loop/fused_block.py).
        The slots that no later `window` reaches may go to make room."""
        if self.length + new.size(0) > self.capacity:
            self._make_room(new.size(0), window)
        self._write(new)

    def window(self, size: int) -> Tuple[Tensor, ...]:
        """The last `size` filled slots, one [bsz, num_heads, slots, head_dim] view per plane."""
        slots = self.slots[max(0, self.length - size) : self.length]
        return tuple(slots.permute(1, 2, 3, 0, 4).unbind(0))

    def _write(self, new: Tensor) -> None:
        start, end = self.length, self.length + new.size(0)
        # `.data` is an alias with its own version counter: windows handed out
        # earlier and saved for backward must not see a version bump, since
        # their slots are never overwritten.
        self.slots.data[start:end] = new
        self.length = end

    def _make_room(self, incoming: int, window: int) -> None:
        """Grows the buffer (decoding; a training block sizes its own). It drops
        the slots that no future window reaches, unless gradients are on: then
        every slot keeps its place, where the backward of earlier appends
        finds it."""
        keep = self.length if torch.is_grad_enabled() else min(self.length, window)
        capacity = max(2 * (keep + incoming), 16)
        slots = self.slots.new_empty((capacity,) + self.slots.shape[1:])
        slots[:keep] = self.slots[self.length - keep : self.length]
        self.slots, self.length = slots, keep

    def reorder(self, new_order: Tensor) -> "KeyValueBuffer":
        """Beam search: the rows `new_order` selects, in a buffer of the same
        capacity (the next append that overflows it drops what no window reaches)."""
        slots = self.slots.new_empty((self.capacity, self.slots.size(1), len(new_order)) + self.slots.shape[3:])
        torch.index_select(self.slots[: self.length], 2, new_order, out=slots[: self.length])
        return KeyValueBuffer(slots, self.length)


class CachedKeyValues(FairseqIncrementalState):
    """A module whose keys and values outlive one decoding call: fairseq's
    incremental state holds its buffer as named tensors, and fairseq's beam
    search reorders it through reorder_incremental_state."""

    def cached_keys_values(self, incremental_state) -> Optional[KeyValueBuffer]:
        state = self.get_incremental_state(incremental_state, "keys_values")
        if state is None:
            return None
        # While autograd holds the buffer that wrote these slots, resume that
        # very buffer: the gradients of all calls then add up in one place.
        buffer = _BUFFERS.get(id(state["slots"]))
        if buffer is None or buffer.slots is not state["slots"]:
            buffer = KeyValueBuffer(state["slots"], int(state["length"]))
        return buffer

    def cache_keys_values(self, incremental_state, buffer: KeyValueBuffer) -> None:
        if incremental_state is None:
            return
        _BUFFERS[id(buffer.slots)] = buffer
        # the length stays on the CPU: reading it never waits for a GPU
        length = torch.tensor(buffer.length, device="cpu")
        state: Dict[str, Optional[Tensor]] = {"slots": buffer.slots, "length": length}
        self.set_incremental_state(incremental_state, "keys_values", state)

    def reorder_incremental_state(self, incremental_state, new_order: Tensor) -> None:
        buffer = self.cached_keys_values(incremental_state)
        if buffer is not None:
            self.cache_keys_values(incremental_state, buffer.reorder(new_order))


# the buffers that cached slots belong to, by id of their slots tensor: a
# buffer lives on only while an autograd graph refers to it
_BUFFERS: "weakref.WeakValueDictionary[int, KeyValueBuffer]" = weakref.WeakValueDictionary()


class _AppendToBuffer(torch.autograd.Function):
    """`KeyValueBuffer.append` with a gradient.

    Equals torch.cat of all slots so far followed by slicing (tests check the
    gradients against that). Backward adds each window's gradient into one
    preallocated gradient buffer. When autograd reaches the write of a slot,
    that slot's gradient is complete: every window that reads it was handed
    out by a later write, and autograd runs the backward of nodes made later
    first. The windows are outputs in the layout attention reads, so no view
    op sits between them and this backward (each would allocate a full-size
    gradient per step).
    """

    @staticmethod
    def forward(ctx, new: Tensor, buffer: KeyValueBuffer, window: int):
        buffer._write(new)
        planes = buffer.window(window)
        ctx.buffer = buffer  # not save_for_backward: the buffer is no graph input
        ctx.start, ctx.end = buffer.length - new.size(0), buffer.length
        ctx.window_start = ctx.end - planes[0].size(2)
        return planes

    @staticmethod
    def backward(ctx, *grad_planes: Tensor):
        buffer = ctx.buffer
        if buffer.grad is None:
            buffer.grad = torch.zeros_like(buffer.slots)
        window = buffer.grad[ctx.window_start : ctx.end].permute(1, 2, 3, 0, 4)
        for plane, grad in zip(window, grad_planes):
            if grad is not None:
                plane += grad
        return buffer.grad[ctx.start : ctx.end], None, None
