"""Attention over keys and values projected beforehand.

The feedback loop cannot batch over time, so everything that does not depend
on the current step (key/value projections of the memory and of the encoder
output, position tables, masks) is prepared outside it. What is left per step
is a query projection, one fused attention call and an output projection.
"""

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.modules.fairseq_dropout import FairseqDropout
from fairseq.modules.quant_noise import quant_noise
from torch import Tensor, nn

from .adaptive_span import AdaptiveSpanMask
from .memory_view import MemoryView


class Alignment:
    """What fairseq-generate --print-alignment reads, as fairseq's transformer
    returns it: one decoder layer's attention weights over the encoder,
    averaged over heads (fairseq's alignment_layer and alignment_heads: its
    first `heads` heads; None: all). The attention of that layer adds each
    step's weights as it computes them.

    Args:
        layer: the decoder layer, 0 the bottom.
        heads: how many of its first heads are averaged, or None: all.
    """

    def __init__(self, layer: int, heads: Optional[int]):
        self.layer, self.heads = layer, heads
        self.steps: List[Tensor] = []

    def add(self, probs: Tensor) -> None:
        """Attention weights, [sentences, num_heads, beam, queries, src_len]
        (a sentence's `beam` hypotheses, rows of the batch one after another)."""
        sentences, _, beam, queries, src_len = probs.shape
        averaged = probs[:, : self.heads].mean(1, dtype=torch.float32)  # [sentences, beam, queries, src_len]
        self.steps.append(averaged.permute(2, 0, 1, 3).reshape(queries, sentences * beam, src_len))

    def extend(self, weights: Tensor) -> None:
        """Weights averaged already, [steps, bsz, src_len] (the graphs' outputs)."""
        self.steps.append(weights)

    def weights(self) -> Tensor:
        """Every step's weights, [tgt_len, bsz, src_len]."""
        return torch.cat(self.steps)


def aligned(alignment: Optional[Alignment], layer: int) -> Optional[Alignment]:
    """`alignment` for the layer it names, None for the others."""
    return alignment if alignment is not None and alignment.layer == layer else None


def attend(
    x: Tensor,
    q_proj: nn.Module,
    out_proj: nn.Module,
    keys: Tensor,
    values: Tensor,
    bias: Optional[Tensor] = None,
    dropout: Optional[FairseqDropout] = None,
    persistent: Optional[Tuple[Tensor, Tensor]] = None,
    positions: Optional[Tuple[Tensor, Tensor]] = None,
    alignment: Optional[Alignment] = None,
) -> Tensor:
    """softmax(q.k / sqrt(head_dim) + bias) v over keys and values projected beforehand.

    With fewer key rows (`sentences`) than query rows (`bsz`), each key row
    serves consecutive query rows: the hypotheses of one sentence in beam
    search, which share the encoder's keys and values (as fairseq's
    "beamable" encoder attention does), so those are stored once per
    sentence. `persistent` key/value vectors join the keys in the same
    softmax, with no bias (Sukhbaatar et al. 2019b, "all-attention").

    Args:
        x: one step's inputs, [bsz, embed_dim], or a whole block's,
            [tgt_len, bsz, embed_dim] (the transformer baseline, which needs no
            step loop).
        q_proj, out_proj: the query and output projections.
        keys, values: [sentences, num_heads, keys, head_dim].
        bias: added to the scores, broadcast to [sentences, num_heads, queries,
            keys]; -inf masks a key.
        dropout: the dropout of the attention weights (a FairseqDropout, which
            drops in training), or None.
        persistent: the layer's persistent (keys, values), [num_heads, n, head_dim] each.
        positions: for a block, relative positions as (table [span, head_dim],
            the table index of each query-key pair [queries, keys]): adds
            q.p_d, d the pair's distance (a step adds p to its keys instead).
        alignment: where the attention weights go, averaged over heads (the
            encoder attention of fairseq's alignment layer), or None.

    Returns:
        the attention's output, shaped as `x`.
    """
    sentences, num_heads, _, head_dim = keys.shape
    whole_block = x.dim() == 3
    queries, beam = (x.size(0), x.size(1) // sentences) if whole_block else (1, x.size(0) // sentences)
    # [sentences, num_heads, beam * queries, head_dim]: a sentence's hypotheses share its keys
    q = q_proj(x).view(queries, sentences, beam, num_heads, head_dim).permute(1, 3, 2, 0, 4).flatten(2, 3)
    if positions is not None:
        table, table_index = positions
        position_scores = torch.matmul(q, table.t() * head_dim**-0.5)
        position_scores = position_scores.gather(-1, table_index.expand(sentences, num_heads, -1, -1))
        bias = position_scores if bias is None else position_scores + bias
    dropout_p = 0.0 if dropout is None or not (dropout.training or dropout.apply_during_inference) else dropout.p
    # the fused kernel's backward is the faster one; its dropout draws in the kernel, so a step's weights are
    # dropped by the module (whose masks the tests hand the fused block's), a block's (the baseline's) in the kernel
    if torch.is_grad_enabled() and persistent is None and alignment is None and (whole_block or not dropout_p):
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, dropout_p=dropout_p)
    else:  # for a few query rows, two small matmuls beat the fused kernel's setup
        q = q * head_dim**-0.5
        scores = torch.matmul(q, keys.transpose(-1, -2))
        if bias is not None:
            scores = scores + bias
        if persistent is not None:
            scores = torch.cat([torch.matmul(q, persistent[0].transpose(-1, -2)), scores], dim=-1)
        weights = scores.softmax(-1)
        if alignment is not None:
            alignment.add(weights.unflatten(2, (beam, queries)))  # before dropout, as fairseq's attention returns them
        if dropout is not None:
            weights = dropout(weights)
        if persistent is None:
            out = torch.matmul(weights, values)
        else:
            n = persistent[0].size(1)
            out = torch.matmul(weights[..., :n], persistent[1]) + torch.matmul(weights[..., n:], values)
    out = out.unflatten(2, (beam, queries)).permute(3, 0, 2, 1, 4).reshape(queries, -1, num_heads * head_dim)
    return out_proj(out if whole_block else out[0])


class FeedbackAttention(nn.Module):
    """Query and output projections of the attention over the feedback memory.

    The memory's keys and values are not projected here: they are projected
    once per memory vector for all layers (FeedbackMemory), which is what makes
    the feedback decoder cheap per token. Persistent vectors are
    reparameterised, k = sqrt(head_dim) k', v = sqrt(n) v', so that they start
    with unit variance while k', v' start like feed-forward weights.

    Args:
        embed_dim: the model's width.
        num_heads, head_dim: the heads and each one's dimension.
        dropout: dropout of the attention weights.
        q_noise, qn_block_size: fairseq's quantization noise on the projections.
        persistent_vectors: n, the learned key/value vectors per head that every
            query also attends to (0: none).
        adaptive_span: (max span, ramp, initial z) of a span learned per head
            (AdaptiveSpanMask), or None.
    """

    def __init__(self, embed_dim, num_heads, head_dim, dropout=0.0, q_noise=0.0, qn_block_size=8,
                 persistent_vectors=0, adaptive_span=None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)  # as fairseq's attention
        self.q_proj = quant_noise(nn.Linear(embed_dim, num_heads * head_dim), q_noise, qn_block_size)
        self.out_proj = quant_noise(nn.Linear(num_heads * head_dim, embed_dim), q_noise, qn_block_size)
        # fairseq's MultiheadAttention initialisation, so the decoders start alike
        nn.init.xavier_uniform_(self.q_proj.weight, gain=2**-0.5)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.constant_(self.out_proj.bias, 0.0)
        self.persistent_keys = self.persistent_values = None
        if persistent_vectors:
            shape = (num_heads, persistent_vectors, head_dim)
            self.persistent_keys = nn.Parameter(torch.randn(shape) * head_dim**-0.5)
            self.persistent_values = nn.Parameter(torch.randn(shape) * persistent_vectors**-0.5)
        self.span_mask = None
        if adaptive_span:
            max_span, ramp, init = adaptive_span
            self.span_mask = AdaptiveSpanMask(max_span, ramp, num_heads, init)

    def persistent(self) -> Optional[Tuple[Tensor, Tensor]]:
        if self.persistent_keys is None:
            return None
        n = self.persistent_keys.size(1)
        return self.persistent_keys * math.sqrt(self.head_dim), self.persistent_values * math.sqrt(n)

    def forward(self, x: Tensor, memory: MemoryView) -> Tensor:
        """The attention of `x` over the memory.

        Args:
            x: a step's inputs, [bsz, embed_dim], or a block's, [tgt_len, bsz, embed_dim].
            memory: what the layer reads (MemoryView).

        Returns:
            the output, shaped as `x`.
        """
        return attend(
            x, self.q_proj, self.out_proj, memory.keys, memory.values, memory.bias,
            self.dropout_module, memory.persistent, memory.positions,
        )
