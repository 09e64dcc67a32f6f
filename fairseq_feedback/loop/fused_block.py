"""The feedback loop as one autograd Function per block, its backward written by hand.

Run through autograd (reference.py), every step records each operator (a
node, saved tensors, a gradient accumulation each), and each linear layer
computes its weight gradient at every step, a product of rank `bsz` added
to the sum so far. Here a block of steps is one Function. Its backward is
the chain rule through each step's layers (fused_layer.py), later steps
first; what does not depend on the step's gradient comes once per block:
every linear layer's weight gradient (dW = G^T X, one product over the
block's steps), every layer norm's (one native_layer_norm_backward over the
block), the mixing weights' (eq. 1), the encoder's keys' and values' (one
product each), and the first layer's queries, which depend on the
embeddings alone. What those products read is written in place, step by
step, into tensors of the whole block (out=), wherever the operator that
makes it can write there.

A step's memory vector m_t (eq. 1, mixing.Mixing; the recurrent memory,
one per layer) is projected to its keys and values, k_t and v_t, which
later steps read:

    kv_t = kv_proj(m_t)  (pre-norm: kv_proj(LN(m_t)))
    g_m_t = kv_proj'(g_kv_t) (+ LN')  + the gradient of m_t from outside the block

and g_kv_t is complete when the backward reaches step t: every step that
reads slot t comes later.

Attention has one query per row of the batch at a step: scores, softmax and weighted
sum as three batched products (the fused scaled_dot_product_attention
kernel costs more than that at this size on the CPU; its backward, ten
times more). Dropout masks are drawn once per block, for every layer and
step, of each kind (the residual branches, the feed-forward hidden layer,
each attention's weights), held as bits and unpacked, scaled, a few steps at
a time (dropout_bits.py): a residual with dropout is one addcmul, the
attention's weights one mul.

The block's contract is kept by name. What it reads is a BlockInputs; its
backward hands back a BlockInputs of their gradients, checked against the
inputs field by field, and autograd takes both flattened the same way. The
parameters, and their gradients, follow one list of the weighted modules
(fused_layer.WEIGHTED, through block_weighted). What the forward keeps for
the backward, besides each piece's own records, is a BlockRecords; the
pieces' records of their inputs are views of its `states` and `memories`,
which the block hands out as its outputs, so BlockFunction saves them, and
every input its backward reads, for backward: autograd refuses a backward
over any of them changed in place since the forward (a wrong gradient
otherwise).
"""

from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..modules.feedback_attention import Alignment, aligned
from ..modules.key_value_buffer import KeyValueBuffer
from ..modules.memory_decoder_layer import per_layer
from .dropout_bits import BlockDropout
from .fused_layer import NO_DROPOUT, DropoutMasks, FusedLayer, weighted
from .attention import per_row
from .memory_windows import MemoryWindows
from .mixing import Mixing
from .operators import GroupedLinear, Linear, Norm


def block_weighted(kv_proj, memory_layer_norm, layers: Sequence) -> list:
    """A block's weighted modules, or their pieces: the memory's key/value
    projection and norm (pre-norm: else None), then each layer's
    (fused_layer.weighted; None where LayerDrop left a layer out), in the
    order of BlockInputs.parameters."""
    return [kv_proj, *([] if memory_layer_norm is None else [memory_layer_norm]),
            *(m for layer in layers if layer is not None for m in weighted(layer))]


class BlockInputs(NamedTuple):
    """What a block reads, by name; its gradients come back in the same
    structure, None where none is needed. BlockFunction takes it flattened
    (`flat`), for autograd to route a gradient to each tensor."""

    x: Tensor  # the first layer's inputs, [tgt_len, bsz, embed_dim]
    encoder_kv: Optional[Tensor]  # every layer's, [layers, 2, sentences, num_heads, src_len, head_dim]
    positions: Optional[Tensor]  # relative positions of a full window, [span, head_dim]
    mixing_weights: Tensor  # eq. 1's, [layers + 1]
    span_biases: Tuple[Optional[Tensor], ...]  # each layer's adaptive span, log m(e) [num_heads, 1, span]
    window: Tuple[Tensor, ...]  # the slots that step 0 reads, a [bsz, num_heads, slots, head_dim] per plane
    parameters: Tuple[Tensor, ...]  # each of block_weighted's weight and bias

    def flat(self) -> List[Optional[Tensor]]:
        return [self.x, self.encoder_kv, self.positions, self.mixing_weights, *self.span_biases, *self.window,
                *self.parameters]

    def flat_gradients(self, grads: "BlockInputs") -> List[Optional[Tensor]]:
        """`grads`, the gradients of these inputs, flattened as `flat`
        flattens the inputs; raises if a field holds a different count."""
        for name, inputs, input_grads in zip(self._fields, self, grads):
            if isinstance(inputs, tuple) and len(input_grads) != len(inputs):
                raise RuntimeError(f"the fused block's backward made {len(input_grads)} gradients for its "
                                   f"{len(inputs)} {name}")
        return grads.flat()


@dataclass
class BlockRecords:
    """What a block's forward keeps for its backward, besides its pieces'
    own records (operators.StepRecords): tensors of the whole block, which
    the steps write into and read, step t at index t (of dimension 1 for
    `states` and `slots`)."""

    states: Tensor  # x_t^0 .. x_t^L, [layers + 1, tgt_len, bsz, embed_dim], eq. 1's inputs; the outputs are x^L
    memories: Tensor  # m_t, [tgt_len, memories * bsz, embed_dim] (a memory's rows one after another)
    slots: Tensor  # the memory's keys and values, [planes, bsz, num_heads, initial + tgt_len, head_dim]
    dropout: BlockDropout  # every step's and layer's masks


def encoder_reads(encoder_kv: Sequence[Optional[Tuple[Tensor, Tensor]]], encoder_bias: Optional[Tensor], bsz: int):
    """Each layer's encoder keys and values as attention.Attention takes them,
    the mask expanded once for all layers.

    Args:
        encoder_kv: each layer's (keys, values), [sentences, num_heads, src_len, head_dim] each (per_layer).
        encoder_bias: their padding mask as a bias, [sentences, 1, 1, src_len], or None (no padding).
        bsz: the rows of the queries.

    Returns:
        each layer's (keys, values [sentences * num_heads, src_len, head_dim],
        mask [sentences * num_heads, 1, src_len] or None, beam: rows per sentence), or None.
    """
    present = [kv for kv in encoder_kv if kv is not None]
    if not present:
        return list(encoder_kv)
    sentences, num_heads, src_len, head_dim = present[0][0].shape
    bias = None if encoder_bias is None else encoder_bias.expand(sentences, num_heads, 1, src_len).reshape(-1, 1, src_len)
    return [None if kv is None else (kv[0].view(-1, src_len, head_dim), kv[1].view(-1, src_len, head_dim), bias,
                                     bsz // sentences) for kv in encoder_kv]


def fused_step(x: Tensor, views: Sequence, layers: Sequence, encoder_kv: Sequence, encoder_bias: Optional[Tensor],
               memory, weights: Tensor, alignment: Optional[Alignment] = None) -> Tuple[Tensor, Tensor]:
    """reference.reference_step through the fused layers, without gradients
    or dropout (a search's step).

    Args: as reference.reference_step takes them.

    Returns:
        the top layer's output [bsz, embed_dim], and m_t [memories, bsz, embed_dim].
    """
    states, bsz = [x], x.size(0)
    for i, (layer, view, encoder_read) in enumerate(zip(layers, views, encoder_reads(encoder_kv, encoder_bias, bsz))):
        if layer is not None:
            memory_read = (view.keys.flatten(0, 1), view.values.flatten(0, 1), per_row(view.bias, bsz))
            fused = FusedLayer(layer, 1, recording=False, alignment=aligned(alignment, i))
            x = fused(x, 0, memory_read, encoder_read)
        states.append(x)
    return x, memory(states, weights)


class FusedFeedbackLoop:
    """FeedbackLoop.block (feedback_loop.py) for one block, as one autograd Function.

    Args:
        memory: the decoder's FeedbackMemory.
        layers: the layers, None where LayerDrop left one out.
        buffer: the memory's keys and values (KeyValueBuffer); it gets the
            block's at its end.
        window: what step 0 reads of them, one [bsz, num_heads, slots, head_dim] view per plane.
        span: how many slots a step reads at most.
        positions: the relative positions of a full window, [span, head_dim], or None.
        span_biases: each layer's adaptive span, log m(e) of a full window,
            [num_heads, 1, span], or None.
        weights: the mixing weights of eq. 1, [layers + 1].
        alignment: where fairseq's alignment layer puts its encoder attention's
            weights (decoding), or None.

    The block reads its slots from a copy laid out for attention,
    [planes, bsz, num_heads, slots, head_dim]: a window is then a batch of
    contiguous matrices, which the batched products take as they are (read
    in the buffer's layout, slots first, they ran several times slower).
    The buffer gets the new slots at the end of the block.

    Once called, a block shows whether it records for a backward
    (`recording`), its dropout masks (`records`: BlockRecords' dropout),
    and whether its attention keeps its weights for the backward
    (`keep_probs`)."""

    def __init__(self, memory, layers: Sequence, buffer: KeyValueBuffer, window: Tuple[Tensor, ...], span: int,
                 positions: Optional[Tensor], span_biases: Sequence[Optional[Tensor]], weights: Tensor,
                 alignment: Optional[Alignment] = None):
        self.memory, self.decoder_layers, self.alignment = memory, layers, alignment
        self.buffer, self.window, self.span, self.initial = buffer, window, span, window[0].size(2)
        self.plane_count, self.num_heads, self.head_dim = memory.planes, memory.num_heads, memory.head_dim
        self.memory_count = memory.memories
        self.positions, self.weights, self.span_biases = positions, weights, tuple(span_biases)

    def __call__(self, x: Tensor, encoder_kv: Optional[Tensor], encoder_bias: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """The top layer's outputs [tgt_len, bsz, embed_dim] and the memory
        vectors [tgt_len, memories, bsz, embed_dim]."""
        parameters = tuple(p for m in block_weighted(self.memory.kv_proj, self.memory.layer_norm, self.decoder_layers)
                           for p in (m.weight, m.bias))
        self.inputs = BlockInputs(x, encoder_kv, self.positions, self.weights, self.span_biases, self.window,
                                  parameters)
        inputs = self.inputs.flat()
        recording = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
        with torch.no_grad():  # the block's backward is its own
            self._start(x, encoder_kv, encoder_bias, recording)
        if not recording:
            return self.forward()
        return BlockFunction.apply(self, *inputs)

    def _start(self, x: Tensor, encoder_kv: Optional[Tensor], encoder_bias: Optional[Tensor], recording: bool) -> None:
        """Everything the block's steps read and write: the layers' pieces,
        the slots, the encoder's keys and values, the biases, the dropout
        masks, the states of eq. 1 and the memory vectors."""
        tgt_len, bsz, embed = x.shape
        self.recording, self.encoder_kv = recording, encoder_kv
        memory = self.memory
        self.kv_proj = (GroupedLinear(memory.kv_proj, tgt_len, recording, self.memory_count) if memory.grouped
                        else Linear(memory.kv_proj, tgt_len, recording))
        self.memory_layer_norm = None if memory.layer_norm is None else Norm(memory.layer_norm, tgt_len, recording)
        present = [layer for layer in self.decoder_layers if layer is not None]
        read = min(self.span, self.initial + tgt_len - 1)  # slots a step reads at most
        self.keep_probs = not present or present[0].self_attn.num_heads * read <= embed + (
            0 if present[0].fc1 is None else present[0].fc1.out_features)
        self.layers = [None if layer is None else FusedLayer(layer, tgt_len, recording, memory.plane(i), i == 0,
                                                             self.keep_probs, aligned(self.alignment, i))
                       for i, layer in enumerate(self.decoder_layers)]
        self.present = [layer for layer in self.layers if layer is not None]

        slots = x.new_empty(self.plane_count, bsz, self.num_heads, self.initial + tgt_len, self.head_dim)
        slots[:, :, :, : self.initial] = torch.stack(self.window)
        self.encoder_reads = encoder_reads(per_layer(encoder_kv, len(self.layers)), encoder_bias, bsz)
        self.biases = [None if b is None else per_row(b, bsz) for b in self.span_biases]
        # x_t^0 .. x_t^L, the states that eq. 1 mixes; a pre-norm layer writes its output here
        states = x.new_empty(len(self.layers) + 1, tgt_len, bsz, embed)
        states[0] = x
        memories = x.new_empty(tgt_len, self.memory_count * bsz, embed)
        self.records = BlockRecords(states, memories, slots, self._draw_masks(x, read))
        self.mixing = Mixing(self.weights, states)
        if recording:
            for layer, inputs in zip(self.layers, states):
                if layer is not None:
                    layer.read_inputs_from(inputs)
            memory_reader = self.kv_proj if self.memory_layer_norm is None else self.memory_layer_norm
            memory_reader.inputs.write_into(self.records.memories)

    def _draw_masks(self, x: Tensor, read: int) -> BlockDropout:
        """Every dropout mask of the block, for all its steps and layers
        (dropout_bits.py); `read`: the slots a step reads at most, of which
        step t's memory attention reads the last."""
        tgt_len, bsz, embed = x.shape
        first = self.present[0] if self.present else None
        if first is None:
            return BlockDropout(x, tgt_len, len(self.layers), NO_DROPOUT, (), self._slots)
        encoder_read = next((r for r in self.encoder_reads if r is not None), None)
        shapes = DropoutMasks(
            (len(first.sublayers), bsz, embed), None if first.fc1 is None else (bsz, first.fc1.weight.size(0)),
            (bsz * self.num_heads, 1, read),
            None if encoder_read is None else (bsz * first.encoder_attn.num_heads, encoder_read[0].size(1)))
        rates = (first.dropout, first.activation_dropout, first.attention_dropout, first.encoder_attention_dropout)
        return BlockDropout(x, tgt_len, len(self.layers), shapes, rates, self._slots)

    def _slots(self, t: int) -> int:
        """The slots that step t reads."""
        return min(self.span, self.initial + t)

    # --- forward ------------------------------------------------------------------------------------

    def forward(self) -> Tuple[Tensor, Tensor]:
        states, memories, slots = self.records.states, self.records.memories, self.records.slots
        bsz, per_memory = states.size(2), self.plane_count // self.memory_count  # a memory's planes
        pre_norm = bool(self.present) and self.present[0].pre_norm
        if self.layers and self.layers[0] is not None:
            self.layers[0].project_block_queries(states[0])
        windows = MemoryWindows(slots, None, self.initial, self.span, self.num_heads, self.positions)
        for t, h in enumerate(states[0].unbind(0)):
            planes = windows.planes(t)
            keys = windows.keys(planes)
            masks = self.records.dropout.at(t)
            outputs = [h]
            for i, layer in enumerate(self.layers):
                if layer is not None:
                    bias = None if self.biases[i] is None else self.biases[i][..., -planes[0].size(1):]
                    memory_read = (keys[layer.plane // 2], planes[layer.plane + 1], bias)
                    h = layer(h, t, memory_read, self.encoder_reads[i], masks[i],
                              states[i + 1, t] if pre_norm else None)
                elif pre_norm:
                    states[i + 1, t] = h
                outputs.append(h)
            if not pre_norm:
                torch.stack(outputs[1:], out=states[1:, t])
            m = self.mixing(t, memories[t])
            kv = self.kv_proj(m if self.memory_layer_norm is None else self.memory_layer_norm(m, t), t)
            slots[:, :, :, self.initial + t].view(self.memory_count, per_memory, bsz, self.num_heads,
                                                  self.head_dim).copy_(
                kv.view(self.memory_count, bsz, per_memory, self.num_heads, self.head_dim).transpose(1, 2))
        self.buffer.extend(slots[:, :, :, self.initial:].permute(3, 0, 1, 2, 4), self.span)  # a decoding cache reads them
        return states[-1], memories.view(len(memories), self.memory_count, bsz, -1)

    # --- backward -----------------------------------------------------------------------------------

    def read_by_backward(self) -> List[Optional[Tensor]]:
        """What the backward reads from outside the block, once the forward
        has run: its outputs' records (BlockRecords' states and memories),
        and the inputs it reads again (not x and the window: copied)."""
        inputs = self.inputs
        return [self.records.states, self.records.memories, inputs.encoder_kv, inputs.positions,
                inputs.mixing_weights, *inputs.span_biases, *inputs.parameters]

    def backward(self, output_grads: Optional[Tensor], outside_memory_grads: Optional[Tensor]) -> BlockInputs:
        """The gradients of the block's inputs, from those of the top layer's
        outputs and of the memory vectors (None: no gradient)."""
        states, slots, encoder_kv, mixing = self.records.states, self.records.slots, self.encoder_kv, self.mixing
        memories = self.records.memories
        _, tgt_len, bsz, _ = states.shape
        per_memory = self.plane_count // self.memory_count  # a memory's planes
        slot_grads = torch.zeros_like(slots)
        encoder_grads = None
        if encoder_kv is not None:  # a layer that LayerDrop left out reads none of it
            encoder_grads = torch.zeros_like(encoder_kv) if None in self.layers else torch.empty_like(encoder_kv)
        position_grads = None if self.positions is None else torch.zeros_like(self.positions)
        bias_grads = [None if b is None else torch.zeros_like(b) for b in self.span_biases]
        input_grads = torch.empty_like(states[0])
        windows = MemoryWindows(slots, slot_grads, self.initial, self.span, self.num_heads, self.positions, position_grads)
        top_layer = len(self.layers)
        for t in reversed(range(tgt_len)):
            # slot t's gradient is complete: every window reading it belongs to a later step
            kv_grad = self.kv_proj.output_grads.at(t, memories[t], per_memory * self.num_heads * self.head_dim)
            kv_grad.view(self.memory_count, bsz, per_memory, self.num_heads, self.head_dim).copy_(
                slot_grads[:, :, :, self.initial + t].view(self.memory_count, per_memory, bsz, self.num_heads,
                                                            self.head_dim).transpose(1, 2))
            if self.memory_layer_norm is None:
                memory_grad = self.kv_proj.backward(kv_grad, t, out=mixing.memory_grads.at(t, memories[t]))
            else:
                memory_grad = self.memory_layer_norm.backward(self.kv_proj.backward(
                    kv_grad, t, out=self.memory_layer_norm.output_grads.at(t, memories[t])), t)
                mixing.memory_grads.keep(t, memory_grad)
            if outside_memory_grads is not None:
                memory_grad += outside_memory_grads[t].reshape(memory_grad.shape)
            planes = windows.planes(t)
            keys = windows.keys(planes)
            masks = self.records.dropout.at(t)
            plane_grads, key_grads, overwrite = windows.grads(t)
            slots_read = planes[0].size(1)
            # the top layer's output: its own gradient, and its share of m_t
            top = self.layers[-1].output_grad_slot(t, input_grads[t]) if self.layers[-1] is not None else None
            grad = mixing.add_share(None if output_grads is None else output_grads[t], memory_grad, top_layer, top)
            for i in reversed(range(len(self.layers))):
                layer = self.layers[i]
                below = None if i == 0 or self.layers[i - 1] is None else self.layers[i - 1].output_grad_slot(t, grad)
                if layer is not None:
                    k = layer.plane // 2
                    bias = None if self.biases[i] is None else self.biases[i][..., -slots_read:]
                    bias_grad = None if bias_grads[i] is None else bias_grads[i][..., -slots_read:]
                    encoder_read = None if self.encoder_reads[i] is None else self.encoder_reads[i][:2]
                    grad = layer.backward(grad, t, (keys[k], planes[layer.plane + 1], bias),
                                          (key_grads[k], plane_grads[layer.plane + 1], bias_grad, overwrite[k]),
                                          encoder_read, masks[i])
                    overwrite[k] = False
                # the input's share of m_t, where the layer below records its output's gradient
                grad = mixing.add_share(grad, memory_grad, i, input_grads[t] if i == 0 else below)
            windows.finish_key_grads(plane_grads, key_grads, overwrite)
        if self.layers and self.layers[0] is not None:
            self.layers[0].block_queries_backward(input_grads)
        for layer, grads in zip(self.layers, [] if encoder_grads is None else encoder_grads.unbind()):
            if layer is not None:
                layer.encoder_attn.key_value_grads(*(g.view(-1, *g.shape[-2:]) for g in grads.unbind()))
        pieces = block_weighted(self.kv_proj, self.memory_layer_norm, self.layers)
        return BlockInputs(x=input_grads, encoder_kv=encoder_grads, positions=position_grads,
                           mixing_weights=mixing.weight_grads(), span_biases=tuple(bias_grads),
                           window=slot_grads[:, :, :, : self.initial].unbind(0),
                           parameters=tuple(g for piece in pieces for g in piece.weight_grads()))


class BlockFunction(torch.autograd.Function):
    """A FusedFeedbackLoop's block as one autograd node. `inputs`: its
    BlockInputs, flattened (the block holds them already), for autograd to
    route their gradients. What the backward reads from outside the block
    is saved for backward, only for autograd's check of its versions."""

    @staticmethod
    def forward(ctx, loop: FusedFeedbackLoop, *inputs):
        ctx.loop = loop
        ctx.set_materialize_grads(False)
        outputs = loop.forward()
        ctx.save_for_backward(*loop.read_by_backward())
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx, output_grads, memory_grads):
        if ctx.loop is None:
            raise RuntimeError("the fused feedback loop's backward ran twice over one block; its activations are "
                               "freed by the first (as autograd frees saved tensors without retain_graph)")
        ctx.saved_tensors  # unpacked for autograd's check: it raises if any was changed in place since the forward
        loop, ctx.loop = ctx.loop, None  # what the block kept for its backward goes with it
        return (None, *loop.inputs.flat_gradients(loop.backward(output_grads, memory_grads)))
