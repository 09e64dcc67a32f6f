"""A training call of a graphed function as one autograd node.

Parameters get their gradients through autograd, where DDP's hooks see
them, as torch.cuda.make_graphed_callables hands them over. Unlike it, the
gradients handed back are the backward graph's buffers themselves, held by
the graph: autograd copies them into .grad rather than adopting them (a
detached alias, adopted as a parameter's .grad, would be overwritten by the
next replay while --update-freq still accumulates into it).
"""

from typing import Callable, FrozenSet

import torch
from torch.autograd.function import once_differentiable


class Replay(torch.autograd.Function):
    """`graphed` (a GraphedFunction) replays its forward graph for this
    call's `fn`, with the checks `due`; the node's backward replays its
    backward graph (GraphedFunction.replay_forward, .replay_backward)."""

    @staticmethod
    def forward(ctx, graphed, fn: Callable, due: FrozenSet[str], *inputs_and_params):
        ctx.graphed, ctx.fn, ctx.due = graphed, fn, due
        ctx.pending = graphed.ledger.await_backward()
        ctx.rng = graphed.generator.get_state()
        ctx.written, ctx.backwards = graphed.ledger.static.writes, 0
        outputs, ctx.expected, ctx.judged = graphed.replay_forward(fn, due)
        # the graph failed: eager for the backward too
        ctx.eager = ctx.expected is not None and outputs is ctx.expected.outputs
        outputs = tuple(o.detach() for o in outputs)
        ctx.mark_non_differentiable(*[o for o, d in zip(outputs, graphed.differentiable) if not d])
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs):
        return (None, None, None, *ctx.graphed.replay_backward(ctx, grad_outputs))
