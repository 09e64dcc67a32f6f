"""The weight gradients of the per-token loop's linear layers, once per block.

The loop applies each linear layer to one step at a time, y_t = x_t W^T + b.
Autograd would compute dW_t = g_t^T x_t and db_t = sum g_t at every step (g_t
the gradient of y_t) and add each to the sum so far: four small kernels per
layer and step besides the two products the step needs (y_t, and the
gradient of x_t). The sum is one matrix product over the block,

    dW = sum_t g_t^T x_t = G^T X,        db = sum_t g_t

(X, G: the steps' inputs and output gradients, stacked), so inside a block a
step's backward computes only its input's gradient and keeps g_t. Every step
reads the weights through one node made at the start of the block; autograd
runs that node after all the steps that read it, and it computes dW and db.

The reference loop through autograd (for options that the fused block,
loop/fused_block.py, does not cover) uses it when replayed as a CUDA graph
(graphed_loop.py): there kernels cost and Python does not. Run eagerly,
the two autograd functions per layer and step cost more in Python than
the kernels they save at small sizes.
"""

import contextlib
from typing import Dict, Iterable, Iterator, List

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .fallback import has_forward_pre_hooks


@contextlib.contextmanager
def weight_gradients_per_block(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Within the block, each plain nn.Linear among `modules` computes its
    weight gradient once (when gradients are on; others run as they are)."""
    linears = [m for m in modules
               if type(m) is nn.Linear and m.weight.requires_grad and not has_forward_pre_hooks(m)]
    if not torch.is_grad_enabled() or not linears:
        yield
        return
    for linear in linears:
        linear.forward = _BlockLinear(linear)  # an instance attribute: nn.Module.__call__ finds it first
    try:
        yield
    finally:
        for linear in linears:
            del linear.forward


class _BlockLinear:
    """One linear layer for one block: its weights as the block's node hands
    them out, the steps' inputs, and the output gradients that backward
    fills in, by step (a step whose output reaches no loss gets none)."""

    def __init__(self, linear: nn.Linear):
        self.inputs: List[Tensor] = []
        self.grads: Dict[int, Tensor] = {}
        self.weight, self.bias = BlockWeights.apply(self, linear.weight, linear.bias)

    def __call__(self, x: Tensor) -> Tensor:
        return _StepLinear.apply(x, self.weight, self.bias, self)


class BlockWeights(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, block: _BlockLinear, weight: Tensor, bias):
        ctx.block = block
        ctx.set_materialize_grads(False)
        return weight.view_as(weight), None if bias is None else bias.view_as(bias)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, _weight_grad, _bias_grad):  # None: the steps hand their share over in `block`
        block = ctx.block
        stepped = sorted(block.grads)  # the steps whose output reached a loss
        inputs = torch.cat([block.inputs[t].reshape(-1, block.inputs[t].size(-1)) for t in stepped])
        grads = torch.cat([block.grads[t].reshape(-1, block.grads[t].size(-1)) for t in stepped])
        block.inputs, block.grads = [], {}
        bias_grad = grads.sum(0) if ctx.needs_input_grad[2] else None
        return None, torch.matmul(grads.t(), inputs.to(grads.dtype)), bias_grad


class _StepLinear(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x: Tensor, weight: Tensor, bias, block: _BlockLinear):
        ctx.save_for_backward(weight)
        ctx.block, ctx.step = block, len(block.inputs)
        block.inputs.append(x.detach())
        return F.linear(x, weight, bias)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad: Tensor):
        ctx.block.grads[ctx.step] = grad
        (weight,) = ctx.saved_tensors
        grad_input = torch.matmul(grad, weight.to(grad.dtype)) if ctx.needs_input_grad[0] else None
        return grad_input, None, None, None
