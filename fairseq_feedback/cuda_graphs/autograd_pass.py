"""One pass of a graphed function as autograd knows it: fn run under the
caller's autocast again, with gradients with respect to aliases of its
inputs, and the gradients of what it was differentiated with respect to.
What a capture records, and what the checks and the eager fallback run
again (graphed_function.py)."""

import contextlib
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

Outputs = Tuple[Optional[Tensor], ...]


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast casts to on this kind of device, or None."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class Pass:
    """One run of fn as autograd knows it: its outputs, and what its
    gradients are taken with respect to (`run_pass`). The forward graph's is
    what the backward graph differentiates (in the stand-in, its last replay's)."""

    outputs: Outputs = ()
    targets: Tuple[Tensor, ...] = ()


def run_pass(fn: Callable, inputs: Sequence[Optional[Tensor]], autocast: Optional[torch.dtype], device_type: str,
             training: bool, into: Pass) -> Outputs:
    """fn(*inputs), under autocast again if the caller was (without its
    cache of cast weights, which would hand the graphs the weights of an
    earlier call), with gradients if training; the pass kept in `into`. A
    function of its arguments alone: what a graph records holds nothing
    that holds the graph.

    In training fn reads an alias, made here, of each input that requires
    gradients, and the gradients are taken with respect to the aliases,
    never the inputs themselves. A gradient with respect to a leaf (a
    parameter) reaches the leaf's AccumulateGrad node, which autograd made
    where the leaf was first used, remembering that stream, and which lives
    as long as any graph that used the leaf: a loss the caller still holds,
    and under DDP always (its reducer holds every parameter's). Inside a
    capture, autograd's wait on that stream, the default one, invalidates
    the capture (torch 2.11, on an H100: "operation would make the legacy
    stream depend on a capturing blocking stream"). An alias is a node of
    this pass, made on its stream."""
    cast = contextlib.nullcontext()
    if autocast is not None:
        cast = torch.autocast(device_type, autocast, cache_enabled=False)
    with cast, torch.enable_grad() if training else torch.no_grad():
        if training:
            inputs = [x.view_as(x) if x is not None and x.requires_grad else x for x in inputs]
        outputs = tuple(fn(*inputs))
    into.outputs = outputs
    into.targets = tuple(x for x in inputs if x is not None and x.requires_grad) if training else ()
    return outputs


def pass_gradients(run: Pass, grad_outputs: Sequence[Tensor], device_type: str) -> Outputs:
    """The gradients of the pass's targets from those of its differentiable outputs."""
    differentiable = [(o, g) for o, g in zip(run.outputs, grad_outputs) if o.requires_grad]
    # never under autocast: its weight cache is what capture forbids, and a backward needs no casts
    with torch.autocast(device_type, enabled=False):
        return torch.autograd.grad([o for o, _ in differentiable], run.targets, [g for _, g in differentiable],
                                   allow_unused=True)
