"""The feedback loop's blocks at bounded shapes, replayed as CUDA graphs.

A CUDA graph replays fixed shapes, and fairseq's batches vary in rows and
lengths. So a block is padded up to a bucket: time steps at the end (the
loop is causal: later steps change nothing before them), rows (rows never
mix), and source positions (masked out of encoder attention). Padding's
outputs are cut off before anything reads them, so its gradients are zero
and it changes no loss or gradient. One graph per bucket (and per the
caller's key: span, dtype, training or not) is captured at its second use,
checked against the eager loop, and kept in a cache bounded in graphs and
bytes (fairseq_feedback/cuda_graphs). Buckets are few: rows and source
positions go up to a power of two, and training under LayerDrop (a pattern
of kept layers per block) runs eagerly.

Decoding replays one captured step per token (graphed_decoding.py), from
the same cache.

The runner knows shapes, buckets and the cache, and nothing of feedback:
the decoder hands it the function to replay (feedback_loop.py's
FeedbackLoop.block_from, which holds the modules it runs and never the
decoder), its inputs, its parameters and its key, and the runner calls
nothing of the decoder. The CUDA calls are the backend's: on a GPU the real
ones, and with --cuda-graphs emulate, on any device, a stand-in that runs
the same path (fairseq_feedback/cuda_graphs/backends.py).
"""

import logging
from typing import Callable, Hashable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..cuda_graphs import (CudaGraphBackend, GraphCache, GraphStatistics, RecordedGraphBackend, autocast_dtype,
                           bucket, bucket_wide)
from .graphed_decoding import GraphedDecoding

logger = logging.getLogger(__name__)

# fn(x, initial, encoder_kv, encoder_bias, *parameters) -> (outputs, memory vectors), as FeedbackLoop.block_from
ReplayedBlock = Callable[..., Tuple[Tensor, Tensor]]


class GraphedFeedbackLoop:
    """The loop's blocks and a search's steps replayed from graphs. The cache
    is made at the first call, on its device; `decoding` shares it.

    Args:
        mode: "auto" captures on CUDA and leaves other devices to the eager
            loop; "emulate" runs the same path through the stand-in backend,
            on any device.
        cache_options: the cache's bounds (GraphCache: max_graphs, max_bytes).
    """

    def __init__(self, mode: str = "auto", **cache_options):
        self.mode, self.cache_options = mode, cache_options
        self.cache: Optional[GraphCache] = None
        self.decoding: Optional[GraphedDecoding] = None
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

    def runs_blocks(self, device: torch.device, every_layer: bool) -> bool:
        """Whether a training or scoring block on `device` runs from graphs.
        `every_layer`: whether this pass keeps every layer; LayerDrop's 2^layers
        patterns would each need a graph, so such blocks run eagerly."""
        cache = self._start(device)
        if cache is None or cache.failed is not None:
            return False
        if not every_layer and not self.warned_layerdrop:
            self.warned_layerdrop = True
            logger.warning("feedback loop: LayerDrop leaves out other layers at every block; "
                           "training blocks run eagerly, without CUDA graphs")
        return every_layer

    def decodes(self, device: torch.device, search: Optional[dict]) -> bool:
        """Whether a decoding call on `device` runs from graphs: without
        gradients, while the cache serves; a search under way (`search`,
        GraphedDecoding.start's) stays where it started."""
        return (not torch.is_grad_enabled() and self._start(device) is not None
                and (self.cache.failed is None or search is not None))

    def block(self, fn: ReplayedBlock, x: Tensor, initial: Tensor, encoder_kv: Optional[Tensor],
              encoder_bias: Optional[Tensor], parameters: Sequence[Tensor], graph_key: Hashable,
              description: str) -> Tuple[Tensor, Tensor]:
        """fn(x, initial, encoder_kv, encoder_bias, *parameters) at the block's
        bucket, each input padded to it, the outputs cut back.

        Args:
            fn: the block (FeedbackLoop.block_from).
            x: the first layer's inputs, [tgt_len, bsz, embed_dim].
            initial: the memory vectors the block starts from, [slots, memories, bsz, embed_dim].
            encoder_kv: the encoder's keys and values,
                [layers, 2, sentences, num_heads, src_len, head_dim], or None.
            encoder_bias: their padding mask as a bias, [sentences, 1, 1, src_len], or None.
            parameters: what fn reads besides its inputs (their gradients come from the graph).
            graph_key: what else fn's graph depends on; `description` says it
                in words, for the log.

        Returns:
            fn's outputs: the top layer's [tgt_len, bsz, embed_dim] and the
            memory vectors [tgt_len, memories, bsz, embed_dim].
        """
        tgt_len, bsz, _ = x.shape
        padded_bsz, padded_tgt_len, padded_positions = self.block_shape(
            bsz, tgt_len, None if encoder_kv is None else encoder_kv.size(4))
        inputs = [
            F.pad(x, (0, 0, 0, padded_bsz - bsz, 0, padded_tgt_len - tgt_len)),
            F.pad(initial, (0, 0, 0, padded_bsz - bsz)),
            *self._pad_encoder(encoder_kv, encoder_bias, padded_bsz, padded_positions),
        ]
        grad, autocast = torch.is_grad_enabled(), autocast_dtype(x.device.type)
        full_key = (tuple(None if t is None else tuple(t.shape) for t in inputs), graph_key, x.dtype, grad, autocast,
                    tuple(p.data_ptr() for p in parameters))  # parameters moved or converted: the graphs are stale
        shape = (f"{padded_bsz} rows x {padded_tgt_len} steps"
                 + ("" if encoder_kv is None else f" x {padded_positions} source positions")
                 + f", {description}, {x.dtype}{', autocast' if autocast else ''}"
                 + (", training" if grad else ", evaluation"))
        outputs, memories = self.cache(full_key, fn, inputs, parameters, shape=shape)
        return outputs[:tgt_len, :bsz], memories[:tgt_len, :, :bsz]

    def reorder(self, search: Optional[dict], new_order: Tensor) -> None:
        """Beam search's new order of the rows of `search` (None: none ran here)."""
        if search is not None:
            self.decoding.reorder(search, new_order)

    def log_statistics(self) -> None:
        if self.cache is not None:
            self.cache.log_statistics()

    def statistics(self) -> Optional[GraphStatistics]:
        """The cache's figures (None: not made yet, or never on this device)."""
        return None if self.cache is None else self.cache.summary()

    @staticmethod
    def block_shape(bsz: int, tgt_len: int, source_positions: Optional[int]):
        """The bucket a block of these sizes is padded to."""
        return bucket_wide(bsz), bucket(tgt_len), None if source_positions is None else bucket_wide(source_positions)

    @staticmethod
    def window(span: int, memory_span: int) -> int:
        """The slots a graphed block's steps read, for a span that may change
        as it trains (a learned span is the only span below --memory-span,
        `memory_span`): the span's bucket, the slots beyond a head's span
        weighted 0 by its mask, as eagerly."""
        return min(bucket(span), memory_span)

    @staticmethod
    def _pad_encoder(encoder_kv, encoder_bias, padded_bsz: int, padded_len: int):
        """Encoder keys/values [layers, 2, sentences, num_heads, src_len, head_dim] and
        their mask, padded to bucketed rows and source positions; padded
        positions are masked, padded rows see zero keys and values."""
        if encoder_kv is None:
            return None, None
        bsz, src_len = encoder_kv.size(2), encoder_kv.size(4)
        if encoder_bias is None:
            encoder_bias = encoder_kv.new_zeros(bsz, 1, 1, src_len)
        encoder_bias = F.pad(encoder_bias, (0, padded_len - src_len), value=float("-inf"))
        encoder_bias = F.pad(encoder_bias, (0, 0, 0, 0, 0, 0, 0, padded_bsz - bsz))  # whole rows: visible zeros
        encoder_kv = F.pad(encoder_kv, (0, 0, 0, padded_len - src_len, 0, 0, 0, padded_bsz - bsz))
        return encoder_kv, encoder_bias
