"""Training in passes: a block's positions many at a time, in groups taken in order.

Exact feedback computes position t after position t - 1, one step of every
layer at a time. Here a block is cut into groups of G consecutive positions,
and each group runs in K passes. In a pass every position of the group goes
through every layer at once, as a Transformer computes a block: position t
attends to the exact memory vectors before the group and, inside it, to those
the previous pass made (the first pass: a guess),

    x_t^{l+1,(k)} = Layer_l(x_t^{l,(k)}, {m_{t-span} .. m_{s-1}} + {m_s^{(k-1)} .. m_{t-1}^{(k-1)}})
    m_t^{(k)} = sum_l softmax(w)_l x_t^{l,(k)}                          (eq. 1)

for a group starting at s. Position s reads no memory of its group, so it
is exact after pass 1; position s + 1 reads m_s, exact after pass 1, so it is
exact after pass 2; after pass k the first k positions are exact, and K = G
is exact feedback. The last pass's memory vectors become the exact prefix of
the next group (and the stream's carried memory at the block's end). A block
of T positions then takes T / G x K sequential steps of large products,
instead of T steps of small ones.

The first pass's guess of the in-group memory (`initial`): the embeddings
alone, m_t^{(0)} = x_t^0 ("embeddings"), or no in-group memory at all, each
position reading only the memory before its group ("none"; a position further
than the span from its group's start would read nothing, so the options
refuse it then: feedback_config.check_passes).

Gradients flow through every pass ("every": the in-group memory vectors are
not detached, so that with K = G they are exact feedback's gradients, and a
memory vector learns from the positions of its own group that read it), or
through the last pass alone ("last": the earlier passes without autograd,
cheaper; a memory vector then gets no gradient from its group).

Dropout: the passes of a group draw the same masks (the random generator
restarted at the group's start), so that each position computes one dropout
sample of the model however many passes it takes, and K = G is exact
feedback with those masks. With gradients through the last pass only, the
earlier passes run without autograd, where the attention draws its masks
another way: their masks are others.

Passes train; validation, fairseq-eval-lm and decoding run the exact loop
(FeedbackDecoder.decode), and what a model trained in passes saves is the
same model.
"""

import contextlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..cuda_graphs.backends import default_generator
from ..modules.key_value_buffer import KeyValueBuffer
from ..modules.memory_decoder_layer import per_layer
from ..modules.memory_view import MemoryView, SlotDistances

INITIAL_MEMORIES = ("embeddings", "none")
PASS_GRADIENTS = ("every", "last")


@dataclass(frozen=True)
class Passes:
    """How a block trains in passes (--train-passes, --pass-group, ...).

    Args:
        passes: K, the passes each group takes (K = group: exact).
        group: G, the positions a pass computes at once.
        gradients: "every" pass, or the "last" one alone.
        initial: the first pass's guess of the in-group memory: "embeddings" or "none".
    """

    passes: int
    group: int
    gradients: str = "every"
    initial: str = "embeddings"

    def __str__(self) -> str:
        return (f"{self.passes} pass{'es' if self.passes > 1 else ''} over groups of {self.group} positions "
                f"(gradients through {'every pass' if self.gradients == 'every' else 'the last pass'}, first guess: "
                f"{'the embeddings' if self.initial == 'embeddings' else 'no in-group memory'})")


class PassesLoop:
    """FeedbackLoop.block_in_passes (feedback_loop.py) for one block.

    Args:
        memory: the decoder's FeedbackMemory.
        layers: the layers, None where LayerDrop left one out (it passes its input on).
        buffer: the memory's keys and values; each group appends its own.
        window: the slots before the block that its first group reads, one
            [bsz, num_heads, slots, head_dim] view per plane.
        span: how many slots a position reads at most.
        memory_span: the rows of the tables read by distance (--memory-span).
        key_positions: the relative positions [memory_span, head_dim], or None.
        weights: eq. 1's mixing weights, [memories, layers + 1].
        passes: how the block runs (Passes).
    """

    def __init__(self, memory, layers: Sequence, buffer: KeyValueBuffer, window: Tuple[Tensor, ...], span: int,
                 memory_span: int, key_positions: Optional[Tensor], weights: Tensor, passes: Passes):
        self.memory, self.layers, self.buffer, self.window = memory, list(layers), buffer, window
        self.span, self.memory_span, self.key_positions = span, memory_span, key_positions
        self.weights, self.passes = weights, passes
        self.persistent = [None if layer is None else layer.self_attn.persistent() for layer in self.layers]
        # what a group reads, by (slots before it, its length): the same for nearly every group
        self.views: Dict[Tuple[int, int], Tuple[List, List]] = {}

    def __call__(self, x: Tensor, encoder_kv: Optional[Tensor],
                 encoder_bias: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """The top layer's outputs [tgt_len, bsz, embed_dim] and the memory
        vectors [tgt_len, memories, bsz, embed_dim], of the last passes."""
        encoder_kv = per_layer(encoder_kv, len(self.layers))
        outputs, memories, window = [], [], self.window
        for group in x.split(self.passes.group):
            h, m = self._group(group, window, encoder_kv, encoder_bias)
            window = self.buffer.append(self.memory.project(m), self.span)
            outputs.append(h)
            memories.append(m)
        return torch.cat(outputs), torch.cat(memories)

    def _group(self, x: Tensor, window: Tuple[Tensor, ...], encoder_kv, encoder_bias) -> Tuple[Tensor, Tensor]:
        """A group's K passes, from the guess of its memory; the last pass's
        outputs [group, bsz, embed_dim] and memory vectors [group, memories, bsz, embed_dim]."""
        passes = self.passes
        first_views, views = self._views(window[0].size(2), len(x), x)
        guess = x[:-1, None].expand(-1, self.memory.memories, -1, -1)  # m^(0): the embeddings x^0
        generator = default_generator(x.device)
        start = generator.get_state()
        for k in range(1, passes.passes + 1):
            generator.set_state(start)  # each pass the same dropout masks
            with torch.no_grad() if passes.gradients == "last" and k < passes.passes else contextlib.nullcontext():
                h, m = self._pass(x, window, guess, first_views if k == 1 else views, encoder_kv, encoder_bias)
            guess = m[:-1]
        return h, m

    def _pass(self, x: Tensor, window: Tuple[Tensor, ...], guess: Tensor, views: List, encoder_kv,
              encoder_bias) -> Tuple[Tensor, Tensor]:
        """Every layer over the group at once, each position reading the slots
        before the group and the memory vectors `guess` of the positions
        before it in the group, [group - 1, memories, bsz, embed_dim]."""
        in_group = self.memory.project(guess).permute(1, 2, 3, 0, 4)  # [planes, bsz, num_heads, group - 1, head_dim]
        planes = [torch.cat([before, ours], 2) for before, ours in zip(window, in_group.unbind(0))]
        keys_values = self.memory.layer_keys_values(planes, lambda keys: keys)
        states, h = [x], x
        for layer, (keys, values), (bias, positions), persistent, kv in zip(
                self.layers, keys_values, views, self.persistent, encoder_kv):
            if layer is not None:
                h = layer.forward_memory(h, MemoryView(keys, values, bias, persistent, positions), kv, encoder_bias)
            states.append(h)  # a left-out layer passes its input on
        return h, self.memory(states, self.weights).transpose(0, 1)

    def _views(self, before: int, length: int, like: Tensor) -> Tuple[List, List]:
        """What each layer reads, besides keys and values, in the first pass
        and in the others: a bias [num_heads or 1, group, slots] (-inf on the
        slots out of reach: those after a position, those beyond its span; in
        the first pass without a guess, every slot of the group), and the
        relative positions (table, index [group, slots]) or None."""
        if (before, length) not in self.views:
            positions = torch.arange(length, device=like.device)
            slots = torch.arange(-before, length - 1, device=like.device)
            reach = SlotDistances(positions[:, None] - slots[None], 1, self.span, self.memory_span)
            table = None if self.key_positions is None else (self.key_positions, reach.table_index)
            views = [(reach.bias(None if layer is None else layer.self_attn.span_mask, like), table)
                     for layer in self.layers]
            first = views
            if self.passes.initial == "none":
                unguessed = torch.zeros(length, before + length - 1, dtype=like.dtype, device=like.device)
                unguessed[:, before:] = float("-inf")
                first = [(bias + unguessed, table) for bias, table in views]
            self.views[(before, length)] = first, views
        return self.views[(before, length)]

