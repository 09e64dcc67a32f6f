"""Eq. 1 at each step of a block, the memory vectors from every layer's
states, with its backward written by hand (a piece as operators.py
describes them)."""

from typing import Optional

import torch
from torch import Tensor

from .operators import StepRecords


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
