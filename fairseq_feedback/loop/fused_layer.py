"""A MemoryDecoderLayer at each step of a block, from the pieces of operators.py and attention.py.

Its attributes mirror fairseq's TransformerDecoderLayer: self_attn (over the
memory), encoder_attn, fc1 and fc2, and their norms. Each of the three is a
residual sublayer with dropout (d, the mask), pre- or post-norm:

    post-norm   r = x + d * f(x),   y = LN(r)
                g_r = LN'(g_y),   g_x = g_r + f'(d * g_r)
    pre-norm    y = x + d * f(LN(x))
                g_x = g_y + LN'(f'(d * g_y))

where the branch's first linear layer adds g_r to its input's gradient in
the same product (post-norm). The feed-forward branch, with the activation's
dropout d_a:

    u = fc1(x),  h = d_a * act(u),  f = fc2(h)
    g_h = fc2'(g_f),   g_u = act'(u) * (d_a * g_h),   g_x = fc1'(g_u)

and the attentions' weights have a dropout of their own (attention.Attention).
"""

from operator import attrgetter
from typing import Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.modules import gelu as fairseq_gelu
from torch import Tensor

from ..modules.feedback_attention import Alignment
from .attention import Attention
from .operators import Linear, Norm, residual, residual_grad

ACTIVATIONS = {F.relu: "relu", fairseq_gelu: "gelu"}

# what attention reads at a step: keys and values [sentences * num_heads, slots,
# head_dim] and a bias on the scores; the encoder's also its hypotheses per sentence (beam)
MemoryRead = Tuple[Tensor, Tensor, Optional[Tensor]]
EncoderRead = Tuple[Tensor, Tensor, Optional[Tensor], int]


class DropoutMasks(NamedTuple):
    """A layer's dropout masks at a step, scaled by 1 / (1 - p) (None: no
    dropout); a block draws them for all its steps and layers at once, each
    field with [tgt_len, layers] in front (fused_block.py)."""

    residual: Optional[Tensor] = None  # the sublayers' branches, [sublayers, bsz, embed_dim]
    activation: Optional[Tensor] = None  # the feed-forward hidden layer's, [bsz, ffn_embed_dim]
    attention: Optional[Tensor] = None  # the memory attention's weights, [bsz * num_heads, 1, slots read at most]
    encoder_attention: Optional[Tensor] = None  # the encoder attention's weights, [bsz * num_heads, src_len]


NO_DROPOUT = DropoutMasks()

# The one list of a layer's weighted modules (a weight and a bias each), by
# sublayer: the sublayer's attribute (None where the layer has none) and its
# modules' names, which a MemoryDecoderLayer and a FusedLayer (its pieces)
# share. The block's parameters and their gradients follow it (fused_block.py):
# a new weight is one more name here, and its piece's weight_grads.
WEIGHTED = (
    ("self_attn", ("self_attn.q_proj", "self_attn.out_proj", "self_attn_layer_norm")),
    ("encoder_attn", ("encoder_attn.q_proj", "encoder_attn.out_proj", "encoder_attn_layer_norm")),
    ("fc1", ("fc1", "fc2", "final_layer_norm")),
)
_WEIGHTED_GETTERS = tuple((sublayer, tuple(map(attrgetter, names))) for sublayer, names in WEIGHTED)


def weighted(layer) -> list:
    """The weighted modules of `layer`, a MemoryDecoderLayer, or their
    pieces (operators.Linear, Norm), of a FusedLayer, in WEIGHTED's order."""
    return [get(layer) for sublayer, getters in _WEIGHTED_GETTERS if getattr(layer, sublayer) is not None
            for get in getters]


class FusedLayer:
    """A MemoryDecoderLayer at each step of a block.

    Args:
        layer: the MemoryDecoderLayer.
        tgt_len: the block's steps.
        recording: whether it records what its backward needs.
        plane: its keys' plane among the memory's slots.
        first: the first layer, whose queries come once per block (project_block_queries).
        keep_probs: whether attention keeps its weights for the backward (attention.Attention).
        alignment: where its encoder attention's weights go (fairseq's
            alignment layer), or None.
    """

    def __init__(self, layer, tgt_len: int, recording: bool, plane: int = 0, first: bool = False,
                 keep_probs: bool = True, alignment: Optional[Alignment] = None):
        self.pre_norm, self.first, self.plane, self.recording = layer.normalize_before, first, plane, recording
        self.self_attn = Attention(layer.self_attn, tgt_len, recording, keep_probs)
        # the first layer's pre-norm comes once per block: one record
        self.self_attn_layer_norm = Norm(layer.self_attn_layer_norm, 1 if first and self.pre_norm else tgt_len,
                                         recording)
        self.sublayers = [(self.self_attn_layer_norm, self.self_attn.out_proj)]  # (norm, last linear layer)
        self.encoder_attn = self.fc1 = None
        if layer.encoder_attn is not None:
            self.encoder_attn = Attention(layer.encoder_attn, tgt_len, recording, alignment=alignment)
            self.encoder_attn_layer_norm = Norm(layer.encoder_attn_layer_norm, tgt_len, recording)
            self.sublayers.append((self.encoder_attn_layer_norm, self.encoder_attn.out_proj))
        if layer.fc1 is not None:
            self.fc1, self.fc2 = Linear(layer.fc1, tgt_len, recording), Linear(layer.fc2, tgt_len, recording)
            self.final_layer_norm = Norm(layer.final_layer_norm, tgt_len, recording)
            self.activation = ACTIVATIONS[layer.activation_fn]
            self.activation_saved: Dict[int, Tensor] = {}  # relu's output, gelu's input
            self.sublayers.append((self.final_layer_norm, self.fc2))
        # the dropout of the residual branches, of the feed-forward hidden layer and of each attention's weights
        self.dropout = layer.dropout_module.p if layer.training else 0.0
        self.activation_dropout = layer.activation_dropout_module.p if layer.training and self.fc1 else 0.0
        self.attention_dropout = layer.self_attn.dropout_module.p if layer.training else 0.0
        self.encoder_attention_dropout = (layer.encoder_attn.dropout_module.p  # fairseq's MultiheadAttention's
                                          if layer.training and self.encoder_attn else 0.0)
        self.block_queries: Optional[Tensor] = None  # [tgt_len, bsz, embed_dim]

    def read_inputs_from(self, states: Tensor) -> None:
        """The layer's inputs, [tgt_len, bsz, embed_dim], as what reads them
        records them (the first layer's queries record theirs)."""
        if not self.first:
            (self.self_attn_layer_norm if self.pre_norm else self.self_attn.q_proj).inputs.write_into(states)

    def output_grad_slot(self, t: int, like: Tensor) -> Optional[Tensor]:
        """Where the gradient of step t's output goes (post-norm: the last norm's records)."""
        return None if self.pre_norm else self.sublayers[-1][0].output_grads.at(t, like)

    # --- once per block: the first layer's queries --------------------------------------------------

    def project_block_queries(self, x: Tensor) -> None:
        """The queries of every step at once, from x [tgt_len, bsz, embed_dim],
        the embeddings (the first layer's input)."""
        flat = x.view(-1, x.size(-1))
        if self.pre_norm:
            flat = self.self_attn_layer_norm(flat, 0)
        q_proj = self.self_attn.q_proj
        if self.recording:
            q_proj.inputs.write_into(flat.view(x.shape))
        self.block_queries = q_proj(flat, 0).view(*x.shape[:2], -1)

    def block_queries_backward(self, input_grads: Tensor) -> None:
        """Adds what the block's queries give the embeddings' gradient, input_grads [tgt_len, bsz, embed_dim]."""
        q_proj = self.self_attn.q_proj
        grads, flat = q_proj.output_grads.joined(), input_grads.view(-1, input_grads.size(-1))
        if self.pre_norm:
            flat += self.self_attn_layer_norm.backward(q_proj.product(grads, q_proj.weight), 0)
        else:
            flat.addmm_(grads, q_proj.weight, alpha=q_proj.scale)

    # --- a step ---------------------------------------------------------------------------------------

    def __call__(self, x: Tensor, t: int, memory_read: MemoryRead, encoder_read: Optional[EncoderRead],
                 masks: DropoutMasks = NO_DROPOUT, out: Optional[Tensor] = None) -> Tensor:
        """The layer at step t: x [bsz, embed_dim], with the step's dropout
        `masks`. `out`: where a pre-norm layer writes its output."""
        self_attn, encoder_attn = self.self_attn, self.encoder_attn

        def self_attention(h):
            q = self.block_queries[t] if self.first else self_attn.q_proj(h, t)
            return self_attn(q, t, *memory_read, 1, masks.attention)

        branches = [self_attention]
        if encoder_attn is not None:
            branches.append(lambda h: encoder_attn(encoder_attn.q_proj(h, t), t, *encoder_read,
                                                   masks.encoder_attention))
        if self.fc1 is not None:
            branches.append(lambda h: self._feed_forward(h, t, masks.activation))
        for k, branch in enumerate(branches):
            mask = None if masks.residual is None else masks.residual[k]
            norm = self.sublayers[k][0]
            if self.pre_norm:  # into the next sublayer's records, or `out`
                f = branch(None if k == 0 and self.first else norm(x, t))
                target = out if k + 1 == len(branches) else (self.sublayers[k + 1][0].inputs.at(t, x)
                                                             if self.recording else None)
            else:
                f = branch(x)
                target = norm.inputs.at(t, x) if self.recording else None
            x = residual(x, f, mask, target)
            if not self.pre_norm:
                x = norm(x, t)
        return x

    def _feed_forward(self, x: Tensor, t: int, mask: Optional[Tensor]) -> Tensor:
        fc2_input = self.fc2.inputs.at(t, x, self.fc1.weight.size(0)) if self.recording else None
        if self.activation == "relu":
            activated = torch.relu_(self.fc1(x, t, out=None if mask is not None else fc2_input))
            saved = activated
        else:
            saved = self.fc1(x, t)
            activated = (F.gelu(saved) if mask is not None or not self.recording
                         else torch.ops.aten.gelu.out(saved, out=fc2_input))
        if self.recording:
            self.activation_saved[t] = saved
        if mask is not None:
            activated = torch.mul(activated, mask, out=fc2_input)
        return self.fc2(activated, t)

    def backward(self, grad: Tensor, t: int, memory_read: MemoryRead,
                 memory_read_grads: Tuple[Tensor, Tensor, Optional[Tensor], bool],
                 encoder_read: Optional[Tuple[Tensor, Tensor]], masks: DropoutMasks = NO_DROPOUT) -> Tensor:
        """g_x of step t from g_y, `grad`, with the step's dropout `masks`.
        The memory's (keys, values, bias; whether to write the keys' rather
        than add) gradients are added into memory_read_grads; the encoder's
        come once per block (Attention.key_value_grads)."""

        def self_attention(g, g_r, into):
            queries = self.self_attn.backward(g, t, *memory_read, *memory_read_grads)
            if self.first:  # the gradient of their input comes once per block
                return g_r
            return self.self_attn.q_proj.backward(queries, t, g_r, into)

        branches = [self_attention]
        if self.encoder_attn is not None:
            encoder_attn = self.encoder_attn
            branches.append(lambda g, g_r, into: encoder_attn.q_proj.backward(
                encoder_attn.backward(g, t, *encoder_read), t, g_r, into))
        if self.fc1 is not None:
            branches.append(lambda g, g_r, into: self._feed_forward_backward(
                g, t, masks.activation, g_r, into))
        for k in reversed(range(len(branches))):
            mask = None if masks.residual is None else masks.residual[k]
            norm, output = self.sublayers[k]
            if self.pre_norm:
                g = grad if mask is None else residual_grad(grad, mask, output.output_grads.at(t, grad))
                if k == 0 and self.first:  # its norm's share comes once per block
                    branches[k](g, None, None)
                else:  # the branch's input gradient goes into its norm's records
                    grad = grad + norm.backward(branches[k](g, None, norm.output_grads.at(t, grad)), t)
            else:
                g_r = norm.backward(grad, t)
                g = g_r if mask is None else residual_grad(g_r, mask, output.output_grads.at(t, grad))
                # the input's gradient goes into the records of the sublayer below's norm
                into = None if k == 0 else self.sublayers[k - 1][0].output_grads.at(t, grad)
                grad = branches[k](g, g_r, into)
        return grad

    def _feed_forward_backward(self, grad: Tensor, t: int, mask: Optional[Tensor], g_r: Optional[Tensor],
                               into: Optional[Tensor]) -> Tensor:
        hidden = self.fc2.backward(grad, t)  # g_h
        if mask is not None:
            hidden = hidden * mask
        saved = self.activation_saved[t]
        target = self.fc1.output_grads.at(t, hidden)  # g_u
        if self.activation == "relu":
            torch.ops.aten.threshold_backward(hidden, saved, 0, grad_input=target)
        else:
            torch.ops.aten.gelu_backward(hidden, saved, grad_input=target)
        return self.fc1.backward(target, t, g_r, into)
