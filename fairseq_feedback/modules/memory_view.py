"""What a query sees of a memory, from the distance of each slot.

A query reads slots that hold earlier steps; slot j lies d_j steps before
it. For the feedback memory the nearest slot is the previous step (d = 1: a
step never reads its own memory vector); for the Transformer baseline it is
the query's own input (d = 0). Counted from the nearest slot, e = d - nearest,
everything a view needs follows from e, in one convention for the eager
loop, the loop replayed as CUDA graphs and the baseline:

    visible                 iff  0 <= e < span
    adaptive span           bias += log m(e)                  (adaptive_span.py)
    relative position       k_j + p[S - 1 - e]                (S = --memory-span)

Tables of S entries (the relative positions, shared by all layers and
heads, and each head's span mask) are read at index S - 1 - e: the nearest
slot is the last entry, so the last slots of a window line up with a
table's last entries.
"""

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .adaptive_span import AdaptiveSpanMask


class MemoryView(NamedTuple):
    """What one layer reads of a memory.

    Args:
        keys, values: [bsz, num_heads, slots, head_dim] (for a block's queries,
            or one step's).
        bias: added to the scores, [..., queries, slots]: masks, the adaptive span.
        persistent: the layer's persistent (keys, values), [num_heads, n, head_dim] each.
        positions: for a block of queries, relative positions as (table
            [span, head_dim], the table index of each query-slot pair
            [queries, slots]).
    """

    keys: Tensor
    values: Tensor
    bias: Optional[Tensor] = None
    persistent: Optional[Tuple[Tensor, Tensor]] = None
    positions: Optional[Tuple[Tensor, Tensor]] = None


class SlotDistances:
    """Which slots each query sees, and the table index of each, from their distances.

    Args:
        distance: d of each slot from each query, [queries, slots].
        nearest: the distance of the nearest slot a query reads (1: the
            feedback memory; 0: the baseline's own inputs).
        span: how many slots from the nearest are visible.
        table_span: the rows of the tables read at S - 1 - e (--memory-span).
    """

    def __init__(self, distance: Tensor, nearest: int, span: int, table_span: int):
        from_nearest = distance - nearest
        self.hidden = (from_nearest < 0) | (from_nearest >= span)
        self.table_index = (table_span - 1 - from_nearest).clamp(0, table_span - 1)  # [queries, slots]
        self.table_span = table_span

    def bias(self, span_mask: Optional[AdaptiveSpanMask], like: Tensor) -> Tensor:
        """-inf on hidden slots, plus log m(e) of a layer's adaptive span: [num_heads or 1, queries, slots]."""
        bias = torch.zeros(self.hidden.shape, dtype=like.dtype, device=like.device).masked_fill(self.hidden, float("-inf"))
        return bias if span_mask is None else bias + self.span_bias(span_mask)

    def span_bias(self, span_mask: AdaptiveSpanMask) -> Tensor:
        """log m(e) of each head: [num_heads, queries, slots]."""
        return span_mask.bias(self.table_span)[:, 0][:, self.table_index]

    def positions(self, table: Tensor) -> Tensor:
        """p[S - 1 - e], the key-side relative position of each slot: [queries, slots, head_dim]."""
        return table[self.table_index]


def with_positions(keys: Tensor, positions: Optional[Tensor]) -> Tensor:
    """Keys plus relative positions: q.(k + p) = q.k + q.p. The positions
    are sliced only while the window is shorter than the span (each slice
    costs a gradient of the whole table).

    Args:
        keys: one step's window, [bsz, num_heads, slots, head_dim], its last slot the nearest.
        positions: the positions of a full window, [span, head_dim]
            (SlotDistances.positions, once per block), or None.
    """
    if positions is None:
        return keys
    return keys + (positions if keys.size(2) == positions.size(0) else positions[-keys.size(2):])
