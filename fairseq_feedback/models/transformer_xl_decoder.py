"""The paper's Transformer baseline (--no-feedback), with Transformer-XL caching.

Each layer attends to the last `span` inputs of its own layer, itself
included, instead of to the feedback memory: the standard Transformer that
the paper compares against, through the same layers, attention, relative
positions, key/value buffer and tasks. Nothing ties a step to the one before
at the same layer's output, so a whole block is computed at once; decoding
feeds blocks of one token. Across blocks of a stream, each layer's last
inputs are carried (detached) and projected again with the current weights.
"""

from typing import Optional

import torch
from torch import Tensor

from ..modules.feedback_attention import Alignment, aligned
from ..modules.memory_view import MemoryView, SlotDistances
from ..modules.memory_decoder_layer import MemoryDecoderLayer, per_layer
from ..modules.key_value_buffer import KeyValueBuffer
from .memory_decoder import IncrementalState, MemoryDecoder, StreamState


class TransformerXLDecoder(MemoryDecoder):
    def decode(self, x, layers, encoder_kv, encoder_bias, incremental_state: Optional[IncrementalState] = None,
               stream_state: Optional[StreamState] = None, alignment: Optional[Alignment] = None):
        """Each layer on the whole block, over the last inputs of its own layer.

        Args and returns: as MemoryDecoder.decode.
        """
        span = self.current_span()
        carried = None if stream_state is None else stream_state.vectors  # [layers, slots, bsz, embed_dim]
        inputs, encoder_kv = [], per_layer(encoder_kv, len(layers))
        for i, layer in enumerate(layers):
            inputs.append(x)
            if layer is None:  # left out by LayerDrop: passes its input on
                continue
            keys, values = self._keys_values(layer, x, None if carried is None else carried[i], span,
                                             incremental_state)
            x = layer.forward_memory(x, self._memory_view(layer, keys, values, len(x), span), encoder_kv[i],
                                     encoder_bias, aligned(alignment, i))
        if stream_state is not None:
            layer_inputs = torch.stack(inputs)
            stream_state.carry(layer_inputs if carried is None else torch.cat([carried, layer_inputs], 1), self.span)
        return x

    @staticmethod
    def _keys_values(layer: MemoryDecoderLayer, x: Tensor, carried: Optional[Tensor], span: int,
                     incremental_state: Optional[IncrementalState]):
        """Keys and values of the layer's inputs: the block's, after those of up
        to span - 1 earlier inputs (cached in decoding, carried in a stream)."""
        attn = layer.self_attn
        buffer = attn.cached_keys_values(incremental_state)
        if buffer is None:
            previous = x[:0] if carried is None else carried[max(0, len(carried) - (span - 1)):]
            kv = layer.project_own_memory(torch.cat([previous, x]))  # once per block
            buffer = KeyValueBuffer.empty(len(kv), like=kv)
        else:
            kv = layer.project_own_memory(x)
        keys, values = buffer.append(kv, span - 1 + len(x))
        attn.cache_keys_values(incremental_state, buffer)
        return keys, values

    def _memory_view(self, layer: MemoryDecoderLayer, keys: Tensor, values: Tensor, queries: int, span: int):
        """What a block of queries reads: query t (of the block's last
        `queries` slots) sees the slots at distances 0 .. span - 1 before it,
        with the relative position of each distance."""
        slots = keys.size(2)
        distance = (torch.arange(queries, device=keys.device)[:, None] + (slots - queries)
                    - torch.arange(slots, device=keys.device)[None, :])
        view = SlotDistances(distance, 0, span, self.span)
        attn = layer.self_attn
        positions = None if self.key_positions is None else (self.key_positions, view.table_index)
        return MemoryView(keys, values, view.bias(attn.span_mask, keys), attn.persistent(), positions)
