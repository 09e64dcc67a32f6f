"""Decoding with CUDA graphs: one captured step per token.

fairseq's incremental decoding feeds one token per call, at a position that
grows, over rows that beam search reorders and drops. A captured graph
replays fixed shapes, so the memory's keys and values live in a
StaticMemory (a ring of fixed shape, masked by distance) per bucket of rows
and capacity, kept from one search to the next so that graphs are reused;
beam search reorders it in place, and moves to a smaller bucket as sentences
finish. The encoder's keys and values are copied into buffers of the
bucket's shape. The step is FeedbackDecoder.decoding_step, over every slot.
"""

from collections import OrderedDict
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import FeedbackUsageError
from ..modules.cuda_graphs import GraphCache, autocast_dtype, bucket_wide
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

    def serves(self, decoder, incremental_state) -> bool:
        """Whether this search runs over a static memory (it started here)."""
        return decoder.get_incremental_state(incremental_state, "static_memory") is not None

    def decode(self, decoder, x: Tensor, span: int, layers: List, encoder_kv: Optional[Tensor],
               encoder_bias: Optional[Tensor], incremental_state) -> Tensor:
        """fairseq's incremental decoding of the new tokens x [time, rows,
        embed], one captured step each; returns the top layer's outputs."""
        state = decoder.get_incremental_state(incremental_state, "static_memory")
        if state is None:
            state = self._start(decoder, x, span, decoder.hypotheses_per_sentence(incremental_state))
            decoder.set_incremental_state(incremental_state, "static_memory", state)
        rows, hypotheses = int(state["rows"]), int(state["hypotheses"])
        parameters = tuple(p.data_ptr() for p in decoder.parameters())  # moved or converted: the graphs are stale
        autocast = autocast_dtype(x.device.type)
        outputs = []
        for h in x.unbind(0):
            memory = self._memory(state)
            if int(state["steps"]) + 1 >= memory.capacity < span + 1:  # grow before the ring would wrap
                bigger = self._take(state, memory.rows, min(2 * memory.capacity, span + 1), like=memory.slots)
                memory.copy_to(bigger, torch.arange(rows, device=h.device), int(state["steps"]))
                memory = bigger
            encoder = self._static_encoder(encoder_kv, encoder_bias, memory.rows // hypotheses)
            key = ("decode", id(memory), id(encoder), span, tuple(layer is not None for layer in layers), autocast,
                   parameters)
            shape = (f"decoding {memory.rows} rows, {memory.capacity} memory slots"
                     + ("" if encoder[0] is None else f", {encoder[0].size(4)} source positions")
                     + f", span {span}, {h.dtype}{', autocast' if autocast else ''}")

            def step(x, memory=memory, encoder=encoder):
                """FeedbackDecoder.decoding_step at step t over every slot; then m_t joins the memory."""
                window, distance = memory.read()
                out, kv = decoder.decoding_step(x, window, distance, span, layers, encoder[0], encoder[1])
                memory.write(kv)
                return (out,)

            (out,) = self.cache(key, step, [F.pad(h, (0, 0, 0, memory.rows - rows))],
                                state=[memory.slots, memory.slot_steps, memory.step], shape=shape)
            outputs.append(out[:rows])
            state["steps"] += 1
        return torch.stack(outputs)

    def _start(self, decoder, x: Tensor, span: int, hypotheses: int):
        """A new search: a static memory holding m_{-1}, in the bucket of its rows."""
        self.searches += 1
        steps, rows, _ = x.shape
        state = {"search": torch.tensor(self.searches, device="cpu"), "rows": torch.tensor(rows, device="cpu"),
                 "steps": torch.tensor(0, device="cpu"), "hypotheses": torch.tensor(hypotheses, device="cpu")}
        capacity = min(max(16, 2 ** steps.bit_length()), span + 1)
        initial = decoder.empty_memory(bucket_wide(rows // hypotheses) * hypotheses, like=x)
        self._take(state, initial.size(2), capacity, like=initial).start(initial)
        return state

    def _take(self, state, rows: int, capacity: int, like: Tensor) -> StaticMemory:
        """The static memory of this bucket, for the search `state` from now
        on; `like`: keys and values of the memory's shape (static_memory.py)."""
        key = (rows, capacity, like.dtype)
        self.serving = (int(state["search"]), key)
        return self._kept(self.memories, key, lambda: StaticMemory(capacity, rows, like))

    def _memory(self, state) -> StaticMemory:
        search, key = self.serving
        if search != int(state["search"]):
            raise FeedbackUsageError(
                "two searches interleaved on one model decoding with CUDA graphs; finish one before starting "
                "the next, or decode eagerly: --model-overrides \"{'cuda_graphs': 'off'}\"")
        return self.memories[key]

    def reorder(self, decoder, incremental_state, new_order: Tensor) -> None:
        """Beam search's new order of the rows, in place, in the bucket of
        the rows left (a smaller one once sentences have finished)."""
        state = decoder.get_incremental_state(incremental_state, "static_memory")
        if state is None:
            return
        memory = self._memory(state)
        hypotheses = int(state["hypotheses"])
        rows = bucket_wide(len(new_order) // hypotheses) * hypotheses
        target = memory if rows == memory.rows else self._take(state, rows, memory.capacity, like=memory.slots)
        memory.copy_to(target, new_order, int(state["steps"]))
        state["rows"] = torch.tensor(len(new_order), device="cpu")

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
