"""Attention at one step of a block, between its projections, with its
backward written by hand (a piece as operators.py describes them), and how
its rows are laid out by head."""

from typing import Dict, Optional

import torch
from torch import Tensor

from ..modules.feedback_attention import Alignment
from .operators import Linear


def split_heads(x: Tensor, num_heads: int, beam: int) -> Tensor:
    """[bsz, num_heads * head_dim] -> [sentences * num_heads, beam, head_dim]:
    `beam` consecutive rows (a sentence's hypotheses) share one sentence's keys."""
    bsz = x.size(0)
    return x.view(bsz // beam, beam, num_heads, -1).transpose(1, 2).reshape(bsz // beam * num_heads, beam, -1)


def merge_heads(a: Tensor, num_heads: int, beam: int) -> Tensor:
    """The inverse of split_heads."""
    return a.view(-1, num_heads, beam, a.size(-1)).transpose(1, 2).reshape(-1, num_heads * a.size(-1))


def per_row(bias: Optional[Tensor], bsz: int) -> Optional[Tensor]:
    """A bias on the scores, [num_heads or 1, queries, slots], as the scores of
    `bsz` rows take it: [bsz * num_heads or 1, queries, slots]."""
    if bias is None or bias.size(0) == 1:
        return bias
    return bias.expand(bsz, *bias.shape).reshape(-1, *bias.shape[1:])


class Attention:
    """fairseq's attention of one query row per sentence (or per beam
    hypothesis) over keys and values projected beforehand, between its
    query projection (q_proj, scaled by 1 / sqrt(d_head)) and its output
    projection (out_proj): per head,

        S = q K^T + B,   P = softmax(S),   a = (d * P) V

    (B: a bias on the scores, the masks and the adaptive span's log m(e);
    d: the weights' dropout mask, drawn scaled by 1 / (1 - p), or 1).
    Its backward, from out_proj's input gradient g_a:

        g_P = d * (g_a V^T)
        g_S = P * (g_P - rowsum(g_P * P))                          (softmax's backward)
        g_q = g_S K,   g_K = g_S^T q,   g_V = (d * P)^T g_a,   g_B = sum_sentences g_S

    With one query row per sentence (the memory's), g_K and g_V are outer
    products, added in place into the memory's gradient at every step; for
    keys and values that every step reads (the encoder's), g_K = sum_t g_S,t^T q_t
    and g_V = sum_t (d_t * P_t)^T g_a,t come once per block, one product each.
    P is kept for the backward when `keep_probs`, and computed again otherwise
    (long spans, where it would take more room than the step's feed-forward
    activations).

    Args:
        module: FeedbackAttention, or fairseq's MultiheadAttention (the encoder's):
            its q_proj, out_proj, num_heads and head_dim.
        tgt_len, recording: as Linear takes them.
        keep_probs: whether P is kept for the backward.
        alignment: where P goes, averaged over heads (the encoder attention
            of fairseq's alignment layer), or None.
    """

    def __init__(self, module, tgt_len: int, recording: bool, keep_probs: bool = True,
                 alignment: Optional[Alignment] = None):
        self.q_proj = Linear(module.q_proj, tgt_len, recording, module.head_dim**-0.5)
        self.out_proj = Linear(module.out_proj, tgt_len, recording)
        self.num_heads, self.keep_probs, self.recording, self.beam = module.num_heads, keep_probs, recording, 1
        self.alignment = alignment
        self.queries: Dict[int, Tensor] = {}  # [sentences * num_heads, beam, head_dim], by step
        self.probs: Dict[int, Tensor] = {}
        self.masks: Dict[int, Tensor] = {}  # the weights' dropout, by step: valid while the step runs
        self.score_grads: Dict[int, Tensor] = {}  # for key_value_grads
        self.attended_grads: Dict[int, Tensor] = {}

    @staticmethod
    def _scores(q: Tensor, keys: Tensor, bias: Optional[Tensor]) -> Tensor:
        return torch.bmm(q, keys.transpose(1, 2)) if bias is None else torch.baddbmm(bias, q, keys.transpose(1, 2))

    def __call__(self, q: Tensor, t: int, keys: Tensor, values: Tensor, bias: Optional[Tensor], beam: int,
                 mask: Optional[Tensor] = None) -> Tensor:
        """The attention of one step's queries.

        Args:
            q: the projected queries, [bsz, num_heads * head_dim].
            t: the step.
            keys, values: [sentences * num_heads, slots, head_dim].
            bias: broadcasting to the scores [sentences * num_heads, beam, slots], or None.
            beam: rows per sentence (beam hypotheses that share the encoder's
                keys: 1 for the memory's); bsz = sentences * beam.
            mask: the weights' dropout d, scaled, as many elements as the
                scores (viewed as them), or None.

        Returns:
            out_proj's output, [bsz, embed_dim].
        """
        q = split_heads(q, self.num_heads, beam)
        probs = torch.softmax(self._scores(q, keys, bias), -1)
        if self.alignment is not None:
            self.alignment.add(probs.view(-1, self.num_heads, beam, 1, probs.size(-1)))
        if mask is not None:
            mask = mask.view(probs.shape)
        if self.recording:
            self.queries[t], self.beam = q, beam
            if self.keep_probs:
                self.probs[t] = probs
            if mask is not None:
                self.masks[t] = mask
        dropped = probs if mask is None else torch.mul(probs, mask)
        if not self.recording or beam > 1:
            return self.out_proj(merge_heads(torch.bmm(dropped, values), self.num_heads, beam), t)
        attended = self.out_proj.inputs.at(t, q.view(-1, self.num_heads * q.size(-1)))  # one query row per sentence
        torch.bmm(dropped, values, out=attended.view(q.shape))
        return self.out_proj(attended, t)

    def backward(self, grad: Tensor, t: int, keys: Tensor, values: Tensor, bias: Optional[Tensor] = None,
                 key_grads: Optional[Tensor] = None, value_grads: Optional[Tensor] = None,
                 bias_grads: Optional[Tensor] = None, overwrite_key_grads: bool = False) -> Tensor:
        """g_q (the projected queries' gradient, in q_proj's records) from
        out_proj's output gradient `grad`. g_K, g_V and g_B are added into
        `key_grads` (written there if `overwrite_key_grads`), `value_grads`
        and `bias_grads` [num_heads, 1, slots]; with no `key_grads`, g_K and g_V
        come once per block (key_value_grads)."""
        q, mask = self.queries[t], self.masks.get(t)
        probs = self.probs[t] if self.keep_probs else torch.softmax(self._scores(q, keys, bias), -1)
        attended = split_heads(self.out_proj.backward(grad, t), self.num_heads, self.beam)  # g_a
        prob_grads = torch.bmm(attended, values.transpose(1, 2))
        if mask is not None:
            prob_grads.mul_(mask)
        scores = torch._softmax_backward_data(prob_grads, probs, -1, probs.dtype)
        if key_grads is None:
            self.score_grads[t], self.attended_grads[t] = scores, attended
            if mask is not None:  # key_value_grads reads d * P, after the step's mask is gone (dropout_bits.py)
                probs.mul_(mask)
        else:
            # one query row: outer products, elementwise (a batched product
            # of inner size 1 runs row by row)
            value_grads.addcmul_((probs if mask is None else probs * mask).transpose(1, 2), attended)
            if overwrite_key_grads:
                torch.mul(scores.transpose(1, 2), q, out=key_grads)
            else:
                key_grads.addcmul_(scores.transpose(1, 2), q)
        if bias_grads is not None:
            bias_grads += scores.view(-1, *bias_grads.shape).sum(0)
        if self.beam > 1:
            return merge_heads(torch.bmm(scores, keys), self.num_heads, self.beam)
        queries = self.q_proj.output_grads.at(t, grad, q.size(-1) * self.num_heads)
        torch.bmm(scores, keys, out=queries.view(q.shape))
        return queries

    def key_value_grads(self, key_grads: Tensor, value_grads: Tensor) -> None:
        """g_K and g_V of keys and values that every step reads (the
        encoder's), over the block, written into `key_grads` and
        `value_grads` [sentences * num_heads, slots, head_dim]."""
        steps = range(len(self.queries))

        def joined(by_step):
            return torch.cat([by_step[t] for t in steps], 1)

        torch.bmm(joined(self.score_grads).transpose(1, 2), joined(self.queries), out=key_grads)
        dropped = joined(self.probs)  # d * P with dropout: each step's backward dropped them
        torch.bmm(dropped.transpose(1, 2), joined(self.attended_grads), out=value_grads)
