"""Preallocated keys and values of the feedback memory.

The per-token loop appends one memory slot per step and reads a window of the
last `span` slots. Concatenating a growing tensor each step costs O(t) copies
and keeps every intermediate alive for backward (O(T^2) memory); here each step
writes its slot in place and reads a view, so a block of T steps costs O(T).

Layout: [slots, planes, batch, heads, head_dim]. Slots come first so that the
filled part is contiguous (one copy on reorder, one block in backward); a plane
is a key or a value of one key/value projection (2 when all layers share it).
"""

from typing import Optional, Tuple

import torch
from torch import Tensor


class KeyValueBuffer:
    """The last slots of the memory, written in place, read as windows."""

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

    def append(self, new: Tensor, span: int) -> Tuple[Tensor, ...]:
        """Writes `new` ([n, planes, batch, heads, head_dim]) after the filled
        slots and returns the window the next step reads, the last `span`
        slots, as one [batch, heads, slots, head_dim] view per plane."""
        if self.length + new.size(0) > self.capacity:
            self._make_room(new.size(0), span)
        if torch.is_grad_enabled() and new.requires_grad:
            return _AppendToBuffer.apply(new, self, span)
        return self._write(new, span)

    def window(self, span: int) -> Tuple[Tensor, ...]:
        slots = self.slots[max(0, self.length - span) : self.length]
        return tuple(slots.permute(1, 2, 3, 0, 4).unbind(0))

    def _write(self, new: Tensor, span: int) -> Tuple[Tensor, ...]:
        start, end = self.length, self.length + new.size(0)
        # `.data` is an alias with its own version counter: windows handed out
        # earlier and saved for backward must not see a version bump, since
        # their slots are never overwritten.
        self.slots.data[start:end] = new
        self.length = end
        return self.window(span)

    def _make_room(self, incoming: int, span: int) -> None:
        """Grows the buffer, dropping slots that no future window can reach.
        Decoding only: a training block sizes its buffer so that windows saved
        for backward stay valid."""
        keep = min(self.length, span)
        capacity = max(2 * (keep + incoming), 16)
        slots = self.slots.new_empty((capacity,) + self.slots.shape[1:])
        slots[:keep] = self.slots[self.length - keep : self.length]
        self.slots, self.length = slots, keep

    def reorder(self, new_order: Tensor, span: int) -> "KeyValueBuffer":
        """Beam search: keep the rows `new_order` selects, and only the last
        `span` slots, with room to grow."""
        keep = min(self.length, span)
        planes, _, heads, head_dim = self.slots.shape[1:]
        slots = self.slots.new_empty((keep + 16, planes, len(new_order), heads, head_dim))
        torch.index_select(
            self.slots[self.length - keep : self.length], 2, new_order, out=slots[:keep]
        )
        return KeyValueBuffer(slots, keep)


class _AppendToBuffer(torch.autograd.Function):
    """`KeyValueBuffer.append` with a gradient.

    Equals torch.cat of all slots so far followed by slicing (tests check the
    gradients against that). Backward adds each window's gradient into one
    preallocated gradient buffer. When autograd reaches the write of a slot,
    that slot's gradient is complete: every window that reads it was handed
    out by a later write, whose backward ran first. The windows are outputs
    in the layout attention reads, so no view op sits between them and this
    backward (each would allocate a full-size gradient per step).
    """

    @staticmethod
    def forward(ctx, new: Tensor, buffer: KeyValueBuffer, span: int):
        planes = buffer._write(new, span)
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
