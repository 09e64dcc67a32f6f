"""The feedback loop at bounded shapes, replayed as CUDA graphs.

A CUDA graph replays fixed shapes, and fairseq's batches vary in rows and
lengths. So a block is padded up to a bucket: time steps at the end (the
loop is causal: later steps change nothing before them), rows (rows never
mix), and source positions (masked out of encoder attention). Padding's
outputs are cut off before anything reads them, so its gradients are zero
and it changes no loss or gradient. One graph per bucket (and per span,
dtype, training or not) is captured at its first use, checked against the
eager loop, and kept in a cache bounded in graphs and bytes (cuda_graphs.py).
Buckets are few: rows and source positions go up to a power of two, and
training under LayerDrop (a pattern of kept layers per block) runs eagerly.

Decoding replays one captured step per token over a StaticMemory (a ring of
fixed shape, masked by distance) per bucket of rows and capacity, kept from
one search to the next so that graphs are reused; beam search reorders it
in place, and moves to a smaller bucket as sentences finish.

What differs from the eager loop is only where shapes come from; the loop
and its step are FeedbackDecoder's. Without capture (--cuda-graphs emulate,
and the CPU tests) the same padding, bookkeeping and checks run them eagerly.
"""

import atexit
import logging
import weakref
from collections import OrderedDict
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import FeedbackUsageError, running_a_tool
from ..modules.block_weight_gradients import weight_gradients_per_block
from ..modules.cuda_graphs import GraphCache
from ..modules.feedback_attention import MemoryView
from ..modules.static_memory import StaticMemory

logger = logging.getLogger(__name__)

# Decoding's static memories and encoder buffers are kept for the last few
# buckets (a beam of 128 sentences: tens of MB each).
CACHED_DECODING_BUFFERS = 8
NO_ENCODER = [None, None, None]  # a language model's "encoder buffers"


def bucket(n: int) -> int:
    """Time steps: n rounded up to a multiple of 8, or from 128 on of a
    sixteenth of the power of two below it. The loop's cost grows with its
    steps, so they are padded by little: less than 8 or n/8."""
    step = max(8, 2 ** (n.bit_length() - 4))
    return -(-n // step) * step


def bucket_wide(n: int) -> int:
    """Rows and source positions: the power of two at or above n (at least
    8). A step costs about the same for more of them, and --max-tokens
    batches pair many short rows with few long ones: one epoch of Debian
    de-en's batches fits in 40 graphs this way, against 101 with bucket()."""
    return max(8, 1 << (n - 1).bit_length())


def _log_statistics_at_exit(loop: "weakref.ref[GraphedFeedbackLoop]") -> None:
    if loop() is not None:
        loop().log_statistics()


class GraphedFeedbackLoop:
    """`mode`: "auto" captures on CUDA and leaves other devices to the eager
    loop; "emulate" runs the same bookkeeping and checks without capture, on
    any device."""

    def __init__(self, mode: str = "auto"):
        self.mode = mode
        self.cache: Optional[GraphCache] = None  # made at the first call, on its device
        self.memories: "OrderedDict[tuple, StaticMemory]" = OrderedDict()  # decoding: by rows, capacity, dtype
        # decoding: the encoder's static keys/values and mask, and the search's tensor they were copied from
        self.encoders: "OrderedDict[tuple, List[Optional[Tensor]]]" = OrderedDict()
        self.searches = 0
        self.serving = (0, None)  # (search, key of its static memory): one search at a time
        self.warned_layerdrop = False

    def __deepcopy__(self, memo):
        return GraphedFeedbackLoop(self.mode)  # a copy of the model (e.g. --ema) captures its own

    def takes(self, decoder, x: Tensor, layers: List, incremental_state) -> bool:
        """Whether this call of the decoder runs here; if not, eagerly. A
        search under way stays where it started."""
        if incremental_state is not None:
            if torch.is_grad_enabled():
                return False
            if decoder.get_incremental_state(incremental_state, "static_memory") is not None:
                return True
        if self.mode == "auto" and not x.is_cuda:
            return False
        if self.cache is None:
            self.cache = GraphCache(capture=self.mode == "auto", name="feedback loop")
            if running_a_tool():  # the last validation's line, at the end of fairseq-train
                atexit.register(_log_statistics_at_exit, weakref.ref(self))
        if None in layers:  # LayerDrop's 2^layers patterns would each need a graph
            if not self.warned_layerdrop:
                self.warned_layerdrop = True
                logger.warning("feedback loop: LayerDrop leaves out other layers at every block; "
                               "training blocks run eagerly, without CUDA graphs")
            return False
        return self.cache.failed is None

    def run(self, decoder, x, previous, span, layers, encoder_kv, encoder_bias, incremental_state):
        """The top layer's outputs and the memory vectors (None when decoding)."""
        if incremental_state is None:
            return self.block(decoder, x, previous, span, layers, encoder_kv, encoder_bias)
        hypotheses = decoder.hypotheses_per_sentence(incremental_state)
        return self.decode(decoder, x, span, layers, encoder_kv, encoder_bias, incremental_state, hypotheses), None

    def log_statistics(self) -> None:
        if self.cache is not None and (self.cache.calls or self.cache.keys):
            logger.info(self.cache.statistics())

    def block(self, decoder, x: Tensor, previous: Tensor, span: int, layers: List, encoder_kv: Optional[Tensor],
              encoder_bias: Optional[Tensor]):
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
        params = [*decoder.memory.parameters(), *decoder.layers.parameters()]
        if decoder.key_positions is not None:
            params.append(decoder.key_positions)
        kept = tuple(layer is not None for layer in layers)
        grad, training = torch.is_grad_enabled(), decoder.training
        autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        key = (tuple(None if t is None else tuple(t.shape) for t in inputs), span, kept, x.dtype, grad, training,
               autocast, tuple(p.data_ptr() for p in params))  # parameters moved or converted: the graphs are stale
        shape = (f"{padded_rows} rows x {padded_steps} steps"
                 + ("" if encoder_kv is None else f" x {padded_positions} source positions")
                 + f", span {span}, {x.dtype}{', autocast' if autocast else ''}"
                 + (", training" if grad else ", evaluation"))

        def loop(x, initial, encoder_kv, encoder_bias):
            buffer, window = decoder.start_memory(initial, len(x), span)
            # in a graph kernels cost and Python does not: the linear layers'
            # weight gradients once per block
            with weight_gradients_per_block([*decoder.memory.modules(),
                                             *(m for layer in layers if layer is not None for m in layer.modules())]):
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
