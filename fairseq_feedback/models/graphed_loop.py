"""The feedback loop at bounded shapes, replayed as CUDA graphs.

A CUDA graph replays fixed shapes, and fairseq's batches vary in rows and
lengths. So a block is padded up to a bucket: time steps at the end (the
loop is causal: later steps change nothing before them), rows (rows never
mix), and source positions (masked out of encoder attention). Padding's
outputs are cut off before anything reads them, so its gradients are zero
and it changes no loss or gradient. One graph per bucket (and per span,
kept layers, dtype, training or not) is captured at its first use and kept
in a bounded cache on one memory pool.

What differs from the eager loop is only where shapes come from; the loop
itself is FeedbackDecoder's. Without capture (CPU tests) the same padding
and bookkeeping run the loop eagerly.
"""

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..modules.cuda_graphs import GraphCache

# A cached graph holds its parameter gradients and outputs; at base sizes in
# fp16, about 50 MB each.
CACHED_GRAPHS = 64


def bucket(n: int) -> int:
    """n rounded up to a multiple of 8, or from 128 on of a sixteenth of the
    power of two below it: less than 8 or n/8 of padding, few buckets."""
    step = max(8, 2 ** (n.bit_length() - 4))
    return -(-n // step) * step


class GraphedFeedbackLoop:
    def __init__(self, capture: bool):
        self.capture = capture
        self.cache = GraphCache(CACHED_GRAPHS, capture, name="feedback loop")

    def __deepcopy__(self, memo):
        return GraphedFeedbackLoop(self.capture)  # a copy of the model (e.g. --ema) captures its own

    def __call__(self, decoder, x: Tensor, initial: Tensor, span: int, layers: List, encoder_kv: Optional[Tensor],
                 encoder_bias: Optional[Tensor]):
        """FeedbackDecoder.feedback_loop over a memory started from `initial`
        (its last memory vectors), on the block x [time, batch, embed]."""
        steps, rows, _ = x.shape
        padded_rows = bucket(rows)
        inputs = [
            F.pad(x, (0, 0, 0, padded_rows - rows, 0, bucket(steps) - steps)),
            F.pad(initial, (0, 0, 0, padded_rows - rows)),
            *self._pad_encoder(encoder_kv, encoder_bias, padded_rows),
        ]
        params = [*decoder.memory.parameters(), *decoder.layers.parameters()]
        if decoder.key_positions is not None:
            params.append(decoder.key_positions)
        kept = tuple(layer is not None for layer in layers)
        key = (tuple(None if t is None else tuple(t.shape) for t in inputs), span, kept, x.dtype,
               torch.is_grad_enabled(), decoder.training,
               torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None,
               tuple(p.data_ptr() for p in params))  # parameters moved or converted: the graphs are stale

        def loop(x, initial, encoder_kv, encoder_bias):
            buffer, window = decoder.start_memory(initial, len(x), span)
            outputs, memories = decoder.feedback_loop(x, buffer, window, span, layers, encoder_kv, encoder_bias)
            return outputs, memories.detach()  # a stream carries its memory detached: no backward for it

        outputs, memories = self.cache(key, loop, inputs, params)
        return outputs[:steps, :rows], memories[:steps, :rows]

    @staticmethod
    def _pad_encoder(encoder_kv, encoder_bias, padded_rows: int):
        """Encoder keys/values [layers, 2, rows, heads, src_len, head_dim] and
        their mask, padded to bucketed rows and source positions; padded
        positions are masked, padded rows see zero keys and values."""
        if encoder_kv is None:
            return None, None
        rows, src_len = encoder_kv.size(2), encoder_kv.size(4)
        padded_len = bucket(src_len)
        if encoder_bias is None:
            encoder_bias = encoder_kv.new_zeros(rows, 1, 1, src_len)
        encoder_bias = F.pad(encoder_bias, (0, padded_len - src_len), value=float("-inf"))
        encoder_bias = F.pad(encoder_bias, (0, 0, 0, 0, 0, 0, 0, padded_rows - rows))  # whole rows: visible zeros
        encoder_kv = F.pad(encoder_kv, (0, 0, 0, padded_len - src_len, 0, 0, 0, padded_rows - rows))
        return encoder_kv, encoder_bias
