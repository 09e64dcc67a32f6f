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
too: `feedback_loop` is the whole model, and every mode (training, streaming,
decoding) runs it from a memory that it starts or resumes.
"""

import logging
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..modules import fused_loop
from ..modules.memory_view import MemoryView, SlotDistances, with_positions
from ..modules.memory_decoder_layer import MemoryDecoderLayer
from ..modules.feedback_memory import FeedbackMemory
from ..modules.key_value_buffer import KeyValueBuffer
from .graphed_loop import GraphedFeedbackLoop
from .memory_decoder import IncrementalState, MemoryDecoder

logger = logging.getLogger(__name__)


class FeedbackDecoder(MemoryDecoder):
    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn, output_projection)
        heads = cfg.decoder.attention_heads
        self.memory = FeedbackMemory(
            self.embed_dim, self.num_layers, heads, cfg.head_dim or self.embed_dim // heads,
            shared_kv=not cfg.per_layer_kv, normalize_before=cfg.decoder.normalize_before,
            composition=cfg.memory_composition,
        )
        self.use_cuda_graphs("off" if cfg.no_cuda_graphs else str(cfg.cuda_graphs))
        self.unfused_reasons_said = set()  # _log_unfused says each once

    def use_cuda_graphs(self, mode: str) -> None:
        """How the loop runs (--cuda-graphs): "off" eagerly; "auto" as CUDA
        graphs on a GPU, eagerly elsewhere; "emulate" through the same path
        as on a GPU, with a stand-in for the CUDA calls, on any device
        (graphed_loop.py)."""
        self.graphed = None if mode == "off" else GraphedFeedbackLoop(mode)

    def decode(self, x, layers, encoder_kv, encoder_bias, incremental_state: Optional[IncrementalState] = None,
               stream_state: Optional[Dict[str, Tensor]] = None):
        """Starts the memory (from m_{-1}, or from the stream's carried memory
        vectors, projected again with the current weights as the official code
        and Transformer-XL do) or resumes it from the decoding cache, then runs
        the loop, eagerly or as CUDA graphs. A stream keeps its last `span`
        memory vectors, detached."""
        span = self.current_span()
        carried = None if stream_state is None else stream_state.get("memory")
        previous = carried if carried is not None else x.new_zeros(1, x.size(1), self.embed_dim)  # m_{-1}
        if self.graphed is None:
            x, memories = self.run_eagerly(x, previous, span, layers, encoder_kv, encoder_bias, incremental_state)
        else:
            x, memories = self.graphed.run(self, x, previous, span, layers, encoder_kv, encoder_bias,
                                           incremental_state)
        if stream_state is not None:
            stream_state["memory"] = torch.cat([previous, memories])[-self.span:].detach()
        return x

    def run_eagerly(self, x, previous, span, layers, encoder_kv, encoder_bias, incremental_state):
        """The loop from the decoding cache, or from the memory vectors
        `previous`: the top layer's outputs and the memory vectors."""
        buffer = self.memory.cached_keys_values(incremental_state)
        if buffer is None:
            buffer, window = self.start_memory(previous[-span:], len(x), span)
        else:
            window = buffer.window(span)
        x, memories = self.feedback_loop(x, buffer, window, span, layers, encoder_kv, encoder_bias)
        self.memory.cache_keys_values(incremental_state, buffer)
        return x, memories

    def train(self, mode: bool = True):
        if self.graphed is not None and mode != self.training:  # an epoch, or a validation, has ended
            self.graphed.log_statistics()
        return super().train(mode)

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor):
        super().reorder_incremental_state(incremental_state, new_order)
        if self.graphed is not None:
            self.graphed.reorder(self, incremental_state, new_order)

    # --- what the loop's runners share: the eager loop, and the CUDA graphs ---------------------

    def loop_parameters(self) -> List[nn.Parameter]:
        """Every parameter the loop reads."""
        return [*self.memory.parameters(), *self.layers.parameters(),
                *([] if self.key_positions is None else [self.key_positions])]

    def loop_modules(self, layers: List[Optional[MemoryDecoderLayer]]) -> List[nn.Module]:
        return [*self.memory.modules(), *(m for layer in layers if layer is not None for m in layer.modules())]

    def empty_memory(self, rows: int, like: Tensor) -> Tensor:
        """The keys and values of m_{-1}, the zero memory vector, in `rows`
        rows: [1, planes, rows, heads, head_dim]."""
        return self.memory.project(like.new_zeros(1, rows, self.embed_dim))

    def start_memory(self, initial: Tensor, steps: int, span: int) -> Tuple[KeyValueBuffer, Tuple[Tensor, ...]]:
        """A buffer for `steps` steps after the memory vectors `initial`, and
        the window of their keys and values that step 0 reads."""
        kv = self.memory.project(initial)
        buffer = KeyValueBuffer.empty(len(kv) + steps, like=kv)
        return buffer, buffer.append(kv, span)

    def feedback_loop(self, x: Tensor, buffer: KeyValueBuffer, window: Tuple[Tensor, ...], span: int,
                      layers: List[Optional[MemoryDecoderLayer]], encoder_kv: Optional[Tensor],
                      encoder_bias: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """Section 3.3, one step at a time. `window`: the memory's keys and
        values that step 0 reads; each step appends the keys and values of its
        memory vector to `buffer`. Returns the top layer's outputs and the
        memory vectors m_t, both [time, batch, embed]. The block runs as one
        fused autograd Function (modules/fused_loop.py); options it does not
        cover, step by step through autograd, below."""
        # everything that does not depend on the step, once: a full window
        # holds m_{t-span} .. m_{t-1}, all visible; shorter ones its last slots
        weights = self.memory.mixing_weights()
        full_window = SlotDistances(torch.arange(span, 0, -1, device=x.device)[None], 1, span, self.span)
        span_masks = [None if layer is None else layer.self_attn.span_mask for layer in layers]
        span_biases = [None if mask is None else full_window.span_bias(mask) for mask in span_masks]
        positions = None if self.key_positions is None else full_window.positions(self.key_positions)[0]
        why_not = self.unfused_reason(layers, x.device.type, buffer)
        if why_not is None:
            loop = fused_loop.FusedFeedbackLoop(self, buffer, window, span, layers, positions, span_biases, weights)
            return loop(x, encoder_kv, encoder_bias)
        self._log_unfused(why_not)
        persistent = self.persistent_vectors(layers)
        encoder_kv = self.per_layer(encoder_kv, len(layers))
        outputs, memories = [], []
        for h in x.unbind(0):  # not x[t]: each index's backward fills a gradient of all of x
            views = self.memory_views(window, positions, span_biases, persistent)
            h, m = self.feedback_step(h, views, layers, encoder_kv, encoder_bias, weights)
            window = buffer.append(self.memory.project(m.unsqueeze(0)), span)
            outputs.append(h)
            memories.append(m)
        return torch.stack(outputs), torch.stack(memories)

    def decoding_step(self, x: Tensor, window: Tuple[Tensor, ...], distance: Tensor, span: int,
                      layers: List[Optional[MemoryDecoderLayer]], encoder_kv: Optional[Tensor],
                      encoder_bias: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """One step over a window of slots that lie `distance` steps back
        (a ring of fixed shape, for CUDA graphs: static_memory.py), those
        out of span masked: the top layer's output, and the keys and values
        of m_t [1, planes, rows, heads, head_dim]."""
        slots = SlotDistances(distance[None], 1, span, self.span)
        positions = None if self.key_positions is None else slots.positions(self.key_positions)[0]
        biases = [slots.bias(None if layer is None else layer.self_attn.span_mask, x) for layer in layers]
        views = self.memory_views(window, positions, biases, self.persistent_vectors(layers))
        encoder_kv, weights = self.per_layer(encoder_kv, len(layers)), self.memory.mixing_weights()
        if torch.is_grad_enabled() or self.training or fused_loop.unsupported(layers, False, x.device.type):
            h, m = self.feedback_step(x, views, layers, encoder_kv, encoder_bias, weights)
        else:  # a search's step: the fused block's layers, with no dropout and nothing kept for a backward
            h, states = fused_loop.step(x, views, layers, encoder_kv, encoder_bias)
            m = self.memory(states, weights)
        return h, self.memory.project(m.unsqueeze(0))

    def memory_views(self, window: Tuple[Tensor, ...], positions: Optional[Tensor], biases: List[Optional[Tensor]],
                     persistent: List) -> List[MemoryView]:
        """What each layer reads at one step: keys (with relative positions,
        `positions` [slots, head_dim] of a full window) and values of the
        memory's window, its bias (of a full window: the last slots are
        kept) and its persistent vectors."""
        return [MemoryView(keys, values, None if bias is None else bias[..., -keys.size(2):], vectors)
                for (keys, values), bias, vectors in zip(
                    self.memory.layer_keys_values(window, lambda k: with_positions(k, positions)), biases, persistent)]

    @staticmethod
    def persistent_vectors(layers: List[Optional[MemoryDecoderLayer]]) -> List:
        return [None if layer is None else layer.self_attn.persistent() for layer in layers]

    def feedback_step(self, h: Tensor, views: List[MemoryView], layers: List[Optional[MemoryDecoderLayer]],
                      encoder_kv: List[Optional[Tensor]], encoder_bias: Optional[Tensor], weights: Tensor):
        """One step t through every layer, each reading its view of the
        memory: x_t^{l+1} = Layer_l(x_t^l, memory). Returns the top layer's
        output and the step's memory vector m_t (eq. 1)."""
        states = [h]
        for layer, view, kv in zip(layers, views, encoder_kv):
            if layer is not None:
                h = layer.forward_memory(h, view, kv, encoder_bias)
            states.append(h)  # a left-out layer passes its input on
        return h, self.memory(states, weights)

    def unfused_reason(self, layers: List[Optional[MemoryDecoderLayer]], device_type: str,
                       buffer: Optional[KeyValueBuffer] = None) -> Optional[str]:
        """Why feedback_loop runs these layers step by step through autograd
        rather than as one fused block (None: fused)."""
        grad = torch.is_grad_enabled()
        if grad and buffer is not None and buffer.resumed:
            return "gradients through a decoding cache"
        return fused_loop.unsupported(layers, grad, device_type)

    def _log_unfused(self, reason: str) -> None:
        """Once per decoder and reason."""
        if reason not in self.unfused_reasons_said:
            self.unfused_reasons_said.add(reason)
            logger.info(f"feedback loop: {reason} runs step by step through autograd, not as one fused block "
                        "(the same numbers, more operators)")
