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
(eq. 1), the encoder's keys' and values' (one product each), and the first
layer's queries, which depend on the embeddings alone. What those products
read is written in place, step by step, into tensors of the whole block
(out=), wherever the operator that makes it can write there.

Attention reads one query row per sequence: scores, softmax and weighted
sum as three batched products. The fused scaled_dot_product_attention
kernel costs more than that at this size on the CPU (its backward, ten
times more). A step's gradients of the memory's keys and values are outer
products, added in place into the memory's gradient. Attention weights are
kept for the backward when they take no more room than the step's
feed-forward activations (heads x span <= embed + ffn), and computed again
otherwise (long spans).

Dropout masks are drawn once per block, one Bernoulli draw for every layer
and step, scaled beforehand: a residual with dropout is one addcmul.

Options it does not cover (persistent vectors; attention dropout in
training; autocast; quant-noise and other hooks on a layer's modules;
activations other than relu and gelu) run the loop as before, through
autograd: `unsupported` says why, and the decoder logs it once.
"""

from typing import Dict, List, Optional, Sequence, Tuple

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
    if torch.is_autocast_enabled(device_type):
        return "autocast (--amp)"
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


class _Steps:
    """A tensor per step of a block, [rows, features] each, and all of them
    as one [steps * rows, features] matrix for a block's product. An
    operator that can write its output in place writes into one tensor of
    the whole block (`at`); other outputs are kept (`keep`) and
    concatenated once."""

    def __init__(self, steps: int):
        self.steps = steps
        self.block: Optional[Tensor] = None  # [steps, rows, features]
        self.kept: Dict[int, Tensor] = {}

    def write_into(self, block: Tensor) -> None:
        """Records are this block tensor's steps (written by someone else)."""
        self.block, self.kept = block, dict(enumerate(block.unbind(0)))  # each step's view, made once

    def at(self, step: int, like: Tensor, features: Optional[int] = None) -> Tensor:
        """Where step `step` writes its [rows, features]: like's rows, and its features by default."""
        if self.block is None:
            self.write_into(like.new_empty(self.steps, like.size(0), like.size(-1) if features is None else features))
        return self.kept[step]

    def keep(self, step: int, tensor: Tensor) -> None:
        if self.block is None:  # otherwise written in place already
            self.kept[step] = tensor

    def __getitem__(self, step: int) -> Tensor:
        return self.kept[step]

    def joined(self) -> Tensor:
        if self.block is None:
            return torch.cat([self.kept[t] for t in range(self.steps)])
        return self.block.view(-1, self.block.size(-1))


class _Linear:
    """y = scale (x W^T + b) at each step (attention's queries come scaled
    by 1 / sqrt(d_head), for free); dW and db once per block."""

    def __init__(self, module, steps: int, scale: float = 1.0):
        self.weight, self.bias, self.scale = module.weight, module.bias, scale
        self.inputs, self.output_grads = _Steps(steps), _Steps(steps)
        self.nothing: Optional[Tensor] = None  # what a product with beta=0 adds to

    def __call__(self, x: Tensor, step: int, record: bool, out: Optional[Tensor] = None) -> Tensor:
        if record:
            self.inputs.keep(step, x)
        return torch.addmm(self.bias, x, self.weight.t(), beta=self.scale, alpha=self.scale, out=out)

    def backward(self, grad: Tensor, step: int, residual: Optional[Tensor] = None,
                 out: Optional[Tensor] = None) -> Tensor:
        """The input's gradient, plus `residual` (in the same product)."""
        self.output_grads.keep(step, grad)
        if residual is None:
            return self.product(grad, self.weight, out)
        return torch.addmm(residual, grad, self.weight, alpha=self.scale, out=out)

    def product(self, a: Tensor, b: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """scale (a b)."""
        if self.scale == 1:
            return torch.mm(a, b, out=out)
        if self.nothing is None:
            self.nothing = a.new_empty(())
        return torch.addmm(self.nothing, a, b, beta=0, alpha=self.scale, out=out)

    def weight_grads(self) -> List[Tensor]:
        grads = self.output_grads.joined()
        bias = grads.sum(0)
        return [self.product(grads.t(), self.inputs.joined()), bias if self.scale == 1 else bias.mul_(self.scale)]


class _Norm:
    """Layer norm at each step; its weight and bias gradients once per block."""

    def __init__(self, module, steps: int):
        self.weight, self.bias, self.eps, self.shape = module.weight, module.bias, module.eps, module.normalized_shape
        self.inputs, self.output_grads = _Steps(steps), _Steps(steps)
        self.means: Dict[int, Tensor] = {}
        self.rstds: Dict[int, Tensor] = {}

    def __call__(self, x: Tensor, step: int, record: bool) -> Tensor:
        y, mean, rstd = torch.native_layer_norm(x, self.shape, self.weight, self.bias, self.eps)
        if record:
            self.inputs.keep(step, x)
            self.means[step], self.rstds[step] = mean, rstd
        return y

    def backward(self, grad: Tensor, step: int) -> Tensor:
        self.output_grads.keep(step, grad)
        return torch.ops.aten.native_layer_norm_backward(
            grad, self.inputs[step], self.shape, self.means[step], self.rstds[step], self.weight, self.bias,
            [True, False, False])[0]

    def weight_grads(self) -> List[Tensor]:
        steps = range(self.inputs.steps)
        _, weight, bias = torch.ops.aten.native_layer_norm_backward(
            self.output_grads.joined(), self.inputs.joined(), self.shape, torch.cat([self.means[t] for t in steps]),
            torch.cat([self.rstds[t] for t in steps]), self.weight, self.bias, [False, True, True])
        return [weight, bias]


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

    def __init__(self, q_proj, out_proj, heads: int, head_dim: int, steps: int, keep_probs: bool = True):
        self.q, self.out = _Linear(q_proj, steps, head_dim**-0.5), _Linear(out_proj, steps)
        self.heads, self.keep_probs, self.groups = heads, keep_probs, 1
        self.queries: Dict[int, Tensor] = {}  # [sequences * heads, rows per sequence, head_dim], by step
        self.probs: Dict[int, Tensor] = {}
        self.score_grads: Dict[int, Tensor] = {}  # for key_value_grads
        self.attended_grads: Dict[int, Tensor] = {}

    @staticmethod
    def _scores(q: Tensor, keys: Tensor, bias: Optional[Tensor]) -> Tensor:
        return torch.bmm(q, keys.transpose(1, 2)) if bias is None else torch.baddbmm(bias, q, keys.transpose(1, 2))

    def __call__(self, q: Tensor, keys: Tensor, values: Tensor, bias: Optional[Tensor], groups: int, step: int,
                 record: bool) -> Tensor:
        """q: the projected queries [rows, heads * head_dim]; keys, values
        [sequences * heads, slots, head_dim]; bias broadcasting to the scores
        [sequences * heads, groups, slots]; `groups` rows per sequence (beam
        hypotheses that share the encoder's keys: 1 for the memory's)."""
        q = _heads(q, self.heads, groups)
        probs = torch.softmax(self._scores(q, keys, bias), -1)
        if record:
            self.queries[step], self.groups = q, groups
            if self.keep_probs:
                self.probs[step] = probs
        if not record or groups > 1:
            return self.out(_merge(torch.bmm(probs, values), self.heads, groups), step, record)
        attended = self.out.inputs.at(step, q.view(-1, self.heads * q.size(-1)))  # one query row per sequence
        torch.bmm(probs, values, out=attended.view(q.shape))
        return self.out(attended, step, record)

    def backward(self, grad: Tensor, step: int, keys: Tensor, values: Tensor, bias: Optional[Tensor] = None,
                 key_grads: Optional[Tensor] = None, value_grads: Optional[Tensor] = None,
                 bias_grads: Optional[Tensor] = None, overwrite_key_grads: bool = False) -> Tensor:
        """The gradient of the projected queries, in self.q's records. The
        keys', values' and bias' gradients are added into `key_grads` (or
        written there), `value_grads` and `bias_grads`, for one query row per
        sequence (the memory's); with no `key_grads`, they come once per block
        (key_value_grads)."""
        q = self.queries[step]
        probs = self.probs[step] if self.keep_probs else torch.softmax(self._scores(q, keys, bias), -1)
        attended = _heads(self.out.backward(grad, step), self.heads, self.groups)
        scores = torch._softmax_backward_data(torch.bmm(attended, values.transpose(1, 2)), probs, -1, probs.dtype)
        if key_grads is None:
            self.score_grads[step], self.attended_grads[step] = scores, attended
        else:
            # with one query row, the keys' and values' gradients are outer
            # products: elementwise (a batched product of inner size 1 runs row by row)
            value_grads.addcmul_(probs.transpose(1, 2), attended)
            if overwrite_key_grads:
                torch.mul(scores.transpose(1, 2), q, out=key_grads)
            else:
                key_grads.addcmul_(scores.transpose(1, 2), q)
        if bias_grads is not None:  # [heads, 1, slots]
            bias_grads += scores.view(-1, *bias_grads.shape).sum(0)
        if self.groups > 1:
            return _merge(torch.bmm(scores, keys), self.heads, self.groups)
        queries = self.q.output_grads.at(step, grad, q.size(-1) * self.heads)
        torch.bmm(scores, keys, out=queries.view(q.shape))
        return queries

    def key_value_grads(self, key_grads: Tensor, value_grads: Tensor) -> None:
        """Keys and values that every step reads (the encoder's): their
        gradients over the block, one product each, written into `key_grads`
        and `value_grads` [sequences * heads, slots, head_dim]."""
        steps = range(len(self.queries))

        def joined(by_step):
            return torch.cat([by_step[t] for t in steps], 1)

        torch.bmm(joined(self.score_grads).transpose(1, 2), joined(self.queries), out=key_grads)
        torch.bmm(joined(self.probs).transpose(1, 2), joined(self.attended_grads), out=value_grads)


class _Layer:
    """A MemoryDecoderLayer at each step of a block: attention over the
    memory, over the encoder, and the feed-forward block, each a residual
    sublayer with dropout, pre- or post-norm. `first`: its queries come
    once per block (project_block_queries)."""

    def __init__(self, layer, plane: int, steps: int = 1, first: bool = False, keep_probs: bool = True):
        self.pre_norm, self.first = layer.normalize_before, first
        self.plane = plane  # its keys' plane among the memory's slots
        attn = layer.self_attn
        self.attention = _Attention(attn.q_proj, attn.out_proj, attn.num_heads, attn.head_dim, steps, keep_probs)
        # the first layer's pre-norm comes once per block: one record
        self.attention_norm = _Norm(layer.self_attn_layer_norm, 1 if first and self.pre_norm else steps)
        self.sublayers = [(self.attention_norm, self.attention.out)]
        self.pieces = [self.attention.q, self.attention.out, self.attention_norm]
        self.cross = self.fc1 = None
        if layer.encoder_attn is not None:
            ea = layer.encoder_attn
            self.cross = _Attention(ea.q_proj, ea.out_proj, ea.num_heads, ea.head_dim, steps)
            self.cross_norm = _Norm(layer.encoder_attn_layer_norm, steps)
            self.sublayers.append((self.cross_norm, self.cross.out))
            self.pieces += [self.cross.q, self.cross.out, self.cross_norm]
        if layer.fc1 is not None:
            self.fc1, self.fc2 = _Linear(layer.fc1, steps), _Linear(layer.fc2, steps)
            self.ffn_norm = _Norm(layer.final_layer_norm, steps)
            self.activation = ACTIVATIONS[layer.activation_fn]
            self.activation_saved: Dict[int, Tensor] = {}  # relu's output, gelu's input
            self.sublayers.append((self.ffn_norm, self.fc2))
            self.pieces += [self.fc1, self.fc2, self.ffn_norm]
        self.dropout = layer.dropout_module.p if layer.training else 0.0
        self.activation_dropout = layer.activation_dropout_module.p if layer.training and self.fc1 else 0.0
        self.block_queries: Optional[Tensor] = None  # [steps, rows, embed]

    @staticmethod
    def weighted_modules(layer) -> list:
        """A MemoryDecoderLayer's modules with a weight and a bias, in the order of _Layer.pieces."""
        modules = [layer.self_attn.q_proj, layer.self_attn.out_proj, layer.self_attn_layer_norm]
        if layer.encoder_attn is not None:
            modules += [layer.encoder_attn.q_proj, layer.encoder_attn.out_proj, layer.encoder_attn_layer_norm]
        if layer.fc1 is not None:
            modules += [layer.fc1, layer.fc2, layer.final_layer_norm]
        return modules

    def weight_grads(self) -> List[Tensor]:
        """The gradients of weighted_modules' weights and biases, in order."""
        return [g for piece in self.pieces for g in piece.weight_grads()]

    def read_inputs_from(self, states: Tensor) -> None:
        """The layer's inputs, [steps, rows, embed], as what reads them
        records them (the first layer's queries record theirs)."""
        if not self.first:
            (self.attention_norm if self.pre_norm else self.attention.q).inputs.write_into(states)

    def output_grad_slot(self, step: int, like: Tensor) -> Optional[Tensor]:
        """Where the gradient of the step's output goes (post-norm: the last norm's records)."""
        return None if self.pre_norm else self.sublayers[-1][0].output_grads.at(step, like)

    # --- once per block: the first layer's queries --------------------------------------------------

    def project_block_queries(self, x: Tensor, record: bool) -> None:
        """The queries of every step at once, from x [steps, rows, embed],
        the embeddings (the first layer's input)."""
        flat = x.view(-1, x.size(-1))
        if self.pre_norm:
            flat = self.attention_norm(flat, 0, record)
        if record:
            self.attention.q.inputs.write_into(flat.view(x.shape))
        self.block_queries = self.attention.q(flat, 0, False).view(*x.shape[:2], -1)

    def block_queries_backward(self, input_grads: Tensor) -> None:
        """Adds what the block's queries give the embeddings' gradient, input_grads [steps, rows, embed]."""
        q = self.attention.q
        grads, flat = q.output_grads.joined(), input_grads.view(-1, input_grads.size(-1))
        if self.pre_norm:
            flat += self.attention_norm.backward(q.product(grads, q.weight), 0)
        else:
            flat.addmm_(grads, q.weight, alpha=q.scale)

    # --- a step ---------------------------------------------------------------------------------------

    def __call__(self, step: int, x: Tensor, memory: Tuple[Tensor, Tensor, Optional[Tensor]],
                 encoder: Optional[Tuple[Tensor, Tensor, Optional[Tensor], int]], masks: Optional[Tensor],
                 activation_mask: Optional[Tensor], record: bool, out: Optional[Tensor] = None) -> Tensor:
        """The layer at one step: x [rows, embed]; memory (keys, values,
        bias) and encoder (keys, values, bias, rows per sequence) as
        _Attention takes them; masks [sublayers, rows, embed], scaled.
        `out`: where a pre-norm layer writes its output."""
        attention = self.attention

        def self_attention(h):
            q = self.block_queries[step] if self.first else attention.q(h, step, record)
            return attention(q, *memory, 1, step, record)

        branches = [self_attention]
        if self.cross is not None:
            keys, values, bias, groups = encoder
            branches.append(lambda h: self.cross(self.cross.q(h, step, record), keys, values, bias, groups, step,
                                                 record))
        if self.fc1 is not None:
            branches.append(lambda h: self._feed_forward(h, step, activation_mask, record))
        for k, branch in enumerate(branches):
            mask = None if masks is None else masks[k]
            norm = self.sublayers[k][0]
            if self.pre_norm:  # into the next sublayer's records, or `out`
                o = branch(None if k == 0 and self.first else norm(x, step, record))
                target = out if k + 1 == len(branches) else (self.sublayers[k + 1][0].inputs.at(step, x)
                                                             if record else None)
            else:
                o = branch(x)
                target = norm.inputs.at(step, x) if record else None
            x = torch.add(x, o, out=target) if mask is None else torch.addcmul(x, o, mask, out=target)
            if not self.pre_norm:
                x = norm(x, step, record)
        return x

    def _feed_forward(self, x, step, mask, record):
        fc2_input = self.fc2.inputs.at(step, x, self.fc1.weight.size(0)) if record else None
        if self.activation == "relu":
            activated = torch.relu_(self.fc1(x, step, record, out=None if mask is not None else fc2_input))
            saved = activated
        else:
            saved = self.fc1(x, step, record)
            activated = F.gelu(saved) if mask is not None or not record else torch.ops.aten.gelu.out(saved, out=fc2_input)
        if record:
            self.activation_saved[step] = saved
        if mask is not None:
            activated = torch.mul(activated, mask, out=fc2_input)
        return self.fc2(activated, step, record)

    def backward(self, step: int, grad: Tensor, memory: Tuple[Tensor, Tensor, Optional[Tensor]],
                 memory_grads: Tuple[Tensor, Tensor, Optional[Tensor], bool], encoder: Optional[Tuple[Tensor, Tensor]],
                 masks: Optional[Tensor], activation_mask: Optional[Tensor]) -> Tensor:
        """The gradient of the step's input from that of its output. The
        memory's (keys, values, bias; whether to write the keys' rather than
        add) gradients are added into theirs; the encoder's come once per
        block (_Attention.key_value_grads)."""

        def self_attention(g, residual, into):
            queries = self.attention.backward(g, step, *memory, *memory_grads)
            if self.first:  # the gradient of their input comes once per block
                return residual
            return self.attention.q.backward(queries, step, residual, into)

        branches = [self_attention]
        if self.cross is not None:
            branches.append(lambda g, residual, into: self.cross.q.backward(self.cross.backward(g, step, *encoder),
                                                                             step, residual, into))
        if self.fc1 is not None:
            branches.append(lambda g, residual, into: self._feed_forward_backward(step, g, activation_mask, residual,
                                                                                  into))
        for k in reversed(range(len(branches))):
            mask = None if masks is None else masks[k]
            norm, output = self.sublayers[k]
            if self.pre_norm:
                g = grad if mask is None else torch.mul(grad, mask, out=output.output_grads.at(step, grad))
                if k == 0 and self.first:  # its norm's share comes once per block
                    branches[k](g, None, None)
                else:  # the branch's input gradient goes into its norm's records
                    grad = grad + norm.backward(branches[k](g, None, norm.output_grads.at(step, grad)), step)
            else:
                residual = norm.backward(grad, step)
                g = residual if mask is None else torch.mul(residual, mask, out=output.output_grads.at(step, grad))
                # the input's gradient goes into the records of the sublayer below's norm
                into = None if k == 0 else self.sublayers[k - 1][0].output_grads.at(step, grad)
                grad = branches[k](g, residual, into)
        return grad

    def _feed_forward_backward(self, step, grad, mask, residual, into):
        hidden = self.fc2.backward(grad, step)
        if mask is not None:
            hidden = hidden * mask
        saved = self.activation_saved[step]
        target = self.fc1.output_grads.at(step, hidden)
        if self.activation == "relu":
            torch.ops.aten.threshold_backward(hidden, saved, 0, grad_input=target)
        else:
            torch.ops.aten.gelu_backward(hidden, saved, grad_input=target)
        return self.fc1.backward(target, step, residual, into)


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
    the mixing weights of eq. 1.

    The block reads its slots from a copy laid out for attention,
    [planes, rows, heads, slots, head_dim]: a window is then a batch of
    contiguous matrices, which the batched products take as they are (read
    in the buffer's layout, slots first, they ran several times slower).
    The buffer gets the new slots at the end of the block."""

    def __init__(self, decoder, buffer: KeyValueBuffer, window: Tuple[Tensor, ...], span: int, layers: Sequence,
                 positions: Optional[Tensor], span_biases: Sequence[Optional[Tensor]], weights: Tensor):
        self.decoder, self.module_layers = decoder, layers
        self.buffer, self.window, self.span, self.initial = buffer, window, span, window[0].size(2)
        memory = decoder.memory
        self.planes, self.heads, self.head_dim = memory.planes, memory.num_heads, memory.head_dim
        self.positions, self.weights, self.span_biases = positions, weights, list(span_biases)
        self.parameters = [memory.kv_proj.weight, memory.kv_proj.bias]
        if memory.layer_norm is not None:
            self.parameters += [memory.layer_norm.weight, memory.layer_norm.bias]
        self.parameters += [p for layer in layers if layer is not None
                            for m in _Layer.weighted_modules(layer) for p in (m.weight, m.bias)]
        self.encoder_bias: Optional[Tensor] = None

    def _pieces(self, steps: int) -> None:
        """The memory's and the layers' pieces for a block of `steps` steps."""
        memory = self.decoder.memory
        self.kv_proj = _Linear(memory.kv_proj, steps)
        self.memory_norm = None if memory.layer_norm is None else _Norm(memory.layer_norm, steps)
        present = [layer for layer in self.module_layers if layer is not None]
        read = min(self.span, self.initial + steps - 1)  # slots a step reads at most
        keep_probs = not present or present[0].self_attn.num_heads * read <= self.decoder.embed_dim + (
            0 if present[0].fc1 is None else present[0].fc1.out_features)
        self.layers = [None if layer is None else _Layer(layer, 0 if memory.shared_kv else 2 * i, steps, i == 0,
                                                          keep_probs) for i, layer in enumerate(self.module_layers)]
        self.present = [layer for layer in self.layers if layer is not None]

    def __call__(self, x: Tensor, encoder_kv: Optional[Tensor], encoder_bias: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """The top layer's outputs and the memory vectors, [steps, rows, embed] each."""
        inputs = [x, encoder_kv, self.positions, self.weights, *self.span_biases, *self.window, *self.parameters]
        self.encoder_bias = encoder_bias
        self._pieces(len(x))
        if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in inputs):
            return self.forward(x, encoder_kv, record=False)
        return _BlockFunction.apply(self, *inputs)

    def _windows(self, slots: Tensor, step: int) -> List[Tensor]:
        """What step `step` reads of `slots` (the block's layout): the last
        `span` slots before its own, one [rows * heads, slots, head_dim]
        view per plane."""
        filled = self.initial + step
        return list(slots[:, :, :, max(0, filled - self.span): filled].flatten(1, 2).unbind(0))

    def _keys(self, planes: List[Tensor], scratch: List[Tensor]) -> List[Tensor]:
        """The keys of each projection in a window, with relative positions
        k_j + p[S - 1 - e], written into `scratch` (one per projection,
        [rows * heads, span, head_dim], reused from step to step)."""
        keys = planes[0::2]
        if self.positions is None:
            return keys
        return [torch.add(k.view(-1, self.heads, *k.shape[1:]), self.positions[-k.size(1):],
                          out=out[:, : k.size(1)].view(-1, self.heads, *k.shape[1:])).flatten(0, 1)
                for k, out in zip(keys, scratch)]

    def _scratch(self, slots: Tensor) -> List[Tensor]:
        """Room for what each key projection needs per step with relative positions (see _keys)."""
        if self.positions is None:
            return []
        return [slots.new_empty(slots.size(1) * slots.size(2), self.span, self.head_dim)
                for _ in range(self.planes // 2)]

    def _biases(self, rows: int) -> List[Optional[Tensor]]:
        """Each layer's adaptive-span bias, as the scores of `rows` rows take it (once per block)."""
        return [None if b is None else _per_row(b, rows) for b in self.span_biases]

    # --- forward ------------------------------------------------------------------------------------

    def _draw_masks(self, x: Tensor) -> None:
        """Every dropout mask of the block in one draw, scaled by 1 / (1 - p)."""
        steps, rows, embed = x.shape
        first = self.present[0] if self.present else None
        self.masks = self.activation_masks = None
        if first is not None and first.dropout:
            keep = 1 - first.dropout
            shape = (steps, len(self.layers), len(first.sublayers), rows, embed)
            self.masks = x.new_empty(shape).bernoulli_(keep).div_(keep)
        if first is not None and first.activation_dropout:
            keep = 1 - first.activation_dropout
            shape = (steps, len(self.layers), rows, first.fc1.weight.size(0))
            self.activation_masks = x.new_empty(shape).bernoulli_(keep).div_(keep)
        # each step's and layer's views, made once
        self.mask_views, self.activation_mask_views = (
            [[None] * len(self.layers)] * steps if masks is None else [list(step.unbind(0)) for step in masks.unbind(0)]
            for masks in (self.masks, self.activation_masks))

    def _masks(self, step: int, layer: int):
        return self.mask_views[step][layer], self.activation_mask_views[step][layer]

    def forward(self, x: Tensor, encoder_kv: Optional[Tensor], record: bool) -> Tuple[Tensor, Tensor]:
        steps, rows, embed = x.shape
        slots = x.new_empty(self.planes, rows, self.heads, self.initial + steps, self.head_dim)
        slots[:, :, :, : self.initial] = torch.stack(self.window)
        per_layer = [None] * len(self.layers) if encoder_kv is None else [kv.unbind() for kv in encoder_kv.unbind()]
        self.encoder = encoder = _encoder(per_layer, self.encoder_bias, rows)
        biases = self._biases(rows)
        self._draw_masks(x)
        # x_t^0 .. x_t^L, the states that eq. 1 mixes; a pre-norm layer writes its output here
        self.states = states = x.new_empty(len(self.layers) + 1, steps, rows, embed)
        states[0] = x
        pre_norm = bool(self.present) and self.present[0].pre_norm
        if record:
            for layer, inputs in zip(self.layers, states):
                if layer is not None:
                    layer.read_inputs_from(inputs)
        if self.layers and self.layers[0] is not None:
            self.layers[0].project_block_queries(states[0], record)
        memories = x.new_empty(steps, rows, embed)
        if record:
            (self.kv_proj if self.memory_norm is None else self.memory_norm).inputs.write_into(memories)
        scratch = self._scratch(slots)
        for t, h in enumerate(states[0].unbind(0)):
            planes = self._windows(slots, t)
            keys = self._keys(planes, scratch)
            outputs = [h]
            for i, layer in enumerate(self.layers):
                if layer is not None:
                    bias = None if biases[i] is None else biases[i][..., -planes[0].size(1):]
                    memory = (keys[layer.plane // 2], planes[layer.plane + 1], bias)
                    h = layer(t, h, memory, encoder[i], *self._masks(t, i), record, states[i + 1, t] if pre_norm else None)
                elif pre_norm:
                    states[i + 1, t] = h
                outputs.append(h)
            if not pre_norm:
                torch.stack(outputs[1:], out=states[1:, t])
            m = torch.mm(self.weights[None], states[:, t].view(len(outputs), -1), out=memories[t].view(1, -1))
            m = m.view(rows, embed)
            kv = self.kv_proj(m if self.memory_norm is None else self.memory_norm(m, t, record), t, record)
            slots[:, :, :, self.initial + t] = kv.view(rows, self.planes, self.heads, self.head_dim).transpose(0, 1)
        self.buffer.extend(slots[:, :, :, self.initial:].permute(3, 0, 1, 2, 4), self.span)  # a decoding cache reads them
        self.slots = slots
        return states[-1], memories

    # --- backward -----------------------------------------------------------------------------------

    def backward(self, output_grads: Optional[Tensor], memory_grads: Optional[Tensor], encoder_kv: Optional[Tensor]):
        """The gradients of _BlockFunction's inputs."""
        states = self.states
        _, steps, rows, embed = states.shape
        slots, slot_grads = self.slots, torch.zeros_like(self.slots)
        encoder_grads = None
        if encoder_kv is not None:  # a layer that LayerDrop left out reads none of it
            encoder_grads = torch.zeros_like(encoder_kv) if None in self.layers else torch.empty_like(encoder_kv)
        position_grads = None if self.positions is None else torch.zeros_like(self.positions)
        bias_grads = [None if b is None else torch.zeros_like(b) for b in self.span_biases]
        biases = self._biases(rows)
        input_grads = torch.empty_like(states[0])
        mixing_grads = _Steps(steps)
        key_scratch, key_grad_scratch = self._scratch(slots), self._scratch(slots)
        weights = self.weights.unbind()
        for t in reversed(range(steps)):
            # slot t's gradient is complete: every window reading it belongs to a later step
            kv_grad = self.kv_proj.output_grads.at(t, input_grads[t], self.planes * self.heads * self.head_dim)
            kv_grad.view(rows, self.planes, self.heads, self.head_dim).copy_(
                slot_grads[:, :, :, self.initial + t].transpose(0, 1))
            if self.memory_norm is None:
                memory_grad = self.kv_proj.backward(kv_grad, t, out=mixing_grads.at(t, input_grads[t]))
            else:
                memory_grad = self.memory_norm.backward(
                    self.kv_proj.backward(kv_grad, t, out=self.memory_norm.output_grads.at(t, input_grads[t])), t)
                mixing_grads.keep(t, memory_grad)
            if memory_grads is not None:
                memory_grad += memory_grads[t]
            planes = self._windows(slots, t)
            keys = self._keys(planes, key_scratch)
            plane_grads = self._windows(slot_grads, t)
            slots_read = planes[0].size(1)
            # with positions, the keys' gradient goes to the slots and to the
            # positions: summed over the layers first, in key_grad_scratch
            key_grads = plane_grads[0::2] if self.positions is None else [g[:, :slots_read] for g in key_grad_scratch]
            written = [self.positions is None] * len(key_grads)
            # the top layer's output: its own gradient, and its share of m_t
            top = self.layers[-1].output_grad_slot(t, memory_grad) if self.layers[-1] is not None else None
            if output_grads is None:
                grad = torch.mul(memory_grad, weights[-1], out=top)
            else:
                grad = torch.addcmul(output_grads[t], memory_grad, weights[-1], out=top)
            for i in reversed(range(len(self.layers))):
                layer = self.layers[i]
                below = None if i == 0 or self.layers[i - 1] is None else self.layers[i - 1].output_grad_slot(t, grad)
                if layer is not None:
                    k = layer.plane // 2
                    bias = None if biases[i] is None else biases[i][..., -slots_read:]
                    bias_grad = None if bias_grads[i] is None else bias_grads[i][..., -slots_read:]
                    encoder = None if self.encoder[i] is None else self.encoder[i][:2]
                    grad = layer.backward(t, grad, (keys[k], planes[layer.plane + 1], bias),
                                          (key_grads[k], plane_grads[layer.plane + 1], bias_grad, not written[k]),
                                          encoder, *self._masks(t, i))
                    written[k] = True
                # the input's share of m_t, where the layer below records its output's gradient
                grad = torch.addcmul(grad, memory_grad, weights[i], out=input_grads[t] if i == 0 else below)
            if self.positions is not None:
                for plane, summed, was_written in zip(plane_grads[0::2], key_grads, written):
                    if was_written:
                        plane += summed
                        position_grads[-slots_read:] += summed.sum(0)
        if self.layers and self.layers[0] is not None:
            self.layers[0].block_queries_backward(input_grads)
        for layer, grads in zip(self.layers, [] if encoder_grads is None else encoder_grads.unbind()):
            if layer is not None:
                layer.cross.key_value_grads(*(g.view(-1, *g.shape[-2:]) for g in grads.unbind()))
        weight_grads = torch.mv(states.view(len(states), -1), mixing_grads.joined().view(-1))
        window_grads = slot_grads[:, :, :, : self.initial].unbind(0)
        parameter_grads = [*self.kv_proj.weight_grads(), *([] if self.memory_norm is None else
                                                           self.memory_norm.weight_grads()),
                           *(g for layer in self.present for g in layer.weight_grads())]
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
