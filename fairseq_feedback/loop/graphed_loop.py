"""The feedback loop at bounded shapes, replayed as CUDA graphs.

A CUDA graph replays fixed shapes, and fairseq's batches vary in rows and
lengths. So a block is padded up to a bucket: time steps at the end (the
loop is causal: later steps change nothing before them), rows (rows never
mix), and source positions (masked out of encoder attention). Padding's
outputs are cut off before anything reads them, so its gradients are zero
and it changes no loss or gradient. One graph per bucket (and per span,
dtype, training or not) is captured at its first use, checked against the
eager loop, and kept in a cache bounded in graphs and bytes
(fairseq_feedback/cuda_graphs). Buckets are few: rows and source positions go up to
a power of two, and training under LayerDrop (a pattern of kept layers per
block) runs eagerly.

Decoding replays one captured step per token (graphed_decoding.py), from
the same cache.

What differs from the eager loop is only where shapes come from; the loop
and its step are the decoder's. The CUDA calls are the backend's: on a GPU
the real ones, and with --cuda-graphs emulate, on any device, a stand-in
that runs the same path (fairseq_feedback/cuda_graphs/backends.py).
"""

import contextlib
import logging
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..cuda_graphs import CudaGraphBackend, GraphCache, RecordedGraphBackend, autocast_dtype, bucket, bucket_wide
from .block_weight_gradients import weight_gradients_per_block
from .graphed_decoding import GraphedDecoding
from .host import Layers, LoopHost

logger = logging.getLogger(__name__)


class GraphedFeedbackLoop:
    """`mode`: "auto" captures on CUDA and leaves other devices to the eager
    loop; "emulate" runs the same path through the stand-in backend, on any
    device. The cache (`cache_options`: its bounds) is made at the first
    call, on its device."""

    def __init__(self, mode: str = "auto", **cache_options):
        self.mode, self.cache_options = mode, cache_options
        self.cache: Optional[GraphCache] = None
        self.decoding: Optional[GraphedDecoding] = None  # its steps share the cache
        self.warned_layerdrop = False

    def __deepcopy__(self, memo):
        return GraphedFeedbackLoop(self.mode, **self.cache_options)  # a copy of the model (e.g. --ema) captures its own

    def _start(self, device: torch.device) -> Optional[GraphCache]:
        """The cache, made on the first call's device; None where "auto" leaves the loop eager."""
        if self.cache is None and (self.mode == "emulate" or device.type == "cuda"):
            backend = RecordedGraphBackend(device) if self.mode == "emulate" else CudaGraphBackend(device)
            self.cache = GraphCache(backend, name="feedback loop", **self.cache_options)
            self.decoding = GraphedDecoding(self.cache)
        return self.cache

    def run(self, decoder: LoopHost, x: Tensor, previous: Tensor, span: int, layers: Layers,
            encoder_kv: Optional[Tensor], encoder_bias: Optional[Tensor], incremental_state):
        """FeedbackDecoder.run_eagerly's results, from the graphs where they
        can serve: the top layer's outputs and the memory vectors (None when
        decoding). A search under way stays where it started."""
        cache = self._start(x.device)
        if incremental_state is not None:
            if not torch.is_grad_enabled() and cache is not None and (
                    cache.failed is None or self.decoding.serves(decoder, incremental_state)):
                return self.decoding.decode(decoder, x, span, layers, encoder_kv, encoder_bias, incremental_state), None
        elif cache is not None and cache.failed is None and self._all_kept(layers):
            return self.block(decoder, x, previous, span, layers, encoder_kv, encoder_bias)
        return decoder.run_eagerly(x, previous, span, layers, encoder_kv, encoder_bias, incremental_state)

    def _all_kept(self, layers: Layers) -> bool:
        """LayerDrop's 2^layers patterns would each need a graph: such blocks run eagerly."""
        if None not in layers:
            return True
        if not self.warned_layerdrop:
            self.warned_layerdrop = True
            logger.warning("feedback loop: LayerDrop leaves out other layers at every block; "
                           "training blocks run eagerly, without CUDA graphs")
        return False

    def reorder(self, decoder: LoopHost, incremental_state, new_order: Tensor) -> None:
        if self.decoding is not None:
            self.decoding.reorder(decoder, incremental_state, new_order)

    def log_statistics(self) -> None:
        if self.cache is not None:
            self.cache.log_statistics()

    def block(self, decoder: LoopHost, x: Tensor, previous: Tensor, span: int, layers: Layers,
              encoder_kv: Optional[Tensor], encoder_bias: Optional[Tensor]):
        """FeedbackDecoder.feedback_loop on the block x [time, batch, embed],
        over a memory started from the last `span` of the memory vectors
        `previous`."""
        steps, rows, _ = x.shape
        padded_rows, padded_steps, padded_positions = self.block_shape(
            rows, steps, None if encoder_kv is None else encoder_kv.size(4))
        # Learned spans (the only spans below --memory-span) change as they
        # train: the window is the bucket's size, the slots beyond a head's
        # span weighted 0 by its mask, as eagerly.
        span = min(bucket(span), decoder.span)
        inputs = [
            F.pad(x, (0, 0, 0, padded_rows - rows, 0, padded_steps - steps)),
            F.pad(previous[-span:], (0, 0, 0, padded_rows - rows)),
            *self._pad_encoder(encoder_kv, encoder_bias, padded_rows, padded_positions),
        ]
        params = decoder.loop_parameters()
        grad, autocast = torch.is_grad_enabled(), autocast_dtype(x.device.type)
        key = (tuple(None if t is None else tuple(t.shape) for t in inputs), span, x.dtype, grad, decoder.training,
               autocast, tuple(p.data_ptr() for p in params))  # parameters moved or converted: the graphs are stale
        shape = (f"{padded_rows} rows x {padded_steps} steps"
                 + ("" if encoder_kv is None else f" x {padded_positions} source positions")
                 + f", span {span}, {x.dtype}{', autocast' if autocast else ''}"
                 + (", training" if grad else ", evaluation"))

        decoder = weakref.proxy(decoder)  # a graph's function must not hold what holds its cache

        def loop(x, initial, encoder_kv, encoder_bias):
            buffer, window = decoder.start_memory(initial, len(x), span)
            # in a graph kernels cost and Python does not: the loop through
            # autograd takes the linear layers' weight gradients once per block
            # too (the fused block does by itself)
            per_block = (contextlib.nullcontext() if decoder.unfused_reason(layers, x.device.type) is None
                         else weight_gradients_per_block(decoder.loop_modules(layers)))
            with per_block:
                outputs, memories = decoder.feedback_loop(x, buffer, window, span, layers, encoder_kv, encoder_bias)
            return outputs, memories.detach()  # a stream carries its memory detached: no backward for it

        outputs, memories = self.cache(key, loop, inputs, params, shape=shape)
        return outputs[:steps, :rows], memories[:steps, :rows]

    @staticmethod
    def block_shape(rows: int, steps: int, source_positions: Optional[int]):
        """The bucket a block of these sizes is padded to."""
        return bucket_wide(rows), bucket(steps), None if source_positions is None else bucket_wide(source_positions)

    @staticmethod
    def _pad_encoder(encoder_kv, encoder_bias, padded_rows: int, padded_len: int):
        """Encoder keys/values [layers, 2, rows, heads, src_len, head_dim] and
        their mask, padded to bucketed rows and source positions; padded
        positions are masked, padded rows see zero keys and values."""
        if encoder_kv is None:
            return None, None
        rows, src_len = encoder_kv.size(2), encoder_kv.size(4)
        if encoder_bias is None:
            encoder_bias = encoder_kv.new_zeros(rows, 1, 1, src_len)
        encoder_bias = F.pad(encoder_bias, (0, padded_len - src_len), value=float("-inf"))
        encoder_bias = F.pad(encoder_bias, (0, 0, 0, 0, 0, 0, 0, padded_rows - rows))  # whole rows: visible zeros
        encoder_kv = F.pad(encoder_kv, (0, 0, 0, padded_len - src_len, 0, 0, 0, padded_rows - rows))
        return encoder_kv, encoder_bias
