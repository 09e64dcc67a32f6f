"""The feedback memory's keys and values in fixed-shape tensors, for decoding
with CUDA graphs.

KeyValueBuffer hands each step a window of the slots it reads, so shapes grow
step by step, which a captured graph cannot replay. Here the slots form a
ring of fixed capacity, each tagged with the step whose memory vector it
holds; a step reads every slot and masks those outside its span:

    d_j = t - step_j,   slot j visible at step t iff 1 <= d_j <= span

(m_{-1}, the zero memory, is step -1), so one captured step serves every
position. Step s is kept in slot (s + 1) mod capacity; a ring of span + 1
slots is the most ever needed: step t then overwrites m_{t - span}, which
no later step reads.

A masked slot gets weight 0, but 0 times a non-finite value is NaN: every
slot and row that a search does not own is kept at zero, so that nothing an
earlier search left (an fp16 overflow, say) reaches this one.
"""

from typing import Tuple

import torch
from torch import Tensor

NEVER = -(2**40)  # the step of an empty slot: never visible


class StaticMemory:
    """The memory's keys and values as a ring of fixed shape.

    Args:
        capacity: the slots of the ring.
        bsz: its rows (a search's sentences, bucketed, times the beam).
        like: keys and values of memory vectors, [slots, planes, bsz,
            num_heads, head_dim], whose other sizes, dtype and device these have.
    """

    def __init__(self, capacity: int, bsz: int, like: Tensor):
        self.slots = like.new_zeros((capacity, like.size(1), bsz) + like.shape[3:])
        self.slot_steps = torch.full((capacity,), NEVER, dtype=torch.long, device=like.device)
        self.step = torch.zeros((), dtype=torch.long, device=like.device)  # t: the next step to run

    @property
    def capacity(self) -> int:
        return self.slots.size(0)

    @property
    def bsz(self) -> int:
        return self.slots.size(2)

    def start(self, initial_kv: Tensor) -> None:
        """A fresh memory holding m_{-1}'s keys and values (in every row)."""
        self.slots.zero_()
        self.slot_steps.fill_(NEVER)
        self.step.zero_()
        self.slots[0] = initial_kv[0]
        self.slot_steps[0] = -1

    def read(self) -> Tuple[Tuple[Tensor, ...], Tensor]:
        """Every slot, as one [bsz, num_heads, slots, head_dim] view per plane,
        and each slot's distance from the current step."""
        return tuple(self.slots.permute(1, 2, 3, 0, 4).unbind(0)), self.step - self.slot_steps

    def write(self, kv: Tensor) -> None:
        """Stores the current step's keys and values ([1, planes, bsz, num_heads,
        head_dim]) and moves on a step: in place, with no host involved."""
        slot = ((self.step + 1) % self.capacity).view(1)
        self.slots.index_copy_(0, slot, kv)
        self.slot_steps.index_copy_(0, slot, self.step.view(1))
        self.step += 1

    def copy_to(self, other: "StaticMemory", order: Tensor, steps_taken: int) -> None:
        """Into `other` (as large, or larger before the ring wraps), the rows
        `order` selects (beam search), of the slots filled after `steps_taken`
        steps; the rest of `other` is cleared."""
        filled = min(steps_taken + 1, self.capacity)
        selected = self.slots[:filled].index_select(2, order)  # before clearing: `other` may be this memory
        other.slots.zero_()
        other.slots[:filled, :, : len(order)] = selected
        other.slot_steps[:filled] = self.slot_steps[:filled]
        other.slot_steps[filled:] = NEVER
        other.step.copy_(self.step)
