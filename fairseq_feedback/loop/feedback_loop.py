"""The feedback loop of one decoder call, as functions of tensors.

The decoder builds a FeedbackLoop at each call from what the loop runs:
its FeedbackMemory, the layers of this pass, the relative positions, the
span, and which loop (fused or through autograd) covers the options. It
runs it eagerly (`block`), or hands its functions to the CUDA graphs
(graphed_loop.py: `block_from`; graphed_decoding.py: `step`), which
capture them as torch.cuda.make_graphed_callables captures a callable.

A captured function lives as long as its graph, and its graph as long as
the cache that the decoder owns: so a FeedbackLoop holds the modules it
runs, never the decoder, so that nothing of a graph leads back to its cache.
"""

import contextlib
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..modules.feedback_attention import Alignment
from ..modules.feedback_memory import FeedbackMemory
from ..modules.key_value_buffer import KeyValueBuffer
from ..modules.memory_decoder_layer import MemoryDecoderLayer, per_layer
from ..modules.memory_view import SlotDistances
from .block_weight_gradients import weight_gradients_per_block
from .fused_block import FusedFeedbackLoop, fused_step
from .passes import Passes, PassesLoop
from .reference import ReferenceLoop, memory_views, persistent_vectors, reference_step

Layers = Sequence[Optional[MemoryDecoderLayer]]  # None where LayerDrop left a layer out


class FeedbackLoop:
    """The loop of one decoder call.

    Args:
        memory: the decoder's FeedbackMemory (eq. 1, the key/value projection).
        layers: the layers of this pass, None where LayerDrop left one out.
        span: how many of the last slots a step reads.
        memory_span: --memory-span, the rows of the tables read by distance
            (relative positions, adaptive spans); span <= memory_span.
        key_positions: the relative positions [memory_span, head_dim], or None.
        fused: whether the fused block (fused_block.py) runs it, or the
            reference loop through autograd (reference.py; fallback.py says why).
    """

    def __init__(self, memory: FeedbackMemory, layers: Layers, span: int, memory_span: int,
                 key_positions: Optional[nn.Parameter], fused: bool):
        self.memory, self.layers, self.span, self.memory_span = memory, list(layers), span, memory_span
        self.key_positions, self.fused = key_positions, fused

    def parameters(self) -> List[nn.Parameter]:
        """Every parameter the loop reads."""
        layers = [layer for layer in self.layers if layer is not None]
        return [*self.memory.parameters(), *(p for layer in layers for p in layer.parameters()),
                *([] if self.key_positions is None else [self.key_positions])]

    def modules(self) -> List[nn.Module]:
        return [*self.memory.modules(), *(m for layer in self.layers if layer is not None for m in layer.modules())]

    def empty_memory(self, bsz: int, like: Tensor) -> Tensor:
        """The keys and values of m_{-1}, the zero memory vector, in `bsz`
        rows (dtype and device `like`'s): [1, planes, bsz, num_heads, head_dim]."""
        return self.memory.project(like.new_zeros(1, self.memory.memories, bsz, self.memory.kv_proj.in_features))

    def start(self, initial: Tensor, tgt_len: int) -> Tuple[KeyValueBuffer, Tuple[Tensor, ...]]:
        """A memory started from the memory vectors `initial`.

        Args:
            initial: the memory vectors before step 0, [slots, memories, bsz, embed_dim].
            tgt_len: the steps the buffer will take after them.

        Returns:
            a KeyValueBuffer holding their keys and values, and the window of
            them that step 0 reads (one [bsz, num_heads, slots, head_dim] view per plane).
        """
        kv = self.memory.project(initial)
        buffer = KeyValueBuffer.empty(len(kv) + tgt_len, like=kv)
        return buffer, buffer.append(kv, self.span)

    def block(self, x: Tensor, buffer: KeyValueBuffer, window: Tuple[Tensor, ...], encoder_kv: Optional[Tensor],
              encoder_bias: Optional[Tensor], alignment: Optional[Alignment] = None) -> Tuple[Tensor, Tensor]:
        """Section 3.3, one step at a time.

        Args:
            x: the first layer's inputs, [tgt_len, bsz, embed_dim].
            buffer: the memory's keys and values; each step appends its
                memory vector's.
            window: what step 0 reads of them, one [bsz, num_heads, slots,
                head_dim] view per plane.
            encoder_kv: every layer's encoder keys and values,
                [layers, 2, sentences, num_heads, src_len, head_dim], or None.
            encoder_bias: their padding mask as a bias, [sentences, 1, 1, src_len], or None.
            alignment: where fairseq's alignment layer puts its encoder
                attention's weights (decoding), or None.

        Returns:
            the top layer's outputs [tgt_len, bsz, embed_dim] and the memory
            vectors m_t [tgt_len, memories, bsz, embed_dim].
        """
        # everything that does not depend on the step, once: a full window
        # holds m_{t-span} .. m_{t-1}, all visible; shorter ones its last slots
        span = self.span
        weights = self.memory.mixing_weights()
        full_window = SlotDistances(torch.arange(span, 0, -1, device=x.device)[None], 1, span, self.memory_span)
        span_masks = [None if layer is None else layer.self_attn.span_mask for layer in self.layers]
        span_biases = [None if mask is None else full_window.span_bias(mask) for mask in span_masks]
        positions = None if self.key_positions is None else full_window.positions(self.key_positions)[0]
        loop = (FusedFeedbackLoop if self.fused else ReferenceLoop)(
            self.memory, self.layers, buffer, window, span, positions, span_biases, weights, alignment)
        return loop(x, encoder_kv, encoder_bias)

    def block_in_passes(self, x: Tensor, buffer: KeyValueBuffer, window: Tuple[Tensor, ...],
                        encoder_kv: Optional[Tensor], encoder_bias: Optional[Tensor],
                        passes: Passes) -> Tuple[Tensor, Tensor]:
        """`block`, its positions a group at a time in passes (passes.py):
        exact where the passes reach, training's approximation elsewhere.

        Args and returns: as `block` takes and returns them, and how the
        block runs in passes (Passes).
        """
        loop = PassesLoop(self.memory, self.layers, buffer, window, self.span, self.memory_span, self.key_positions,
                          self.memory.mixing_weights(), passes)
        return loop(x, encoder_kv, encoder_bias)

    def block_from(self, x: Tensor, initial: Tensor, encoder_kv: Optional[Tensor], encoder_bias: Optional[Tensor],
                   *parameters: Tensor) -> Tuple[Tensor, Tensor]:
        """`block` over a memory started from memory vectors: a function of
        tensors alone, which a CUDA graph captures.

        Args:
            x, encoder_kv, encoder_bias: as `block` takes them.
            initial: the memory vectors before step 0, [slots, memories, bsz, embed_dim].
            parameters: read in place of parameters(), in its order (the
                aliases that a CUDA graph takes gradients with respect to).

        Returns:
            the top layer's outputs and the memory vectors, as `block`
            returns them; the memory vectors detached (a stream carries them
            without a backward).
        """
        with self.reading(parameters):
            buffer, window = self.start(initial, len(x))
            # in a graph kernels cost and Python does not: the loop through
            # autograd takes the linear layers' weight gradients once per block
            # too (the fused block does by itself)
            per_block = contextlib.nullcontext() if self.fused else weight_gradients_per_block(self.modules())
            with per_block:
                outputs, memories = self.block(x, buffer, window, encoder_kv, encoder_bias)
        return outputs, memories.detach()

    @contextlib.contextmanager
    def reading(self, tensors: Sequence[Tensor]) -> Iterator[None]:
        """The loop's modules (and its key positions) read `tensors` in place
        of parameters(), in its order, as torch.func.functional_call has a
        module read the tensors it is given."""
        replaced = {id(p): t for p, t in zip(self.parameters(), tensors)}
        swapped = [(module, name, p) for module in self.modules() for name, p in module._parameters.items()
                   if p is not None and id(p) in replaced]
        key_positions = self.key_positions
        for module, name, p in swapped:
            module._parameters[name] = replaced[id(p)]
        if key_positions is not None:
            self.key_positions = replaced.get(id(key_positions), key_positions)
        try:
            yield
        finally:
            for module, name, p in swapped:
                module._parameters[name] = p
            self.key_positions = key_positions

    def step(self, x: Tensor, window: Tuple[Tensor, ...], distance: Tensor, encoder_kv: Optional[Tensor],
             encoder_bias: Optional[Tensor], alignment: Optional[Alignment] = None) -> Tuple[Tensor, Tensor]:
        """One step over slots of a ring of fixed shape (CUDA graphs:
        static_memory.py), those out of span masked. A search's step runs the
        fused layers, which keep nothing for a backward and draw no dropout.

        Args:
            x: the step's inputs, [bsz, embed_dim].
            window: every slot, one [bsz, num_heads, slots, head_dim] view per plane.
            distance: how many steps back each slot lies, [slots].
            encoder_kv, encoder_bias, alignment: as `block` takes them.

        Returns:
            the top layer's output [bsz, embed_dim], and the keys and values of
            m_t, [1, planes, bsz, num_heads, head_dim].
        """
        slots = SlotDistances(distance[None], 1, self.span, self.memory_span)
        positions = None if self.key_positions is None else slots.positions(self.key_positions)[0]
        biases = [slots.bias(None if layer is None else layer.self_attn.span_mask, x) for layer in self.layers]
        views = memory_views(self.memory, window, positions, biases, persistent_vectors(self.layers))
        searching = not (torch.is_grad_enabled() or self.memory.training)
        step = fused_step if searching and self.fused else reference_step
        h, m = step(x, views, self.layers, per_layer(encoder_kv, len(self.layers)), encoder_bias, self.memory,
                    self.memory.mixing_weights(), alignment)
        return h, self.memory.project(m.unsqueeze(0))
