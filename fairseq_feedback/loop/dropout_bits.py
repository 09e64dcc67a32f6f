"""A block's dropout masks, drawn for all its steps and layers at once and held as bits.

In the model's dtype, the masks of the memory attention's weights alone take
[tgt_len, layers, rows x heads, 1, span] a block: at enwik8's sizes (blocks
of 128, 12 layers, 8 heads, spans of up to 8,192) 201 MB a stream in fp16.
So a block draws its masks as bits, 8 to a byte, and unpacks CHUNK steps of
them at a time into a room of masks in the dtype, scaled by 1 / (1 - p),
which the steps read as views (a residual with dropout stays one addcmul,
the attention's weights one mul): the forward's steps in order, the
backward's in reverse, both from the same bits, so that the backward reads
exactly the forward's masks. A mask is read only while its step runs
(the encoder attention's weight gradients, which come once per block, read
weights into which each step's backward folded its mask: attention.Attention).
A block holds the bits (1/16 of the masks in
fp16, 1/32 in fp32) and one chunk: from 128 steps a block, an eighth of the
masks in the dtype or less (enwik8's in fp16: 23.5 MB a stream of 213.9 MB).
"""

import math
from typing import Callable, List, Sequence

import torch
from torch import Tensor

from .fused_layer import NO_DROPOUT, DropoutMasks

# steps unpacked at once: two operators a chunk, forward and backward; the
# masks of CHUNK steps are what a block holds besides its bits
CHUNK = 4


class BlockDropout:
    """The dropout masks of a block's steps and layers: one Bernoulli draw
    per kind, held as bits, unpacked a chunk of steps at a time.

    Args:
        like: a tensor of the model's dtype and device.
        tgt_len: the block's steps.
        layers: its layers (those that LayerDrop left out draw too).
        shapes: each kind's mask at a step and layer (None: the layer has none).
        rates: each kind's dropout p, in DropoutMasks' order (0: none).
        slots: the slots that step t's memory attention reads, the last of its mask's.
    """

    def __init__(self, like: Tensor, tgt_len: int, layers: int, shapes: DropoutMasks, rates: Sequence[float],
                 slots: Callable[[int], int]):
        self.tgt_len, self.layers = tgt_len, layers
        self.kinds = [(kind, shape, p) for kind, shape, p in zip(DropoutMasks._fields, shapes, rates)
                      if p and shape is not None]
        self.held = None  # the chunk unpacked in the room
        if not self.kinds:
            self.steps = [[NO_DROPOUT] * layers] * tgt_len
            return
        # each kind's bits from a byte of their own, so that a kind is drawn over whole bytes
        sizes = [-(-math.prod(shape) // 8) * 8 for _, shape, _ in self.kinds]
        self.offsets = [sum(sizes[:k]) for k in range(len(sizes))]
        width = sum(sizes)  # a step's and layer's masks
        chunk = min(CHUNK, tgt_len)
        self.bits = like.new_empty(tgt_len, layers, width // 8, dtype=torch.uint8)
        self.unpacked_bits = like.new_empty(chunk, layers, width // 8, 8, dtype=torch.uint8)  # 0 or bit j's 2^j
        self.room = like.new_empty(chunk, layers, width)
        # made on the device, by its own operators: a copy from the host would stop a CUDA graph's capture
        self.bit_values = 2 ** torch.arange(8, dtype=torch.uint8, device=like.device)
        # bit j of a byte unpacks to 2^j, times 1 / ((1 - p) 2^j): exactly 1 / (1 - p) in the dtype (a power of 2 apart)
        self.scale = torch.cat([like.new_full((size // 8, 8), 1 / (1 - p)) for (_, _, p), size
                                in zip(self.kinds, sizes)]).div_(self.bit_values)
        in_chunk = [self._views(self.room[j]) for j in range(chunk)]  # made once for every chunk
        # the memory attention's cut to the slots that step t reads, the last
        self.steps = [[masks if masks.attention is None else masks._replace(attention=masks.attention[..., -slots(t):])
                       for masks in in_chunk[t % chunk]] for t in range(tgt_len)]
        self._draw(sizes)

    def _draw(self, sizes: List[int]) -> None:
        """Each kind's bits, kept with probability 1 - p, packed 8 to a byte
        (bit j of byte b: element 8 b + j). Drawn for the whole block at
        once, a byte an element until packed: one Bernoulli draw a kind,
        at the block's start, before its steps make what they keep."""
        drawn = self.bits.new_empty(*self.bits.shape, 8)
        elements = drawn.view(self.tgt_len, self.layers, -1)
        for (_, _, p), offset, size in zip(self.kinds, self.offsets, sizes):
            elements[:, :, offset: offset + size].bernoulli_(1 - p)
        torch.sum(drawn.mul_(self.bit_values), -1, dtype=torch.uint8, out=self.bits)

    def _views(self, masks: Tensor) -> List[DropoutMasks]:
        """A step's masks of each layer, views of `masks` [layers, width]."""
        return [DropoutMasks(**{kind: masks[i, offset: offset + math.prod(shape)].view(shape)
                                for (kind, shape, _), offset in zip(self.kinds, self.offsets)})
                for i in range(self.layers)]

    def _unpack(self, chunk: int) -> Tensor:
        """The chunk's masks, [steps, layers, width], unpacked into the room."""
        start = chunk * len(self.room)
        steps = min(len(self.room), self.tgt_len - start)
        unpacked = torch.bitwise_and(self.bits[start: start + steps, :, :, None], self.bit_values,
                                     out=self.unpacked_bits[:steps])
        torch.mul(unpacked, self.scale, out=self.room[:steps].view(unpacked.shape))
        self.held = chunk
        return self.room[:steps]

    def at(self, t: int) -> List[DropoutMasks]:
        """Step t's masks, each layer's: views of the room, where step t's
        chunk is unpacked unless it is there already (the forward reads the
        steps in order, the backward in reverse: one unpacking a chunk each;
        the backward starts from the chunk that the forward ended with).
        A step reads them while it runs: the next chunk overwrites them."""
        if self.kinds and t // len(self.room) != self.held:
            self._unpack(t // len(self.room))
        return self.steps[t]

    def unpacked(self) -> DropoutMasks:
        """Every mask of the block, [tgt_len, layers, ...] (None: no
        dropout), in a tensor of their own: what the steps read (at), for
        a test to compare."""
        if not self.kinds:
            return NO_DROPOUT
        chunks = range(-(-self.tgt_len // len(self.room)))
        whole = torch.cat([self._unpack(chunk).clone() for chunk in chunks])
        return DropoutMasks(**{kind: whole[:, :, offset: offset + math.prod(shape)].view(*whole.shape[:2], *shape)
                               for (kind, shape, _), offset in zip(self.kinds, self.offsets)})
