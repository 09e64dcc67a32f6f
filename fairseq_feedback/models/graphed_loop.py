"""The feedback loop at bounded shapes, replayed as CUDA graphs.

A CUDA graph replays fixed shapes, and fairseq's batches vary in rows and
lengths. So a block is padded up to a bucket: time steps at the end (the
loop is causal: later steps change nothing before them), rows (rows never
mix), and source positions (masked out of encoder attention). Padding's
outputs are cut off before anything reads them, so its gradients are zero
and it changes no loss or gradient. One graph per bucket (and per span,
kept layers, dtype, training or not) is captured at its first use and kept
in a bounded cache on one memory pool.

Decoding replays one captured step per token over a StaticMemory (a ring of
fixed shape, masked by distance) per bucket of rows and capacity, kept from
one search to the next so that graphs are reused; beam search reorders it
in place, and moves to a smaller bucket as sentences finish.

What differs from the eager loop is only where shapes come from; the loop
and its step are FeedbackDecoder's. Without capture (CPU tests) the same
padding and bookkeeping run them eagerly.
"""

from collections import OrderedDict
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import FeedbackUsageError
from ..modules.block_weight_gradients import weight_gradients_per_block
from ..modules.cuda_graphs import GraphCache
from ..modules.feedback_attention import MemoryView
from ..modules.static_memory import StaticMemory

# A cached graph holds its parameter gradients and outputs; at base sizes in
# fp16, about 50 MB each. Decoding's static memories and encoder buffers are
# kept for the last few buckets (a beam of 128 sentences: tens of MB each).
CACHED_GRAPHS = 64
CACHED_DECODING_BUFFERS = 8
NO_ENCODER = [None, None, None]  # a language model's "encoder buffers"


def bucket(n: int) -> int:
    """n rounded up to a multiple of 8, or from 128 on of a sixteenth of the
    power of two below it: less than 8 or n/8 of padding, few buckets."""
    step = max(8, 2 ** (n.bit_length() - 4))
    return -(-n // step) * step


class GraphedFeedbackLoop:
    def __init__(self, capture: bool):
        self.capture = capture
        self.cache = GraphCache(CACHED_GRAPHS, capture, name="feedback loop")
        self.memories: "OrderedDict[tuple, StaticMemory]" = OrderedDict()  # decoding: by rows, capacity, dtype
        # decoding: the encoder's static keys/values and mask, and the search's tensor they were copied from
        self.encoders: "OrderedDict[tuple, List[Optional[Tensor]]]" = OrderedDict()
        self.searches = 0
        self.serving = (0, None)  # (search, key of its static memory): one search at a time

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
            # in a graph kernels cost and Python does not: the linear layers'
            # weight gradients once per block
            with weight_gradients_per_block([*decoder.memory.modules(),
                                             *(m for layer in layers if layer is not None for m in layer.modules())]):
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

    # --- decoding -------------------------------------------------------------------------------

    def decode(self, decoder, x: Tensor, span: int, layers: List, encoder_kv: Optional[Tensor],
               encoder_bias: Optional[Tensor], incremental_state, hypotheses: int) -> Tensor:
        """fairseq's incremental decoding of the new tokens x [time, rows,
        embed], one captured step each; returns the top layer's outputs."""
        state = decoder.get_incremental_state(incremental_state, "static_memory")
        if state is None:
            state = self._start(decoder, x, span, hypotheses)
            decoder.set_incremental_state(incremental_state, "static_memory", state)
        rows = int(state["rows"])
        parameters = tuple(p.data_ptr() for p in decoder.parameters())  # moved or converted: the graphs are stale
        outputs = []
        for h in x.unbind(0):
            memory = self._memory(state)
            if int(state["steps"]) + 1 >= memory.capacity < span + 1:  # grow before the ring would wrap
                bigger = self._take(state, memory.rows, min(2 * memory.capacity, span + 1), decoder, h.dtype)
                memory.copy_to(bigger, torch.arange(rows, device=h.device), int(state["steps"]))
                memory = bigger
            encoder = self._static_encoder(encoder_kv, encoder_bias, memory.rows // hypotheses)
            key = ("decode", id(memory), id(encoder), span, tuple(layer is not None for layer in layers),
                   torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None, parameters)

            def step(x, memory=memory, encoder=encoder):
                return (self._step(decoder, memory, x, span, layers, encoder[0], encoder[1]),)

            (out,) = self.cache(key, step, [F.pad(h, (0, 0, 0, memory.rows - rows))],
                                state=[memory.slots, memory.slot_steps, memory.step])
            outputs.append(out[:rows])
            state["steps"] += 1
        return torch.stack(outputs)

    @staticmethod
    def _step(decoder, memory: StaticMemory, x: Tensor, span: int, layers: List, encoder_kv, encoder_bias):
        """FeedbackDecoder.feedback_step at step t over every slot of the
        memory, those out of span masked; then m_t joins the memory."""
        window, distance = memory.read()
        visible = (distance >= 1) & (distance <= span)
        bias = x.new_zeros(distance.shape).masked_fill(~visible, float("-inf"))
        span_row = (span - distance).clamp(0, span - 1)  # the adaptive span's mask, as its window's slots
        if decoder.key_positions is None:
            with_positions = None
        else:
            position_row = (decoder.span - distance).clamp(0, decoder.span - 1)
            with_positions = decoder.key_positions[position_row]
        views = []
        for (keys, values), layer in zip(
                decoder.memory.layer_keys_values(window, lambda k: k if with_positions is None else k + with_positions),
                layers):
            mask = None if layer is None else layer.self_attn.span_mask
            layer_bias = bias if mask is None else bias + mask.bias(span)[..., span_row]
            views.append(MemoryView(keys, values, layer_bias, None if layer is None else layer.self_attn.persistent()))
        h, m = decoder.feedback_step(x, views, layers, decoder.per_layer(encoder_kv, len(layers)), encoder_bias,
                                     decoder.memory.mixing_weights())
        memory.write(decoder.memory.project(m.unsqueeze(0)))
        return h

    def _start(self, decoder, x: Tensor, span: int, hypotheses: int):
        """A new search: a static memory holding m_{-1}, in the bucket of its rows."""
        self.searches += 1
        steps, rows, _ = x.shape
        state = {"search": torch.tensor(self.searches), "rows": torch.tensor(rows), "steps": torch.tensor(0)}
        capacity = min(max(16, 2 ** steps.bit_length()), span + 1)
        memory = self._take(state, bucket(rows // hypotheses) * hypotheses, capacity, decoder, x.dtype)
        memory.start(decoder.memory.project(x.new_zeros(1, memory.rows, decoder.embed_dim)))
        return state

    def _take(self, state, rows: int, capacity: int, decoder, dtype) -> StaticMemory:
        """The static memory of this bucket, for the search `state` from now on."""
        key = (rows, capacity, dtype)
        mem = decoder.memory
        like = torch.empty(1, mem.planes, rows, mem.num_heads, mem.head_dim, dtype=dtype, device=mem.kv_proj.weight.device)
        self.serving = (int(state["search"]), key)
        return self._kept(self.memories, key, lambda: StaticMemory(capacity, like))

    def _memory(self, state) -> StaticMemory:
        search, key = self.serving
        if search != int(state["search"]):
            raise FeedbackUsageError(
                "two searches interleaved on one model decoding with CUDA graphs; finish one before starting "
                "the next, or decode eagerly: --model-overrides \"{'no_cuda_graphs': True}\"")
        return self.memories[key]

    def reorder(self, incremental_state, decoder, new_order: Tensor, hypotheses: int) -> None:
        """Beam search's new order of the rows, in place, in the bucket of
        the rows left (a smaller one once sentences have finished)."""
        state = decoder.get_incremental_state(incremental_state, "static_memory")
        if state is None:
            return
        memory = self._memory(state)
        rows = bucket(len(new_order) // hypotheses) * hypotheses
        target = memory if rows == memory.rows else self._take(state, rows, memory.capacity, decoder,
                                                               memory.slots.dtype)
        memory.copy_to(target, new_order, int(state["steps"]))
        state["rows"] = torch.tensor(len(new_order))

    def _static_encoder(self, encoder_kv, encoder_bias, sentences: int):
        """The encoder's keys/values and mask in buffers of the bucket's
        shape, copied when the search's own change (a new search, finished
        sentences): padded rows see zero keys, padded positions are masked."""
        if encoder_kv is None:
            return NO_ENCODER
        layers, _, real, heads, src_len, head_dim = encoder_kv.shape
        padded_len = bucket(src_len)
        static = self._kept(self.encoders, (sentences, padded_len, encoder_kv.dtype), lambda: [
            encoder_kv.new_zeros(layers, 2, sentences, heads, padded_len, head_dim),
            encoder_kv.new_zeros(sentences, 1, 1, padded_len), None])
        if static[2] is not encoder_kv:
            kv, bias = static[:2]
            kv.zero_()
            kv[:, :, :real, :, :src_len] = encoder_kv
            bias.zero_()
            bias[:real, ..., src_len:] = float("-inf")
            if encoder_bias is not None:
                bias[:real, ..., :src_len] = encoder_bias
            static[2] = encoder_kv
        return static

    def _kept(self, buffers: OrderedDict, key, make):
        """buffers[key], made if missing; past CACHED_DECODING_BUFFERS the least
        recently used goes, with the graphs that were captured over it."""
        if key not in buffers:
            if len(buffers) >= CACHED_DECODING_BUFFERS:
                _, dropped = buffers.popitem(last=False)
                self.cache.forget(lambda graph_key: id(dropped) in graph_key)
            buffers[key] = make()
        buffers.move_to_end(key)
        return buffers[key]
