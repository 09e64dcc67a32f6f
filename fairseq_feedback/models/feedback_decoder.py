"""The Feedback Transformer decoder (Fan et al. 2020, section 3.3).

Every layer attends to one shared memory of past steps instead of the past
states of its own input:

    m_t = sum_{l=0..L} softmax(w)_l x_t^l                       (eq. 1)
    x_t^{l+1} = Layer_l(x_t^l, {m_{t-span}, ..., m_{t-1}})

Step t reads m_{t-span} .. m_{t-1}; its own states reach the layers above
through the residual stream. The memory begins with one zero vector, m_{-1},
so that step 0 has something to attend to (no empty softmax): the same at
every position, in training, in decoding and across streamed blocks.

Since m_t needs every layer's output at step t, training runs token by token
too: the loop (loop/feedback_loop.py) is the whole model, and every mode
(training, streaming, decoding) runs it from a memory that it starts or
resumes. The decoder builds the loop at each call from its modules, and runs
it or hands it to the CUDA graphs; nothing the loop or a graph keeps holds
the decoder.
"""

import contextlib
import functools
import logging
from typing import Optional

import torch
from torch import Tensor

from ..loop import fallback
from ..loop.feedback_loop import FeedbackLoop, Layers
from ..loop.graphed_loop import GraphedFeedbackLoop
from ..loop.passes import Passes
from ..modules.feedback_attention import Alignment
from ..modules.feedback_memory import FeedbackMemory
from ..modules.key_value_buffer import KeyValueBuffer
from .feedback_config import unfused_options
from .memory_decoder import IncrementalState, MemoryDecoder, StreamState

logger = logging.getLogger(__name__)


class FeedbackDecoder(MemoryDecoder):
    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn, output_projection)
        num_heads = cfg.decoder.attention_heads
        self.memory = FeedbackMemory(
            self.embed_dim, self.num_layers, num_heads, cfg.head_dim or self.embed_dim // num_heads,
            shared_kv=not cfg.per_layer_kv, normalize_before=cfg.decoder.normalize_before,
            composition=cfg.memory_composition,
        )
        self.use_cuda_graphs("off" if cfg.no_cuda_graphs else str(cfg.cuda_graphs))
        self.use_fused_block(True)
        self.train_in_passes(Passes(cfg.train_passes, cfg.pass_group, str(cfg.pass_gradients),
                                    str(cfg.pass_initial_memory)) if cfg.train_passes else None)
        self.unfused_options = unfused_options(cfg)
        self.unfused_reasons_said = set()  # _log_unfused says each once

    def use_cuda_graphs(self, mode: str) -> None:
        """How the loop runs (--cuda-graphs): "off" eagerly; "auto" as CUDA
        graphs on a GPU, eagerly elsewhere; "emulate" through the same path
        as on a GPU, with a stand-in for the CUDA calls, on any device
        (loop/graphed_loop.py)."""
        self.graphed = None if mode == "off" else GraphedFeedbackLoop(mode)

    @property
    def cuda_graphs_mode(self) -> str:
        return "off" if self.graphed is None else self.graphed.mode

    @contextlib.contextmanager
    def cuda_graphs_in_mode(self, mode: str):
        """Within, the loop runs as use_cuda_graphs(mode) says (with a cache
        of its own), then as before, with the graphs it had."""
        before = self.graphed
        self.use_cuda_graphs(mode)
        try:
            yield
        finally:
            self.graphed = before

    def use_fused_block(self, use: bool) -> None:
        """Which loop runs the options that the fused block covers: the
        fused block (loop/fused_block.py; the default), or the reference
        loop step by step through autograd (loop/reference.py), the same
        outputs and gradients in more operators."""
        self.fused_block_enabled = use

    def train_in_passes(self, passes: Optional[Passes], in_evaluation: bool = False) -> None:
        """How training computes a block (--train-passes): in `passes`
        (loop/passes.py), or exactly (None). Evaluation and decoding run the
        exact loop; `in_evaluation`, for measuring how far a model's numbers
        in passes are from its exact ones (fairseq_feedback_cli/passes_gap.py),
        has evaluation run in passes too (decoding, never)."""
        self.passes, self.passes_in_evaluation, self.passes_said = passes, in_evaluation, False

    def decode(self, x, layers, encoder_kv, encoder_bias, incremental_state: Optional[IncrementalState] = None,
               stream_state: Optional[StreamState] = None, alignment: Optional[Alignment] = None):
        """Starts the memory (from m_{-1}, or from the stream's carried memory
        vectors, projected again with the current weights as the official code
        and Transformer-XL do) or resumes it from the decoding cache, then runs
        the loop (loop/feedback_loop.py), eagerly or as CUDA graphs: the
        decoder builds the function a graph replays and hands it over with its
        inputs (loop/graphed_loop.py, graphed_decoding.py), which call nothing
        of the decoder. A stream keeps its last `span` memory vectors, detached.

        Args and returns: as MemoryDecoder.decode.
        """
        span = self.current_span()
        carried = None if stream_state is None else stream_state.vectors  # [memories, slots, bsz, embed_dim]
        previous = (carried.transpose(0, 1) if carried is not None  # [slots, memories, bsz, embed_dim]
                    else x.new_zeros(1, self.memory.memories, x.size(1), self.embed_dim))  # m_{-1}
        graphed, memories = self.graphed, None
        search = None if incremental_state is None else self.get_incremental_state(incremental_state, "static_memory")
        if self.passes is not None and (self.training or self.passes_in_evaluation) and incremental_state is None:
            x, memories = self._run_in_passes(x, previous, span, layers, encoder_kv, encoder_bias)
        elif incremental_state is not None and graphed is not None and graphed.decodes(x.device, search):
            x = self._decode_graphed(x, span, layers, encoder_kv, encoder_bias, incremental_state, search, alignment)
        elif incremental_state is None and graphed is not None and graphed.runs_blocks(x.device, None not in layers):
            x, memories = self._block_graphed(x, previous, span, layers, encoder_kv, encoder_bias)
        else:
            x, memories = self._run_eagerly(x, previous, span, layers, encoder_kv, encoder_bias, incremental_state,
                                            alignment)
        if stream_state is not None:
            stream_state.carry(torch.cat([previous, memories]).transpose(0, 1), self.span)
        return x

    def _run_eagerly(self, x, previous, span, layers, encoder_kv, encoder_bias, incremental_state, alignment):
        """The loop from the decoding cache, or from the memory vectors
        `previous`: the top layer's outputs and the memory vectors."""
        buffer = self.memory.cached_keys_values(incremental_state)
        loop = self.loop(layers, span, self.unfused_reason(layers, x.device.type, buffer))
        if buffer is None:
            buffer, window = loop.start(previous[-span:], len(x))
        else:
            window = buffer.window(span)
        x, memories = loop.block(x, buffer, window, encoder_kv, encoder_bias, alignment)
        self.memory.cache_keys_values(incremental_state, buffer)
        return x, memories

    def _run_in_passes(self, x, previous, span, layers, encoder_kv, encoder_bias):
        """Training's block in passes (loop/passes.py), from the memory
        vectors `previous`: the top layer's outputs and the memory vectors."""
        if self.training and not self.passes_said:
            self.passes_said = True
            logger.info(f"feedback decoder: training runs in {self.passes}; validation, evaluation and decoding "
                        "run exactly, one position at a time")
        loop = self.loop(layers, span, None)
        buffer, window = loop.start(previous[-span:], len(x))
        return loop.block_in_passes(x, buffer, window, encoder_kv, encoder_bias, self.passes)

    def _block_graphed(self, x, previous, span, layers, encoder_kv, encoder_bias):
        """The block from the graph of its bucket: FeedbackLoop.block_from,
        its window at the span's bucket."""
        window = self.graphed.window(span, self.span)
        loop = self.loop(layers, window, self.unfused_reason(layers, x.device.type))
        return self.graphed.block(loop.block_from, x, previous[-window:], encoder_kv, encoder_bias,
                                  loop.parameters(), graph_key=(window, self.training, loop.fused),
                                  description=f"span {window}")

    def _decode_graphed(self, x, span, layers, encoder_kv, encoder_bias, incremental_state, search, alignment):
        """The new tokens of a search, one captured FeedbackLoop.step each; the
        search's static memory (`search`) is started at its first call and
        kept in the incremental state. With an `alignment`, the step also
        returns the alignment layer's weights, over the source positions of
        the graph's bucket."""
        loop = self.loop(layers, span, self.unfused_reason(layers, x.device.type))
        step = loop.step if alignment is None else functools.partial(aligned_step, loop.step, alignment)
        if search is None:
            search = self.graphed.decoding.start(x, span, encoder_kv, self.hypotheses_per_sentence(incremental_state),
                                                 loop.empty_memory)
            self.set_incremental_state(incremental_state, "static_memory", search)
        x, *weights = self.graphed.decoding.decode(
            step, x, span, search, encoder_kv, encoder_bias, loop.parameters(),
            graph_key=(span, tuple(layer is not None for layer in layers), loop.fused,
                       None if alignment is None else (alignment.layer, alignment.heads)),
            description=f"span {span}")
        if alignment is not None:
            alignment.extend(weights[0][..., : encoder_kv.size(4)])
        return x

    def train(self, mode: bool = True):
        if self.graphed is not None and mode != self.training:  # an epoch, or a validation, has ended
            self.graphed.log_statistics()
        return super().train(mode)

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor):
        super().reorder_incremental_state(incremental_state, new_order)
        if self.graphed is not None:
            self.graphed.reorder(self.get_incremental_state(incremental_state, "static_memory"), new_order)

    def loop(self, layers: Layers, span: int, unfused_reason: Optional[str]) -> FeedbackLoop:
        """The loop over `layers` reading the last `span` slots, fused unless
        there is an `unfused_reason` (said once)."""
        if unfused_reason is not None:
            self._log_unfused(unfused_reason)
        return FeedbackLoop(self.memory, layers, span, self.span, self.key_positions, fused=unfused_reason is None)

    def unfused_reason(self, layers: Layers, device_type: str,
                       buffer: Optional[KeyValueBuffer] = None) -> Optional[str]:
        """Why the loop runs these layers through autograd (ReferenceLoop,
        reference_step) rather than fused (None: fused): use_fused_block(False),
        or an option that the fused block does not cover (loop/fallback.py).
        `buffer`: the memory's slots, when resumed from a decoding cache."""
        if not self.fused_block_enabled:
            return "use_fused_block(False)"
        return fallback.unfused_reason(layers, device_type, buffer, self.unfused_options)

    def _log_unfused(self, reason: str) -> None:
        """Once per decoder and reason."""
        if reason not in self.unfused_reasons_said:
            self.unfused_reasons_said.add(reason)
            logger.info(f"feedback loop: {reason} runs step by step through autograd, not as one fused block "
                        "(the same numbers, more operators)")


def aligned_step(step, alignment: Alignment, *inputs):
    """FeedbackLoop.step, with the encoder attention weights that `alignment`
    asks for as a third output, [bsz, src_len]: a graph's outputs are what
    its function returns (each call collects into an Alignment of its own)."""
    weights = Alignment(alignment.layer, alignment.heads)
    return (*step(*inputs, alignment=weights), weights.weights()[0])
