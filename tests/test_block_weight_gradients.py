"""A linear layer's weight gradient, computed once per block of steps, equals
the sum of the steps' own (section 3.3's loop, without its per-step cost)."""

import pytest
import torch
from torch import nn

from fairseq_feedback.loop.block_weight_gradients import weight_gradients_per_block


def steps_through(linear, xs, unused_step=None):
    """A recurrence y_t = tanh(W (x_t + y_{t-1}) + b), each step's output in
    the loss but `unused_step`'s, whose output reaches nothing."""
    y, loss = torch.zeros_like(xs[0]), 0
    for t, x in enumerate(xs):
        out = torch.tanh(linear(x + y))
        if t != unused_step:
            y = out
            loss = loss + (out * torch.arange(out.numel()).view_as(out)).sum()
    return loss


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("unused_step", [None, 0, 5], ids=["every step", "first step unused", "last step unused"])
def test_one_product_per_block_equals_autograds_gradients(bias, unused_step):
    torch.manual_seed(0)
    linear = nn.Linear(4, 4, bias=bias)
    xs = torch.randn(6, 3, 4, requires_grad=True)
    steps_through(linear, xs.unbind(), unused_step).backward()
    expected = [p.grad.clone() for p in (*linear.parameters(), xs)]
    linear.zero_grad()
    xs.grad = None
    with weight_gradients_per_block([linear]):
        loss = steps_through(linear, xs.unbind(), unused_step)
    assert "forward" not in vars(linear)  # the module is itself again after the block
    loss.backward()
    for got, want in zip((*linear.parameters(), xs), expected):
        torch.testing.assert_close(got.grad, want, atol=1e-6, rtol=1e-5)


def test_the_block_adds_to_gradients_already_accumulated():
    """--update-freq: the second batch's gradients add to the first's."""
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    xs = torch.randn(5, 2, 4)
    steps_through(linear, xs.unbind()).backward()
    once = linear.weight.grad.clone()
    with weight_gradients_per_block([linear]):
        loss = steps_through(linear, xs.unbind())
    loss.backward()
    torch.testing.assert_close(linear.weight.grad, 2 * once)


def test_without_gradients_the_layers_run_as_they_are():
    linear = nn.Linear(4, 4)
    with torch.no_grad(), weight_gradients_per_block([linear]):
        assert "forward" not in vars(linear)


def test_a_linear_with_a_pre_hook_runs_as_it_is():
    """fairseq's quant-noise changes a weight in a forward pre-hook: such a layer keeps its own forward."""
    linear = nn.Linear(4, 4)
    linear.register_forward_pre_hook(lambda module, inputs: None)
    with weight_gradients_per_block([linear]):
        assert "forward" not in vars(linear)
