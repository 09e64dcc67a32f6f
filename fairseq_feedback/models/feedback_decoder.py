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
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..loop import fallback
from ..loop.fused_block import FusedFeedbackLoop, fused_step
from ..loop.reference import ReferenceLoop, memory_views, persistent_vectors, reference_step
from ..modules.memory_view import SlotDistances
from ..modules.memory_decoder_layer import MemoryDecoderLayer, per_layer
from ..modules.feedback_memory import FeedbackMemory
from ..modules.key_value_buffer import KeyValueBuffer
from ..loop.graphed_loop import GraphedFeedbackLoop
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
        self.use_fused_block(True)
        self.loop_hooks: Dict[int, Callable] = OrderedDict()
        self.unfused_reasons_said = set()  # _log_unfused says each once

    def use_cuda_graphs(self, mode: str) -> None:
        """How the loop runs (--cuda-graphs): "off" eagerly; "auto" as CUDA
        graphs on a GPU, eagerly elsewhere; "emulate" through the same path
        as on a GPU, with a stand-in for the CUDA calls, on any device
        (loop/graphed_loop.py)."""
        self.graphed = None if mode == "off" else GraphedFeedbackLoop(mode)

    def use_fused_block(self, use: bool) -> None:
        """Which loop runs the options that the fused block covers: the
        fused block (loop/fused_block.py; the default), or the reference
        loop step by step through autograd (loop/reference.py), the same
        outputs and gradients in more operators."""
        self.fused_block_enabled = use

    def register_loop_hook(self, hook: Callable) -> RemovableHandle:
        """hook(runner), called after each block of feedback_loop and each
        decoding_step with what ran it: the block's FusedFeedbackLoop (its
        dropout masks, what it recorded: see there) or ReferenceLoop, or the
        step's function, fused_step or reference_step. The handle's
        remove() takes the hook away, as for nn.Module's hooks."""
        handle = RemovableHandle(self.loop_hooks)
        self.loop_hooks[handle.id] = hook
        return handle

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
        fused autograd Function (loop/fused_block.py); options it does not
        cover, step by step through autograd (loop/reference.py)."""
        # everything that does not depend on the step, once: a full window
        # holds m_{t-span} .. m_{t-1}, all visible; shorter ones its last slots
        weights = self.memory.mixing_weights()
        full_window = SlotDistances(torch.arange(span, 0, -1, device=x.device)[None], 1, span, self.span)
        span_masks = [None if layer is None else layer.self_attn.span_mask for layer in layers]
        span_biases = [None if mask is None else full_window.span_bias(mask) for mask in span_masks]
        positions = None if self.key_positions is None else full_window.positions(self.key_positions)[0]
        why_not = self.unfused_reason(layers, x.device.type, buffer)
        if why_not is not None:
            self._log_unfused(why_not)
        loop = (FusedFeedbackLoop if why_not is None else ReferenceLoop)(
            self.memory, layers, buffer, window, span, positions, span_biases, weights)
        outputs, memories = loop(x, encoder_kv, encoder_bias)
        self._ran(loop)
        return outputs, memories

    def decoding_step(self, x: Tensor, window: Tuple[Tensor, ...], distance: Tensor, span: int,
                      layers: List[Optional[MemoryDecoderLayer]], encoder_kv: Optional[Tensor],
                      encoder_bias: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """One step over a window of slots that lie `distance` steps back
        (a ring of fixed shape, for CUDA graphs: loop/static_memory.py), those
        out of span masked: the top layer's output, and the keys and values
        of m_t [1, planes, rows, heads, head_dim]. A search's step runs the
        fused layers, which keep nothing for a backward and draw no dropout."""
        slots = SlotDistances(distance[None], 1, span, self.span)
        positions = None if self.key_positions is None else slots.positions(self.key_positions)[0]
        biases = [slots.bias(None if layer is None else layer.self_attn.span_mask, x) for layer in layers]
        views = memory_views(self.memory, window, positions, biases, persistent_vectors(layers))
        searching = not (torch.is_grad_enabled() or self.training)
        step = fused_step if searching and self.unfused_reason(layers, x.device.type) is None else reference_step
        h, m = step(x, views, layers, per_layer(encoder_kv, len(layers)), encoder_bias, self.memory,
                    self.memory.mixing_weights())
        self._ran(step)
        return h, self.memory.project(m.unsqueeze(0))

    def unfused_reason(self, layers: List[Optional[MemoryDecoderLayer]], device_type: str,
                       buffer: Optional[KeyValueBuffer] = None) -> Optional[str]:
        """Why the loop runs these layers through autograd (ReferenceLoop,
        reference_step) rather than fused (None: fused): use_fused_block(False),
        or an option that the fused block does not cover (loop/fallback.py).
        `buffer`: the memory's slots, when resumed from a decoding cache."""
        if not self.fused_block_enabled:
            return "use_fused_block(False)"
        return fallback.unfused_reason(layers, device_type, buffer)

    def _ran(self, runner) -> None:
        for hook in self.loop_hooks.values():
            hook(runner)

    def _log_unfused(self, reason: str) -> None:
        """Once per decoder and reason."""
        if reason not in self.unfused_reasons_said:
            self.unfused_reasons_said.add(reason)
            logger.info(f"feedback loop: {reason} runs step by step through autograd, not as one fused block "
                        "(the same numbers, more operators)")
