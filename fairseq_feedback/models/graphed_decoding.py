"""Decoding with CUDA graphs: one captured step per token.

fairseq's incremental decoding feeds one token per call, at a position that
grows, over rows that beam search reorders and drops. A captured graph
replays fixed shapes, so the memory's keys and values live in a
StaticMemory (a ring of fixed shape, masked by distance) per bucket of rows
and capacity, kept from one search to the next so that graphs are reused;
beam search reorders it in place, and moves to a smaller bucket as sentences
finish. The encoder's keys and values are copied into buffers of the
bucket's shape. The step is FeedbackDecoder.feedback_step, over every slot.
"""

from collections import OrderedDict
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import FeedbackUsageError
from ..modules.cuda_graphs import GraphCache, bucket_wide
from ..modules.memory_view import MemoryView, SlotDistances
from ..modules.static_memory import StaticMemory

# Static memories and encoder buffers are kept for the last few buckets (a
# beam of 128 sentences: tens of MB each).
CACHED_DECODING_BUFFERS = 8
NO_ENCODER = [None, None, None]  # a language model's "encoder buffers"


class GraphedDecoding:
    def __init__(self, cache: GraphCache):
        self.cache = cache
        self.memories: "OrderedDict[tuple, StaticMemory]" = OrderedDict()  # by rows, capacity, dtype
        # the encoder's static keys/values and mask, and the search's tensor they were copied from
        self.encoders: "OrderedDict[tuple, List[Optional[Tensor]]]" = OrderedDict()
        self.searches = 0
        self.serving = (0, None)  # (search, key of its static memory): one search at a time

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
            autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
            key = ("decode", id(memory), id(encoder), span, tuple(layer is not None for layer in layers), autocast,
                   parameters)
            shape = (f"decoding {memory.rows} rows, {memory.capacity} memory slots"
                     + ("" if encoder[0] is None else f", {encoder[0].size(4)} source positions")
                     + f", span {span}, {h.dtype}{', autocast' if autocast else ''}")

            def step(x, memory=memory, encoder=encoder):
                return (self._step(decoder, memory, x, span, layers, encoder[0], encoder[1]),)

            (out,) = self.cache(key, step, [F.pad(h, (0, 0, 0, memory.rows - rows))],
                                state=[memory.slots, memory.slot_steps, memory.step], shape=shape)
            outputs.append(out[:rows])
            state["steps"] += 1
        return torch.stack(outputs)

    @staticmethod
    def _step(decoder, memory: StaticMemory, x: Tensor, span: int, layers: List, encoder_kv, encoder_bias):
        """FeedbackDecoder.feedback_step at step t over every slot of the
        memory, those out of span masked; then m_t joins the memory."""
        window, distance = memory.read()
        slots = SlotDistances(distance[None], 1, span, decoder.span)
        positions = None if decoder.key_positions is None else slots.positions(decoder.key_positions)
        views = []
        for (keys, values), layer in zip(
                decoder.memory.layer_keys_values(window, lambda k: k if positions is None else k + positions), layers):
            mask = None if layer is None else layer.self_attn.span_mask
            views.append(MemoryView(keys, values, slots.bias(mask, x),
                                    None if layer is None else layer.self_attn.persistent()))
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
        memory = self._take(state, bucket_wide(rows // hypotheses) * hypotheses, capacity, decoder, x.dtype)
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
                "the next, or decode eagerly: --model-overrides \"{'cuda_graphs': 'off'}\"")
        return self.memories[key]

    def reorder(self, incremental_state, decoder, new_order: Tensor, hypotheses: int) -> None:
        """Beam search's new order of the rows, in place, in the bucket of
        the rows left (a smaller one once sentences have finished)."""
        state = decoder.get_incremental_state(incremental_state, "static_memory")
        if state is None:
            return
        memory = self._memory(state)
        rows = bucket_wide(len(new_order) // hypotheses) * hypotheses
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
        padded_len = bucket_wide(src_len)
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
