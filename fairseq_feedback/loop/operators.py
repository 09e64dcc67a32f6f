"""The fused block's operators, each at one step of a block, each with its backward written by hand.

A piece is made for one block of `tgt_len` steps, recording or not (set once:
a block records what its backward needs only when a gradient is wanted). It
computes one step's output from one step's input, `piece(x, t)`, and one
step's input gradient from its output's, `piece.backward(grad, t)`, later
steps first; what does not depend on the step (weight gradients) comes once
per block, from the steps' records, in one product. Each backward states
its equation beside its code; tests/test_loop_pieces.py checks each against
autograd.

Notation: x, y a step's input and output rows [bsz, features]; g_y the
gradient of y; X, G every step's x and g_y of the block, stacked.
"""

from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn

from ..modules.feedback_attention import Alignment


class StepRecords:
    """What a piece keeps of each step for its backward: a tensor per step,
    [bsz, features] each, and all of them as one [tgt_len * bsz, features]
    matrix (`joined`) for a block's product. An operator that can write its
    output in place writes into one tensor of the whole block (`at`); other
    outputs are kept (`keep`) and concatenated once.

    Args:
        tgt_len: the block's steps.
    """

    def __init__(self, tgt_len: int):
        self.tgt_len = tgt_len
        self.whole: Optional[Tensor] = None  # [tgt_len, bsz, features]: the whole block's records
        self.kept: Dict[int, Tensor] = {}

    def write_into(self, whole: Tensor) -> None:
        """The records are this tensor's steps (written by someone else)."""
        self.whole, self.kept = whole, dict(enumerate(whole.unbind(0)))  # each step's view, made once

    def at(self, t: int, like: Tensor, features: Optional[int] = None) -> Tensor:
        """Where step t writes its record [bsz, features]: like's rows, and its features by default."""
        if self.whole is None:
            self.write_into(like.new_empty(self.tgt_len, like.size(0), like.size(-1) if features is None else features))
        return self.kept[t]

    def keep(self, t: int, tensor: Tensor) -> None:
        if self.whole is None:  # otherwise written in place already
            self.kept[t] = tensor

    def __getitem__(self, t: int) -> Tensor:
        return self.kept[t]

    def joined(self) -> Tensor:
        if self.whole is None:
            return torch.cat([self.kept[t] for t in range(self.tgt_len)])
        return self.whole.view(-1, self.whole.size(-1))


class Linear:
    """y = s (x W^T + b): an nn.Linear at each step, scaled (s = 1, or
    1 / sqrt(d_head) for attention's queries: free in the same product).

        g_x = s g_y W   (+ r, a residual's gradient, added in the same product: addmm)
        dW  = s G^T X,   db = s sum_rows G                         (once per block)

    Args:
        module: the nn.Linear (its weight and bias are read, never copied).
        tgt_len: the block's steps.
        recording: whether it records what its backward needs.
        scale: s.
    """

    def __init__(self, module: nn.Linear, tgt_len: int, recording: bool, scale: float = 1.0):
        self.weight, self.bias, self.scale, self.recording = module.weight, module.bias, scale, recording
        self.inputs, self.output_grads = StepRecords(tgt_len), StepRecords(tgt_len)
        self.nothing: Optional[Tensor] = None  # what a product with beta=0 adds to

    def __call__(self, x: Tensor, t: int, out: Optional[Tensor] = None) -> Tensor:
        if self.recording:
            self.inputs.keep(t, x)
        return torch.addmm(self.bias, x, self.weight.t(), beta=self.scale, alpha=self.scale, out=out)

    def backward(self, grad: Tensor, t: int, residual: Optional[Tensor] = None, out: Optional[Tensor] = None) -> Tensor:
        """g_x, plus `residual`."""
        self.output_grads.keep(t, grad)
        if residual is None:
            return self.product(grad, self.weight, out)
        return torch.addmm(residual, grad, self.weight, alpha=self.scale, out=out)

    def product(self, a: Tensor, b: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """s (a b)."""
        if self.scale == 1:
            return torch.mm(a, b, out=out)
        if self.nothing is None:
            self.nothing = a.new_empty(())
        return torch.addmm(self.nothing, a, b, beta=0, alpha=self.scale, out=out)

    def weight_grads(self) -> List[Tensor]:
        """[dW, db]."""
        grads = self.output_grads.joined()
        bias = grads.sum(0)
        return [self.product(grads.t(), self.inputs.joined()), bias if self.scale == 1 else bias.mul_(self.scale)]


class GroupedLinear(Linear):
    """Linear layers side by side, one per group of rows, as one batched
    product: the rows of group g (rows g * n .. (g + 1) * n - 1 of x) go
    through W_g, b_g, the g-th of `groups` equal slices of the module's
    outputs (the recurrent memory's keys and values with a projection per
    layer: layer g's memory through layer g's projection; Linear would
    project every memory through every layer's):

        y_g = x_g W_g^T + b_g
        g_x_g = g_y_g W_g
        dW_g = G_g^T X_g,   db_g = sum_rows G_g                    (once per block)

    Args:
        module, tgt_len, recording: as Linear takes them.
        groups: how many groups (and slices).
    """

    def __init__(self, module: nn.Linear, tgt_len: int, recording: bool, groups: int):
        super().__init__(module, tgt_len, recording)
        self.groups = groups
        self.weights = self.weight.view(groups, -1, self.weight.size(1))  # [groups, out_features / groups, in_features]
        self.biases = self.bias.view(groups, 1, -1)

    def __call__(self, x: Tensor, t: int, out: Optional[Tensor] = None) -> Tensor:
        if self.recording:
            self.inputs.keep(t, x)
        y = torch.baddbmm(self.biases, x.view(self.groups, -1, x.size(-1)), self.weights.transpose(1, 2),
                          out=None if out is None else out.view(self.groups, -1, out.size(-1)))
        return y.view(-1, y.size(-1))

    def product(self, a: Tensor, b: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """a_g b_g of each group, b the weight's shape (g_x = g_y W: backward)."""
        product = torch.bmm(a.view(self.groups, -1, a.size(-1)), b.view(self.groups, -1, b.size(-1)),
                            out=None if out is None else out.view(self.groups, -1, out.size(-1)))
        return product.view(-1, product.size(-1))

    def weight_grads(self) -> List[Tensor]:
        """[dW, db]."""

        def by_group(records: StepRecords) -> Tensor:  # [groups, tgt_len * rows, features]
            joined = records.joined()
            return joined.view(records.tgt_len, self.groups, -1, joined.size(-1)).transpose(0, 1).flatten(1, 2)

        grads = by_group(self.output_grads)
        return [torch.bmm(grads.transpose(1, 2), by_group(self.inputs)).view_as(self.weight), grads.sum(1).view(-1)]


class Norm:
    """y = gamma * xhat + beta, xhat = (x - mean(x)) / sigma over the
    features: a LayerNorm at each step. With gx = gamma * g_y,

        g_x = (gx - mean(gx) - xhat * mean(gx * xhat)) / sigma   (native_layer_norm_backward)
        dgamma = sum_rows g_y * xhat,   dbeta = sum_rows g_y       (once per block)

    Whether it comes before a sublayer or after its residual (pre- or
    post-norm) is the layer's business (fused_layer.py).

    Args:
        module: the LayerNorm.
        tgt_len, recording: as Linear takes them.
    """

    def __init__(self, module: nn.LayerNorm, tgt_len: int, recording: bool):
        self.weight, self.bias, self.eps, self.shape = module.weight, module.bias, module.eps, module.normalized_shape
        self.recording = recording
        self.inputs, self.output_grads = StepRecords(tgt_len), StepRecords(tgt_len)
        self.means: Dict[int, Tensor] = {}
        self.rstds: Dict[int, Tensor] = {}  # 1 / sigma

    def __call__(self, x: Tensor, t: int) -> Tensor:
        y, mean, rstd = torch.native_layer_norm(x, self.shape, self.weight, self.bias, self.eps)
        if self.recording:
            self.inputs.keep(t, x)
            self.means[t], self.rstds[t] = mean, rstd
        return y

    def backward(self, grad: Tensor, t: int) -> Tensor:
        self.output_grads.keep(t, grad)
        return torch.ops.aten.native_layer_norm_backward(
            grad, self.inputs[t], self.shape, self.means[t], self.rstds[t], self.weight, self.bias,
            [True, False, False])[0]

    def weight_grads(self) -> List[Tensor]:
        """[dgamma, dbeta]."""
        steps = range(self.inputs.tgt_len)
        _, weight, bias = torch.ops.aten.native_layer_norm_backward(
            self.output_grads.joined(), self.inputs.joined(), self.shape, torch.cat([self.means[t] for t in steps]),
            torch.cat([self.rstds[t] for t in steps]), self.weight, self.bias, [False, True, True])
        return [weight, bias]


def residual(x: Tensor, branch: Tensor, mask: Optional[Tensor], out: Optional[Tensor] = None) -> Tensor:
    """A sublayer's residual with dropout, y = x + d * f (d: the dropout
    mask, drawn scaled by 1 / (1 - p); None: no dropout), in one operator:

        g_x = g_y,   g_f = d * g_y                                 (residual_grad)
    """
    return torch.add(x, branch, out=out) if mask is None else torch.addcmul(x, branch, mask, out=out)


def residual_grad(grad: Tensor, mask: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """g_f = d * g_y: the branch's share of the gradient of a residual with
    dropout (the input's is g_y itself; without dropout, so is the branch's)."""
    return torch.mul(grad, mask, out=out)


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


class MemoryWindows:
    """What each step of a block reads of the memory's slots, laid out for
    attention, [planes, bsz, num_heads, slots, head_dim]: the last `span` slots
    before its own, one [bsz * num_heads, slots, head_dim] view per plane (a
    key or a value of one key/value projection), and the keys with relative
    positions (memory_view.py), p [span, head_dim] of a full window:

        key_j = k_j + p[S - 1 - e_j]
        g_k_j = g_key_j,   g_p[S - 1 - e_j] = sum_{rows, heads} g_key_j

    With positions, the keys of each projection are written into room
    reused from step to step, and their gradient, summed over the layers
    that read them, is added to the slots' and the positions' gradients at
    the end of the step (finish_key_grads).

    Args:
        slots: the block's keys and values, [planes, bsz, num_heads, initial + tgt_len, head_dim].
        slot_grads: where the backward adds their gradients (None forward).
        initial: the slots before the block's first step.
        span: how many slots a step reads at most.
        num_heads: the heads.
        positions: the relative positions of a full window, [span, head_dim], or None.
        position_grads: where the backward adds their gradients (None forward).
    """

    def __init__(self, slots: Tensor, slot_grads: Optional[Tensor], initial: int, span: int, num_heads: int,
                 positions: Optional[Tensor], position_grads: Optional[Tensor] = None):
        self.slots, self.slot_grads, self.initial, self.span, self.num_heads = slots, slot_grads, initial, span, num_heads
        self.positions, self.position_grads = positions, position_grads

        def room():
            """A [bsz * num_heads, span, head_dim] per key projection, with positions."""
            if positions is None:
                return []
            return [slots.new_empty(slots.size(1) * num_heads, span, slots.size(-1)) for _ in range(slots.size(0) // 2)]

        self.keys_room = room()
        self.key_grads_room = [] if slot_grads is None else room()

    def _window(self, slots: Tensor, t: int) -> List[Tensor]:
        filled = self.initial + t
        return list(slots[:, :, :, max(0, filled - self.span): filled].flatten(1, 2).unbind(0))

    def planes(self, t: int) -> List[Tensor]:
        """Step t's window of every plane."""
        return self._window(self.slots, t)

    def keys(self, planes: Sequence[Tensor]) -> List[Tensor]:
        """The keys of each projection in a window (planes[0::2]), plus the positions."""
        keys = planes[0::2]
        if self.positions is None:
            return list(keys)
        return [torch.add(k.view(-1, self.num_heads, *k.shape[1:]), self.positions[-k.size(1):],
                          out=out[:, : k.size(1)].view(-1, self.num_heads, *k.shape[1:])).flatten(0, 1)
                for k, out in zip(keys, self.keys_room)]

    def grads(self, t: int):
        """Step t's gradients: of every plane of its window (added into), of
        the keys of each projection, and whether the first layer to read
        those keys writes their gradient rather than adds (with positions,
        where they are summed apart first: finish_key_grads)."""
        planes = self._window(self.slot_grads, t)
        if self.positions is None:
            keys = planes[0::2]
            return planes, keys, [False] * len(keys)
        read = planes[0].size(1)
        return planes, [g[:, :read] for g in self.key_grads_room], [True] * len(self.key_grads_room)

    def finish_key_grads(self, plane_grads: Sequence[Tensor], key_grads: Sequence[Tensor],
                         overwrite: Sequence[bool]) -> None:
        """With positions: the keys' gradient of each projection that a layer
        read (no longer to be overwritten) to its slots and to the positions."""
        if self.positions is None:
            return
        for plane, summed, unread in zip(plane_grads[0::2], key_grads, overwrite):
            if not unread:
                plane += summed
                self.position_grads[-summed.size(1):] += summed.sum(0)


class Mixing:
    """Eq. 1 at each step of a block: m_t^j = sum_l w_jl x_t^l, each memory
    vector (one; the recurrent memory's, one per layer) from the states
    x_t^0 .. x_t^L, [layers + 1, tgt_len, bsz, embed_dim] (written there by
    the layers), as one product:

        g_x_t^l += sum_j w_jl g_m_t^j                                 (add_share)
        g_w_jl = sum_t <x_t^l, g_m_t^j>                              (once per block: weight_grads)

    w = softmax(theta) (or fixed weights) comes from outside the block, so
    autograd applies softmax's Jacobian, g_theta = w * (g_w - <w, g_w>).

    Args:
        weights: w, [memories, layers + 1].
        states: x_t^0 .. x_t^L, [layers + 1, tgt_len, bsz, embed_dim].
    """

    def __init__(self, weights: Tensor, states: Tensor):
        self.weights, self.states, self.memories = weights, states, len(weights)
        # w_l of one memory, a 0-dim tensor each; of several, [1, memories] each
        self.by_layer = weights[0].unbind() if self.memories == 1 else weights.t()[:, None].unbind()
        self.memory_grads = StepRecords(states.size(1))

    def __call__(self, t: int, out: Tensor) -> Tensor:
        """m_t into `out` [memories * bsz, embed_dim]."""
        layers = len(self.states)
        return torch.mm(self.weights, self.states[:, t].view(layers, -1), out=out.view(self.memories, -1)).view_as(out)

    def add_share(self, grad: Optional[Tensor], memory_grad: Tensor, layer: int,
                  out: Optional[Tensor] = None) -> Tensor:
        """grad + sum_j w_jl g_m_t^j: x_t^l's gradient (`grad`: its own, or
        None), from memory_grad [memories * bsz, embed_dim]: of one memory an
        elementwise product, of several a product with their w_l."""
        w = self.by_layer[layer]
        if self.memories == 1:
            return torch.mul(memory_grad, w, out=out) if grad is None else torch.addcmul(grad, memory_grad, w, out=out)
        shares, flat_out = memory_grad.view(self.memories, -1), None if out is None else out.view(1, -1)
        summed = (torch.mm(w, shares, out=flat_out) if grad is None
                  else torch.addmm(grad.reshape(1, -1), w, shares, out=flat_out))
        return summed.view(-1, memory_grad.size(-1))

    def weight_grads(self) -> Tensor:
        """g_w [memories, layers + 1] from the g_m_t recorded in memory_grads."""
        grads = self.memory_grads.joined()  # [tgt_len * memories * bsz, embed_dim]
        by_memory = grads.view(self.states.size(1), self.memories, -1).transpose(0, 1).flatten(1)
        return torch.mm(by_memory, self.states.view(len(self.states), -1).t())
