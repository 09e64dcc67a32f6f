"""The reference loop: section 3.3 step by step, through autograd.

Each step runs fairseq's modules as they are (MemoryDecoderLayer's
forward_memory, FeedbackMemory) and autograd records it: it covers every
option, and it is what the fused block (fused_block.py) is checked against.
The decoder runs it where the fused block does not cover an option
(fallback.py), or when told to (FeedbackDecoder.use_fused_block(False)).
"""

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..modules.feedback_attention import Alignment, aligned
from ..modules.key_value_buffer import KeyValueBuffer
from ..modules.memory_decoder_layer import per_layer
from ..modules.memory_view import MemoryView, with_positions


def persistent_vectors(layers: Sequence) -> List:
    """Each layer's persistent key/value vectors, or None."""
    return [None if layer is None else layer.self_attn.persistent() for layer in layers]


def memory_views(memory, window: Tuple[Tensor, ...], positions: Optional[Tensor], biases: Sequence[Optional[Tensor]],
                 persistent: Sequence) -> List[MemoryView]:
    """What each layer reads at one step (MemoryView).

    Args:
        memory: the decoder's FeedbackMemory.
        window: its slots that the step reads, one [bsz, num_heads, slots, head_dim] view per plane.
        positions: the relative positions of a full window, [span, head_dim], or None.
        biases: each layer's bias of a full window (its last slots are kept), or None.
        persistent: each layer's persistent (keys, values), or None.
    """
    return [MemoryView(keys, values, None if bias is None else bias[..., -keys.size(2):], vectors)
            for (keys, values), bias, vectors in zip(
                memory.layer_keys_values(window, lambda k: with_positions(k, positions)), biases, persistent)]


def reference_step(x: Tensor, views: Sequence[MemoryView], layers: Sequence,
                   encoder_kv: Sequence[Optional[Tuple[Tensor, Tensor]]], encoder_bias: Optional[Tensor], memory,
                   weights: Tensor, alignment: Optional[Alignment] = None) -> Tuple[Tensor, Tensor]:
    """One step through every layer, x_t^{l+1} = Layer_l(x_t^l, memory), then eq. 1.

    Args:
        x: x_t^0, [bsz, embed_dim].
        views: what each layer reads (memory_views).
        layers: the layers, None where LayerDrop left one out (it passes its input on).
        encoder_kv: each layer's encoder (keys, values) (per_layer).
        encoder_bias: their padding mask as a bias, [sentences, 1, 1, src_len], or None.
        memory: the decoder's FeedbackMemory; `weights` its mixing weights.
        alignment: where fairseq's alignment layer puts its encoder attention's weights, or None.

    Returns:
        the top layer's output [bsz, embed_dim], and m_t [memories, bsz, embed_dim].
    """
    states = [x]
    for i, (layer, view, kv) in enumerate(zip(layers, views, encoder_kv)):
        if layer is not None:
            x = layer.forward_memory(x, view, kv, encoder_bias, aligned(alignment, i))
        states.append(x)  # a left-out layer passes its input on
    return x, memory(states, weights)


class ReferenceLoop:
    """FeedbackLoop.block (feedback_loop.py) for one block, step by step. Each
    step appends the keys and values of its memory vector to `buffer` and
    reads the window of the last `span`.

    Args: as FusedFeedbackLoop takes them.
    """

    def __init__(self, memory, layers: Sequence, buffer: KeyValueBuffer, window: Tuple[Tensor, ...], span: int,
                 positions: Optional[Tensor], span_biases: Sequence[Optional[Tensor]], weights: Tensor,
                 alignment: Optional[Alignment] = None):
        self.memory, self.layers, self.buffer, self.window, self.span = memory, layers, buffer, window, span
        self.alignment = alignment
        self.positions, self.span_biases, self.weights = positions, span_biases, weights

    def __call__(self, x: Tensor, encoder_kv: Optional[Tensor], encoder_bias: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """The top layer's outputs [tgt_len, bsz, embed_dim] and the memory
        vectors [tgt_len, memories, bsz, embed_dim]."""
        persistent = persistent_vectors(self.layers)
        encoder_kv = per_layer(encoder_kv, len(self.layers))
        window, outputs, memories = self.window, [], []
        for h in x.unbind(0):  # not x[t]: each index's backward fills a gradient of all of x
            views = memory_views(self.memory, window, self.positions, self.span_biases, persistent)
            h, m = reference_step(h, views, self.layers, encoder_kv, encoder_bias, self.memory, self.weights,
                                  self.alignment)
            window = self.buffer.append(self.memory.project(m.unsqueeze(0)), self.span)
            outputs.append(h)
            memories.append(m)
        return torch.stack(outputs), torch.stack(memories)
