"""The feedback loop in few operators: one autograd Function per block, its
backward written by hand.

Run through autograd, every step records each operator (a node, saved
tensors, a gradient accumulation each), and each linear layer computes its
weight gradient at every step, a product of rank `rows` added to the sum so
far. Here a block of steps is one Function. Its backward is the chain rule
through each step's layers, written out:

    post-norm sublayer   r = x + d * f(x),   y = LN(r)
                         g_r = LN'(g_y),  g_x = g_r + f'(d * g_r)
    pre-norm sublayer    y = x + d * f(LN(x))
                         g_x = g_y + LN'(f'(d * g_y))

(d the dropout mask), where a linear layer's f' is one product whose
addition of the residual's gradient is free (addmm). What does not depend on
the step's gradient comes once per block: every linear layer's weight
gradient (dW = G^T X, one product over the block's steps), every layer
norm's (one native_layer_norm_backward over the block), the mixing weights'
(eq. 1), and the first layer's queries, which depend on the embeddings alone.

Attention reads one query row per sequence: scores, softmax and weighted
sum as three batched products. The fused scaled_dot_product_attention
kernel costs more than that at this size on the CPU (its backward, ten
times more), and its backward would hand back the keys' and values'
gradients to be added to the memory's: here the products that compute them
add them in place (baddbmm_).

Dropout masks are drawn once per block, one Bernoulli draw for every layer
and step, scaled beforehand: a residual with dropout is one addcmul. The
operators this leaves per step and layer, and why each stays, are listed in
the README's Speed section.

Options it does not cover (persistent vectors; attention dropout and
autocast in training; quant-noise and other hooks on a layer's modules;
activations other than relu and gelu) run the loop as before, through
autograd: `unsupported` says why, and the decoder logs it once.
"""

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from fairseq.modules import gelu as fairseq_gelu
from torch import Tensor
from torch.autograd.function import once_differentiable

from .key_value_buffer import KeyValueBuffer

ACTIVATIONS = {F.relu: "relu", fairseq_gelu: "gelu"}


def unsupported(layers: Sequence, grad: bool, device_type: str) -> Optional[str]:
    """Why the fused loop cannot run these layers (None: it can). `grad`:
    whether gradients are wanted."""
    if grad and torch.is_autocast_enabled(device_type):
        return "autocast (--amp) in training"
    for layer in layers:
        if layer is None:
            continue
        attn = layer.self_attn
        if attn.persistent_keys is not None:
            return "--persistent-vectors"
        if layer.training and (attn.dropout or (layer.encoder_attn is not None and layer.encoder_attn.dropout_module.p)):
            return "--attention-dropout"
        if layer.activation_fn not in ACTIVATIONS:
            return "an activation other than relu and gelu"
        if any(m._forward_pre_hooks or m._forward_hooks for m in layer.modules()):
            return "hooks on a layer's modules (--quant-noise-pq)"
        if any(m.apply_during_inference for m in (layer.dropout_module, layer.activation_dropout_module)):
            return "--retain-dropout"
    return None


# --- the pieces of a layer, each keeping what its backward and weight gradients need, by step ---------


class _Linear:
    """y = x W^T + b at each step; dW = G^T X and db = sum G once per block."""

    def __init__(self, module):
        self.weight, self.bias = module.weight, module.bias
        self.inputs: List[Tensor] = []
        self.output_grads: List[Tensor] = []

    def __call__(self, x: Tensor, record: bool) -> Tensor:
        if record:
            self.inputs.append(x)
        return torch.addmm(self.bias, x, self.weight.t())

    def backward(self, grad: Tensor, residual: Optional[Tensor] = None) -> Tensor:
        """The input's gradient, plus `residual` (in the same product)."""
        self.output_grads.append(grad)
        return torch.mm(grad, self.weight) if residual is None else torch.addmm(residual, grad, self.weight)

    def weight_grads(self) -> Tuple[Tensor, Tensor]:
        grads = torch.cat(self.output_grads[::-1])  # recorded backwards
        return torch.mm(grads.t(), torch.cat(self.inputs)), grads.sum(0)


class _Norm:
    """Layer norm at each step; its weight and bias gradients once per block."""

    def __init__(self, module):
        self.weight, self.bias, self.eps, self.shape = module.weight, module.bias, module.eps, module.normalized_shape
        self.inputs: List[Tensor] = []
        self.means: List[Tensor] = []
        self.rstds: List[Tensor] = []
        self.output_grads: List[Tensor] = []

    def __call__(self, x: Tensor, record: bool) -> Tensor:
        y, mean, rstd = torch.native_layer_norm(x, self.shape, self.weight, self.bias, self.eps)
        if record:
            self.inputs.append(x)
            self.means.append(mean)
            self.rstds.append(rstd)
        return y

    def backward(self, grad: Tensor, step: int) -> Tensor:
        self.output_grads.append(grad)
        return torch.ops.aten.native_layer_norm_backward(
            grad, self.inputs[step], self.shape, self.means[step], self.rstds[step], self.weight, self.bias,
            [True, False, False])[0]

    def weight_grads(self) -> Tuple[Tensor, Tensor]:
        _, weight, bias = torch.ops.aten.native_layer_norm_backward(
            torch.cat(self.output_grads[::-1]), torch.cat(self.inputs), self.shape, torch.cat(self.means),
            torch.cat(self.rstds), self.weight, self.bias, [False, True, True])
        return weight, bias


def _heads(x: Tensor, heads: int, groups: int) -> Tensor:
    """[rows, heads * head_dim] -> [sequences * heads, groups, head_dim]:
    `groups` consecutive rows (beam hypotheses) share one sequence's keys."""
    rows = x.size(0)
    return x.view(rows // groups, groups, heads, -1).transpose(1, 2).reshape(rows // groups * heads, groups, -1)


def _merge(a: Tensor, heads: int, groups: int) -> Tensor:
    """The inverse of _heads."""
    return a.view(-1, heads, groups, a.size(-1)).transpose(1, 2).reshape(-1, heads * a.size(-1))



class _Attention:
    """softmax(q k^T / sqrt(d_head) + bias) v for one query row per sequence
    (or per beam hypothesis), between a query and an output projection."""

    def __init__(self, q_proj, out_proj, heads: int, head_dim: int):
        self.q, self.out = _Linear(q_proj), _Linear(out_proj)
        self.heads, self.scale = heads, head_dim**-0.5
        self.queries: List[Tensor] = []  # [sequences * heads, 1, head_dim], by step
        self.probs: List[Tensor] = []
        self.nothing: Optional[Tensor] = None  # what a product with beta=0 adds to

    def _nothing(self, like: Tensor) -> Tensor:
        if self.nothing is None:
            self.nothing = like.new_empty(())
        return self.nothing

    def __call__(self, q: Tensor, keys: Tensor, values: Tensor, bias: Optional[Tensor], groups: int,
                 record: bool) -> Tensor:
        """q: the projected queries [rows, heads * head_dim]; keys, values
        [sequences * heads, slots, head_dim]; bias broadcasting to the scores
        [sequences * heads, groups, slots]."""
        q = _heads(q, self.heads, groups)
        if bias is None:
            scores = torch.baddbmm(self._nothing(q), q, keys.transpose(1, 2), beta=0, alpha=self.scale)
        else:
            scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=self.scale)
        probs = torch.softmax(scores, -1)
        if record:
            self.queries.append(q)
            self.probs.append(probs)
        return self.out(_merge(torch.bmm(probs, values), self.heads, groups), record)

    def backward(self, grad: Tensor, step: int, keys: Tensor, values: Tensor, key_grads: Optional[Tensor],
                 value_grads: Tensor, bias_grads: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """The gradient of the projected queries (one row per sequence, as
        in training). The keys', values' and bias' gradients are added into
        `key_grads` (None: a new tensor, returned), `value_grads` and `bias_grads`."""
        q, probs = self.queries[step], self.probs[step]
        attended = self.out.backward(grad).view(q.shape)
        scores = torch._softmax_backward_data(torch.bmm(attended, values.transpose(1, 2)), probs, -1, probs.dtype)
        value_grads.baddbmm_(probs.transpose(1, 2), attended)
        if key_grads is None:
            key_grads = torch.baddbmm(self._nothing(q), scores.transpose(1, 2), q, beta=0, alpha=self.scale)
        else:
            key_grads.baddbmm_(scores.transpose(1, 2), q, alpha=self.scale)
        if bias_grads is not None:  # [heads, 1, slots]
            bias_grads += scores.view(-1, *bias_grads.shape).sum(0)
        queries = torch.baddbmm(self._nothing(q), scores, keys, beta=0, alpha=self.scale)
        return queries.view(grad.size(0), -1), key_grads


class _Layer:
    """A MemoryDecoderLayer at each step of a block: attention over the
    memory, over the encoder, and the feed-forward block, each a residual
    sublayer with dropout, pre- or post-norm."""

    def __init__(self, layer, plane: int):
        self.pre_norm = layer.normalize_before
        self.plane = plane  # its keys' plane among the memory's slots
        attn = layer.self_attn
        self.attention = _Attention(attn.q_proj, attn.out_proj, attn.num_heads, attn.head_dim)
        self.attention_norm = _Norm(layer.self_attn_layer_norm)
        self.modules = [attn.q_proj, attn.out_proj, layer.self_attn_layer_norm]
        self.cross = self.cross_norm = self.fc1 = None
        if layer.encoder_attn is not None:
            ea = layer.encoder_attn
            self.cross = _Attention(ea.q_proj, ea.out_proj, ea.num_heads, ea.head_dim)
            self.cross_norm = _Norm(layer.encoder_attn_layer_norm)
            self.modules += [ea.q_proj, ea.out_proj, layer.encoder_attn_layer_norm]
        if layer.fc1 is not None:
            self.fc1, self.fc2, self.ffn_norm = _Linear(layer.fc1), _Linear(layer.fc2), _Norm(layer.final_layer_norm)
            self.activation = ACTIVATIONS[layer.activation_fn]
            self.activation_saved: List[Tensor] = []  # relu's output, gelu's input, by step
            self.modules += [layer.fc1, layer.fc2, layer.final_layer_norm]
        self.sublayers = len(self.modules) // 3
        self.dropout = layer.dropout_module.p if layer.training else 0.0
        self.activation_dropout = layer.activation_dropout_module.p if layer.training and self.fc1 else 0.0
        self.block_queries: Optional[Tensor] = None  # [steps, rows, embed]: the first layer's, once per block

    def parameters(self) -> List[Tensor]:
        return [p for module in self.modules for p in (module.weight, module.bias)]

    def pieces(self) -> list:
        """What holds the weights, in the order of `parameters`."""
        pieces = [self.attention.q, self.attention.out, self.attention_norm]
        if self.cross is not None:
            pieces += [self.cross.q, self.cross.out, self.cross_norm]
        if self.fc1 is not None:
            pieces += [self.fc1, self.fc2, self.ffn_norm]
        return pieces

    # --- once per block: the first layer's queries --------------------------------------------------

    def project_block_queries(self, x: Tensor, record: bool) -> None:
        """The queries of every step at once, from x [steps, rows, embed],
        the embeddings (the first layer's input)."""
        flat = x.reshape(-1, x.size(-1))
        if self.pre_norm:
            flat = self.attention_norm(flat, record)
        self.block_queries = self.attention.q(flat, record).view(x.size(0), x.size(1), -1)

    def block_queries_backward(self, input_grads: Tensor) -> None:
        """Adds what the block's queries give the embeddings' gradient, input_grads [steps, rows, embed]."""
        q = self.attention.q
        q.output_grads = [torch.cat(q.output_grads[::-1])]  # kept for its weight gradient
        flat = input_grads.view(-1, input_grads.size(-1))
        if self.pre_norm:
            flat += self.attention_norm.backward(torch.mm(q.output_grads[0], q.weight), 0)
        else:
            flat.addmm_(q.output_grads[0], q.weight)

    # --- a step ---------------------------------------------------------------------------------------

    def __call__(self, step: int, x: Tensor, memory: Tuple[Tensor, Tensor, Optional[Tensor]],
                 encoder: Optional[Tuple[Tensor, Tensor, Optional[Tensor], int]], masks: Optional[Tensor],
                 activation_mask: Optional[Tensor], record: bool) -> Tensor:
        """The layer at one step: x [rows, embed]; memory (keys, values,
        bias) and encoder (keys, values, bias, rows per sequence) as
        _Attention takes them; masks [sublayers, rows, embed], scaled."""
        attention = self.attention

        def self_attention(h):
            q = self.block_queries[step] if self.block_queries is not None else attention.q(h, record)
            return attention(q, *memory, 1, record)

        x = self._sublayer(x, self.attention_norm, self_attention, masks, 0, record, self.block_queries is not None)
        if self.cross is not None:
            keys, values, bias, groups = encoder
            x = self._sublayer(x, self.cross_norm, lambda h: self.cross(self.cross.q(h, record), keys, values, bias,
                                                                       groups, record), masks, 1, record)
        if self.fc1 is not None:
            x = self._sublayer(x, self.ffn_norm, lambda h: self._feed_forward(h, activation_mask, record), masks,
                               self.sublayers - 1, record)
        return x

    def _sublayer(self, x, norm, branch, masks, site, record, normalized_beforehand=False):
        mask = None if masks is None else masks[site]
        if self.pre_norm:
            out = branch(None if normalized_beforehand else norm(x, record))
            return x + out if mask is None else torch.addcmul(x, out, mask)
        out = branch(x)
        return norm(x + out if mask is None else torch.addcmul(x, out, mask), record)

    def _feed_forward(self, x, mask, record):
        hidden = self.fc1(x, record)
        activated = torch.relu(hidden) if self.activation == "relu" else F.gelu(hidden)
        if record:
            self.activation_saved.append(activated if self.activation == "relu" else hidden)
        if mask is not None:
            activated = activated * mask
        return self.fc2(activated, record)

    def backward(self, step: int, grad: Tensor, memory: Tuple[Tensor, Tensor],
                 memory_grads: Tuple[Optional[Tensor], Tensor, Optional[Tensor]],
                 encoder: Optional[Tuple[Tensor, Tensor]], encoder_grads: Optional[Tuple[Tensor, Tensor]],
                 masks: Optional[Tensor], activation_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """The gradient of the step's input from that of its output. The
        memory's (keys, values, bias) and the encoder's (keys, values)
        gradients are added into theirs; the keys' is returned (see
        _Attention.backward)."""
        key_grads, value_grads, bias_grads = memory_grads
        if self.fc1 is not None:
            grad = self._sublayer_backward(
                step, grad, self.ffn_norm,
                lambda g, residual: self._feed_forward_backward(step, g, activation_mask, residual),
                masks, self.sublayers - 1)
        if self.cross is not None:
            def cross_attention(g, residual):
                queries, _ = self.cross.backward(g, step, *encoder, *encoder_grads)
                return self.cross.q.backward(queries, residual)

            grad = self._sublayer_backward(step, grad, self.cross_norm, cross_attention, masks, 1)

        def self_attention(g, residual):
            nonlocal key_grads
            queries, key_grads = self.attention.backward(g, step, *memory, key_grads, value_grads, bias_grads)
            if self.block_queries is not None:  # their input's gradient comes once per block
                self.attention.q.output_grads.append(queries)
                return residual
            return self.attention.q.backward(queries, residual)

        grad = self._sublayer_backward(step, grad, self.attention_norm, self_attention, masks, 0,
                                       self.block_queries is not None)
        return grad, key_grads

    def _sublayer_backward(self, step, grad, norm, branch_backward, masks, site, normalized_beforehand=False):
        mask = None if masks is None else masks[site]
        if self.pre_norm:
            inner = branch_backward(grad if mask is None else grad * mask, None)
            return grad if normalized_beforehand else grad + norm.backward(inner, step)
        grad = norm.backward(grad, step)
        return branch_backward(grad if mask is None else grad * mask, grad)

    def _feed_forward_backward(self, step, grad, mask, residual):
        hidden = self.fc2.backward(grad)
        if mask is not None:
            hidden = hidden * mask
        saved = self.activation_saved[step]
        if self.activation == "relu":
            hidden = torch.ops.aten.threshold_backward(hidden, saved, 0)
        else:
            hidden = torch.ops.aten.gelu_backward(hidden, saved)
        return self.fc1.backward(hidden, residual)


def _per_row(bias: Optional[Tensor], rows: int) -> Optional[Tensor]:
    """A bias on the scores, [heads or 1, queries, slots], as the scores of
    `rows` sequences take it: [rows * heads or 1, queries, slots]."""
    if bias is None or bias.size(0) == 1:
        return bias
    return bias.expand(rows, *bias.shape).reshape(-1, *bias.shape[1:])


def _encoder(encoder_kv: Sequence[Optional[Tuple[Tensor, Tensor]]], encoder_bias: Optional[Tensor], rows: int):
    """Each layer's encoder (keys, values) [sequences, heads, src_len,
    head_dim] as _Attention takes them, with the mask [sequences, 1, 1,
    src_len] (None: no padding), expanded once for all layers, and the
    rows per sequence."""
    present = [kv for kv in encoder_kv if kv is not None]
    if not present:
        return list(encoder_kv)
    sequences, heads, src_len, head_dim = present[0][0].shape
    bias = None if encoder_bias is None else encoder_bias.expand(sequences, heads, 1, src_len).reshape(-1, 1, src_len)
    return [None if kv is None else (kv[0].view(-1, src_len, head_dim), kv[1].view(-1, src_len, head_dim), bias,
                                     rows // sequences) for kv in encoder_kv]


def step(x: Tensor, views: Sequence, layers: Sequence, encoder_kv: Sequence, encoder_bias: Optional[Tensor]):
    """FeedbackDecoder.feedback_step's layers, without gradients: the top
    layer's output and the states that eq. 1 mixes."""
    states, rows = [x], x.size(0)
    for layer, view, encoder in zip(layers, views, _encoder(encoder_kv, encoder_bias, rows)):
        if layer is not None:
            memory = (view.keys.flatten(0, 1), view.values.flatten(0, 1), _per_row(view.bias, rows))
            x = _Layer(layer, 0)(0, x, memory, encoder, None, None, record=False)
        states.append(x)
    return x, states


# --- a block ------------------------------------------------------------------------------------------


class FusedFeedbackLoop:
    """FeedbackDecoder.feedback_loop for one block, as one autograd Function.

    `buffer`, `window`, `span`, `layers`: as feedback_loop takes them (the
    memory's key/value slots, the window that step 0 reads, the slots a
    step reads at most); `positions`: the relative positions of a full
    window [span, head_dim], or None; `span_biases`: each layer's adaptive
    span, log m(e) of a full window [heads, 1, span], or None; `weights`:
    the mixing weights of eq. 1."""

    def __init__(self, decoder, buffer: KeyValueBuffer, window: Tuple[Tensor, ...], span: int, layers: Sequence,
                 positions: Optional[Tensor], span_biases: Sequence[Optional[Tensor]], weights: Tensor):
        memory = decoder.memory
        self.buffer, self.window, self.span = buffer, window, span
        self.planes, self.heads, self.head_dim = memory.planes, memory.num_heads, memory.head_dim
        self.kv_proj = _Linear(memory.kv_proj)
        self.memory_norm = None if memory.layer_norm is None else _Norm(memory.layer_norm)
        self.layers = [None if layer is None else _Layer(layer, 0 if memory.shared_kv else 2 * i)
                       for i, layer in enumerate(layers)]
        self.present = [layer for layer in self.layers if layer is not None]
        self.positions, self.weights = positions, weights
        self.span_biases = list(span_biases)
        self.parameters = [memory.kv_proj.weight, memory.kv_proj.bias]
        if memory.layer_norm is not None:
            self.parameters += [memory.layer_norm.weight, memory.layer_norm.bias]
        self.parameters += [p for layer in self.present for p in layer.parameters()]
        self.encoder_bias: Optional[Tensor] = None

    def __call__(self, x: Tensor, encoder_kv: Optional[Tensor], encoder_bias: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """The top layer's outputs and the memory vectors, [steps, rows, embed] each."""
        inputs = [x, encoder_kv, self.positions, self.weights, *self.span_biases, *self.window, *self.parameters]
        self.encoder_bias = encoder_bias
        if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in inputs):
            return self.forward(x, encoder_kv, record=False)
        return _BlockFunction.apply(self, *inputs)

    def _windows(self, slots: Tensor, filled: int) -> List[Tensor]:
        """The last `span` of the `filled` slots, one [rows * heads, slots, head_dim] view per plane."""
        window = slots[max(0, filled - self.span): filled]
        return [plane.permute(1, 2, 0, 3).flatten(0, 1) for plane in window.unbind(1)]

    def _keys(self, planes: List[Tensor]) -> List[Tensor]:
        """The keys of each projection in a window, with relative positions: k_j + p[S - 1 - e]."""
        keys = planes[0::2]
        if self.positions is None:
            return keys
        return [(k.view(-1, self.heads, *k.shape[1:]) + self.positions[-k.size(1):]).flatten(0, 1) for k in keys]

    # --- forward ------------------------------------------------------------------------------------

    def _draw_masks(self, x: Tensor) -> None:
        """Every dropout mask of the block in one draw, scaled by 1 / (1 - p)."""
        steps, rows, embed = x.shape
        first = self.present[0] if self.present else None
        self.masks = self.activation_masks = None
        if first is not None and first.dropout:
            keep = 1 - first.dropout
            shape = (steps, len(self.layers), first.sublayers, rows, embed)
            self.masks = x.new_empty(shape).bernoulli_(keep).div_(keep)
        if first is not None and first.activation_dropout:
            keep = 1 - first.activation_dropout
            shape = (steps, len(self.layers), rows, first.fc1.weight.size(0))
            self.activation_masks = x.new_empty(shape).bernoulli_(keep).div_(keep)

    def _masks(self, step: int, layer: int):
        return (None if self.masks is None else self.masks[step, layer],
                None if self.activation_masks is None else self.activation_masks[step, layer])

    def forward(self, x: Tensor, encoder_kv: Optional[Tensor], record: bool) -> Tuple[Tensor, Tensor]:
        steps, rows, embed = x.shape
        buffer = self.buffer
        if buffer.length + steps > buffer.capacity:
            buffer._make_room(steps, self.span)
        self.start = buffer.length  # the first new slot
        slots = buffer.slots.data  # written in place: no version bump for views saved earlier
        per_layer = [None] * len(self.layers) if encoder_kv is None else [kv.unbind() for kv in encoder_kv.unbind()]
        self.encoder = encoder = _encoder(per_layer, self.encoder_bias, rows)
        biases = [None if b is None else _per_row(b, rows) for b in self.span_biases]
        self._draw_masks(x)
        if self.layers and self.layers[0] is not None:
            self.layers[0].project_block_queries(x, record)
        self.states = x.new_empty(steps, len(self.layers) + 1, rows, embed)  # x_t^0 .. x_t^L (eq. 1)
        memories = x.new_empty(steps, rows, embed)
        for t, h in enumerate(x.unbind(0)):
            planes = self._windows(slots, self.start + t)
            keys = self._keys(planes)
            states = [h]
            for i, layer in enumerate(self.layers):
                if layer is not None:
                    bias = None if biases[i] is None else biases[i][..., -planes[0].size(1):]
                    memory = (keys[layer.plane // 2], planes[layer.plane + 1], bias)
                    h = layer(t, h, memory, encoder[i], *self._masks(t, i), record)
                states.append(h)
            torch.stack(states, out=self.states[t])
            m = torch.mm(self.weights[None], self.states[t].view(len(states), -1), out=memories[t].view(1, -1))
            m = m.view(rows, embed)
            kv = self.kv_proj(m if self.memory_norm is None else self.memory_norm(m, record), record)
            slots[self.start + t].copy_(kv.view(rows, self.planes, self.heads, self.head_dim).transpose(0, 1))
        buffer.length = self.start + steps
        return self.states[:, -1], memories

    # --- backward -----------------------------------------------------------------------------------

    def backward(self, output_grads: Optional[Tensor], memory_grads: Optional[Tensor], encoder_kv: Optional[Tensor]):
        """The gradients of _BlockFunction's inputs."""
        pieces = [self.kv_proj, *([] if self.memory_norm is None else [self.memory_norm]),
                  *(piece for layer in self.present for piece in layer.pieces())]
        slots = self.buffer.slots.data
        steps, _, rows, embed = self.states.shape
        slot_grads = torch.zeros_like(slots[: self.start + steps])
        encoder_grads = None if encoder_kv is None else torch.zeros_like(encoder_kv)
        encoder_views = [None] * len(self.layers) if encoder_grads is None else [
            tuple(g.view(-1, *g.shape[-2:]) for g in kv.unbind()) for kv in encoder_grads.unbind()]
        position_grads = None if self.positions is None else torch.zeros_like(self.positions)
        bias_grads = [None if b is None else torch.zeros_like(b) for b in self.span_biases]
        input_grads = torch.empty_like(self.states[:, 0])
        mixing_grads = []
        weights = self.weights.unbind()
        for t in reversed(range(steps)):
            # slot t's gradient is complete: every window reading it belongs to a later step
            kv_grad = slot_grads[self.start + t].transpose(0, 1).reshape(rows, -1)
            memory_grad = self.kv_proj.backward(kv_grad)
            if self.memory_norm is not None:
                memory_grad = self.memory_norm.backward(memory_grad, t)
            if memory_grads is not None:
                memory_grad = memory_grad + memory_grads[t]
            mixing_grads.append(memory_grad)
            # the top layer's output: its own gradient and its share of m_t
            if output_grads is None:
                grad = memory_grad * weights[-1]
            else:
                grad = torch.addcmul(output_grads[t], memory_grad, weights[-1])
            planes = self._windows(slots, self.start + t)
            keys = self._keys(planes)
            plane_grads = self._windows(slot_grads, self.start + t)
            # with positions, the keys' gradient goes to the slots and to the positions: summed over layers first
            key_grads = [None if self.positions is not None else g for g in plane_grads[0::2]]
            slots_read = planes[0].size(1)
            for i in reversed(range(len(self.layers))):
                layer = self.layers[i]
                if layer is not None:
                    k = layer.plane // 2
                    encoder = None if self.encoder[i] is None else self.encoder[i][:2]
                    bias = None if bias_grads[i] is None else bias_grads[i][..., -slots_read:]
                    grad, key_grads[k] = layer.backward(
                        t, grad, (keys[k], planes[layer.plane + 1]), (key_grads[k], plane_grads[layer.plane + 1], bias),
                        encoder, encoder_views[i], *self._masks(t, i))
                grad = torch.addcmul(grad, memory_grad, weights[i], out=input_grads[t] if i == 0 else None)
            if self.positions is not None:
                for plane, summed in zip(plane_grads[0::2], key_grads):
                    if summed is not None:
                        plane += summed
                        position_grads[-slots_read:] += summed.sum(0)
        if self.layers and self.layers[0] is not None:
            self.layers[0].block_queries_backward(input_grads)
        mixing = torch.stack(mixing_grads[::-1]).view(steps, -1, 1)
        weight_grads = torch.bmm(self.states.view(steps, self.states.size(1), -1), mixing).sum(0).view(-1)
        window_grads = slot_grads[self.start - self.window[0].size(2): self.start].permute(1, 2, 3, 0, 4).unbind(0)
        parameter_grads = [g for piece in pieces for g in piece.weight_grads()]
        return (input_grads, encoder_grads, position_grads, weight_grads, *bias_grads, *window_grads,
                *parameter_grads)


class _BlockFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loop: FusedFeedbackLoop, x, encoder_kv, *unused):
        ctx.loop, ctx.encoder_kv = loop, encoder_kv
        ctx.set_materialize_grads(False)
        return loop.forward(x, encoder_kv, record=True)

    @staticmethod
    @once_differentiable
    def backward(ctx, output_grads, memory_grads):
        if ctx.loop is None:
            raise RuntimeError("the fused feedback loop's backward ran twice over one block; its activations are "
                               "freed by the first (as autograd frees saved tensors without retain_graph)")
        loop, ctx.loop = ctx.loop, None  # what the block kept for its backward goes with it
        return (None, *loop.backward(output_grads, memory_grads, ctx.encoder_kv))
