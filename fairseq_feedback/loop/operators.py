"""The fused block's operators, each at one step of a block, each with its backward written by hand.

A piece is made for one block of `tgt_len` steps, recording or not (set once:
a block records what its backward needs only when a gradient is wanted). It
computes one step's output from one step's input, `piece(x, t)`, and one
step's input gradient from its output's, `piece.backward(grad, t)`, later
steps first; what does not depend on the step (weight gradients) comes once
per block, from the steps' records, in one product. Each backward states
its equation beside its code; tests/test_loop_pieces.py checks each against
autograd.

Here: what a piece keeps (StepRecords), the linear layer, the layer norm,
the residual with dropout. The other pieces, made the same way: attention
(attention.py), the memory's windows with relative positions
(memory_windows.py), eq. 1 (mixing.py).

Notation: x, y a step's input and output rows [bsz, features]; g_y the
gradient of y; X, G every step's x and g_y of the block, stacked.
"""

from typing import Dict, List, Optional

import torch
from torch import Tensor, nn


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
