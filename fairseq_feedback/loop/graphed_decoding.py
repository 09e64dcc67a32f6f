"""Decoding with CUDA graphs: one captured step per token.

fairseq's incremental decoding feeds one token per call, at a position that
grows, over rows that beam search reorders and drops. A captured graph
replays fixed shapes, so a search keeps the shape it starts with: the
memory's keys and values live in a StaticMemory (a ring of fixed shape,
masked by distance) of the search's rows (sentences bucketed, times the
beam) and a capacity guessed once from its source length (twice the padded
source, at least 16 slots; grown by doubling, rarely, if the search runs
longer), and the encoder's keys and values in buffers of its bucket of
source positions. Beam search reorders the memory in place; the rows of
finished sentences stay, zeroed, as padding. One graph per shape then serves
every step of every search of that shape: a key is shapes, never a buffer's
identity, and a buffer stays as long as a cached graph was captured over it.

The step is the decoder's (FeedbackLoop.step, over every slot), handed over
with each call; a search's state (`start`) is kept by the decoder in
fairseq's incremental state and handed back with each call.
"""

from collections import OrderedDict
from typing import Callable, Hashable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import FeedbackUsageError
from ..cuda_graphs import GraphCache, autocast_dtype, bucket_wide
from .static_memory import StaticMemory

# Static memories and encoder buffers that no cached graph was captured over
# are dropped once more than this many are kept (a beam of 128 sentences: tens of MB each).
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

    def start(self, x: Tensor, span: int, encoder_kv: Optional[Tensor], hypotheses: int,
              empty_memory: Callable[[int, Tensor], Tensor]) -> dict:
        """A new search: a static memory holding m_{-1}, of the search's rows
        and of a capacity for twice its padded source (or its prefix).

        Args:
            x: the first call's new tokens embedded, [tgt_len, bsz, embed_dim].
            span: how many slots a step sees at most.
            encoder_kv: the encoder's keys and values, as decode takes them, or None.
            hypotheses: rows per sentence (beam search's hypotheses, or 1).
            empty_memory: empty_memory(bsz, like), m_{-1}'s keys and values
                (FeedbackLoop.empty_memory).

        Returns:
            the search's state, for the decoder to keep and hand to each call.
        """
        self.searches += 1
        tgt_len, bsz, _ = x.shape
        search = {"search": torch.tensor(self.searches, device="cpu"), "rows": torch.tensor(bsz, device="cpu"),
                  "steps": torch.tensor(0, device="cpu"), "hypotheses": torch.tensor(hypotheses, device="cpu")}
        guess = 2 ** tgt_len.bit_length() if encoder_kv is None else 2 * bucket_wide(encoder_kv.size(4))
        capacity = min(max(16, guess), span + 1)
        initial = empty_memory(bucket_wide(bsz // hypotheses) * hypotheses, x)
        self._take(search, initial.size(2), capacity, like=initial)[1].start(initial)
        return search

    def decode(self, step: Callable, x: Tensor, span: int, search: dict, encoder_kv: Optional[Tensor],
               encoder_bias: Optional[Tensor], parameters, graph_key: Hashable, description: str) -> Tensor:
        """fairseq's incremental decoding of the new tokens, one captured step each.

        Args:
            step: step(x, window, distance, encoder_kv, encoder_bias) -> (the
                top layer's output, m_t's keys and values, then any more of
                the step's outputs, [bsz, ...] each), over the memory's every
                slot at `distance` steps back (FeedbackLoop.step).
            x: the new tokens embedded, [tgt_len, bsz, embed_dim].
            span: how many slots a step sees at most.
            search: the search's state (start's).
            encoder_kv, encoder_bias: the encoder's keys and values and mask,
                as GraphedFeedbackLoop.block takes them.
            parameters: what `step` reads (moved or converted: the graphs are stale).
            graph_key: what else its graph depends on; `description` says it
                in words, for the log.

        Returns:
            the top layer's outputs, [tgt_len, bsz, embed_dim], then the
            step's other outputs, [tgt_len, bsz, ...] each.
        """
        bsz, hypotheses = int(search["rows"]), int(search["hypotheses"])
        parameters = tuple(p.data_ptr() for p in parameters)
        autocast = autocast_dtype(x.device.type)
        outputs = []
        for h in x.unbind(0):
            memory_key, memory = self._memory(search)
            if int(search["steps"]) + 1 >= memory.capacity < span + 1:  # grow before the ring would wrap
                bigger_key, bigger = self._take(search, memory.bsz, min(2 * memory.capacity, span + 1),
                                                like=memory.slots)
                memory.copy_to(bigger, torch.arange(bsz, device=h.device), int(search["steps"]))
                memory_key, memory = bigger_key, bigger
            encoder_key, encoder = self._static_encoder(encoder_kv, encoder_bias, memory.bsz // hypotheses)
            full_key = ("decode", memory_key, encoder_key, graph_key, autocast, parameters)
            shape = (f"decoding {memory.bsz} rows, {memory.capacity} memory slots"
                     + ("" if encoder[0] is None else f", {encoder[0].size(4)} source positions")
                     + f", {description}, {h.dtype}{', autocast' if autocast else ''}")

            def step_over_the_ring(x, memory=memory, encoder=encoder):
                """The step at step t over every slot; then m_t joins the memory."""
                window, distance = memory.read()
                out, kv, *more = step(x, window, distance, encoder[0], encoder[1])
                memory.write(kv)
                return (out, *more)

            step_outputs = self.cache(full_key, step_over_the_ring, [F.pad(h, (0, 0, 0, memory.bsz - bsz))],
                                      state=[memory.slots, memory.slot_steps, memory.step], shape=shape)
            outputs.append([out[:bsz] for out in step_outputs])
            search["steps"] += 1
        return [torch.stack(at_each_step) for at_each_step in zip(*outputs)]

    def _take(self, search, bsz: int, capacity: int, like: Tensor) -> Tuple[tuple, StaticMemory]:
        """The static memory of this shape (and its key), for the search
        `search` from now on; `like`: keys and values of the memory's shape
        (static_memory.py)."""
        key = (bsz, capacity, like.dtype)
        self.serving = (int(search["search"]), key)
        return key, self._kept(self.memories, key, lambda: StaticMemory(capacity, bsz, like))

    def _memory(self, search) -> Tuple[tuple, StaticMemory]:
        serving, key = self.serving
        if serving != int(search["search"]):
            raise FeedbackUsageError(
                "two searches interleaved on one model decoding with CUDA graphs; finish one before starting "
                "the next, or decode eagerly: --model-overrides \"{'cuda_graphs': 'off'}\"")
        return key, self.memories[key]

    def reorder(self, search: dict, new_order: Tensor) -> None:
        """Beam search's new order of the rows, in place: the rows of
        finished sentences are cleared and stay, as padding."""
        _, memory = self._memory(search)
        memory.copy_to(memory, new_order, int(search["steps"]))
        search["rows"] = torch.tensor(len(new_order), device="cpu")

    def _static_encoder(self, encoder_kv, encoder_bias, sentences: int):
        """The encoder's keys/values and mask in buffers of the bucket's
        shape (and their key), copied when the search's own change (a new
        search, finished sentences): padded rows see zero keys, padded
        positions are masked."""
        if encoder_kv is None:
            return None, NO_ENCODER
        layers, _, real, num_heads, src_len, head_dim = encoder_kv.shape
        key = (sentences, bucket_wide(src_len), encoder_kv.dtype)
        static = self._kept(self.encoders, key, lambda: [
            encoder_kv.new_zeros(layers, 2, sentences, num_heads, key[1], head_dim),
            encoder_kv.new_zeros(sentences, 1, 1, key[1]), None])
        if static[2] is not encoder_kv:
            kv, bias = static[:2]
            kv.zero_()
            kv[:, :, :real, :, :src_len] = encoder_kv
            bias.zero_()
            bias[:real, ..., src_len:] = float("-inf")
            if encoder_bias is not None:
                bias[:real, ..., :src_len] = encoder_bias
            static[2] = encoder_kv
        return key, static

    def _kept(self, buffers: OrderedDict, key, make):
        """buffers[key], made if missing. Past CACHED_DECODING_BUFFERS, the
        buffers that no cached graph was captured over go (a graph replays
        its buffers' addresses: theirs stay while it does)."""
        if key not in buffers:
            if len(buffers) >= CACHED_DECODING_BUFFERS:
                used = {part for cached in self.cache.cached_keys() if cached[0] == "decode"
                        for part in cached[1:3]}
                for unused in [k for k in buffers if k not in used]:
                    del buffers[unused]
            buffers[key] = make()
        buffers.move_to_end(key)
        return buffers[key]
