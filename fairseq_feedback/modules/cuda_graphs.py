"""Functions of fixed-shape tensors replayed as CUDA graphs, forward and backward.

The feedback loop launches hundreds of small kernels per token, so on a GPU
it costs launches, not arithmetic: captured once per input shape, a block's
kernels replay without the host in the way. This follows
torch.cuda.make_graphed_callables (warm up on a side stream, capture the
forward and then the backward, replay both inside an autograd Function so
that parameters get their gradients through autograd, where DDP's hooks
see them). Written here rather than used from there because its backward
hands autograd detached aliases of the graph's gradient buffers, which
AccumulateGrad may adopt as a parameter's .grad: with --update-freq the
next replay would overwrite gradients already accumulated. Here autograd
copies them.

Without a memory pool (CPU tests) the same bookkeeping runs the function
itself where a graph would replay.
"""

import contextlib
import logging
from collections import OrderedDict
from typing import Callable, Hashable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


class GraphedFunction:
    """fn(*inputs) -> tuple of outputs, for inputs shaped as `sample_inputs`:
    one graph for the forward and, when gradients are on, one for the
    backward, with respect to the inputs that require them and `params`.
    `state`: tensors that fn updates in place (a decoding cache), restored
    after the runs that capturing takes."""

    def __init__(self, fn: Callable[..., Tuple[Tensor, ...]], sample_inputs: Sequence[Optional[Tensor]],
                 params: Sequence[Tensor], pool=None, state: Sequence[Tensor] = ()):
        self.fn, self.pool, self.state = fn, pool, state
        self.inputs = [None if x is None else x.detach().clone().requires_grad_(x.requires_grad) for x in sample_inputs]
        self.params = [p for p in params if p.requires_grad] if torch.is_grad_enabled() else []
        self.grad_targets = [x for x in self.inputs if x is not None and x.requires_grad] + self.params
        self.training = torch.is_grad_enabled() and bool(self.grad_targets)
        # under --amp: autocast again inside, without its cache of cast weights,
        # which would otherwise hand the graphs the weights of the warm-up
        self.autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        self.outputs: Tuple[Tensor, ...] = ()
        self.grad_outputs: List[Tensor] = []
        self.grads: List[Optional[Tensor]] = []
        if pool is not None:
            self._capture()

    def _forward(self):
        autocast = (torch.autocast("cuda", self.autocast, cache_enabled=False) if self.autocast is not None
                    else contextlib.nullcontext())
        with autocast, torch.enable_grad() if self.training else torch.no_grad():
            return tuple(self.fn(*self.inputs))

    def _backward(self):
        differentiable = [(o, g) for o, g in zip(self.outputs, self.grad_outputs) if o.requires_grad]
        return torch.autograd.grad([o for o, _ in differentiable], self.grad_targets,
                                   [g for _, g in differentiable], allow_unused=True)

    def _capture(self):
        """Warm-up on a side stream (lazy initialisation stays out of the
        graphs), then the forward's graph, then the backward's."""
        saved = [t.clone() for t in self.state]
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):
            self.outputs = self._forward()
            self.grad_outputs = [torch.zeros_like(o) for o in self.outputs]
            if self.training:
                self._backward()
        torch.cuda.synchronize()
        self.forward_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph, pool=self.pool, capture_error_mode="thread_local"):
            self.outputs = self._forward()
        if self.training:
            self.backward_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.backward_graph, pool=self.pool, capture_error_mode="thread_local"):
                self.grads = list(self._backward())
        for t, before in zip(self.state, saved):
            t.copy_(before)

    def __call__(self, *inputs: Optional[Tensor]) -> Tuple[Tensor, ...]:
        if self.training:  # read before the next replay: one block's backward comes before the next forward
            return _Replay.apply(self, *inputs, *self.params)
        self._run_forward(inputs)
        return tuple(o.clone() for o in self.outputs)  # a caller may keep them (features from the hub)

    def _run_forward(self, inputs):
        for static, x in zip(self.inputs, inputs):
            if static is not None:
                static.detach().copy_(x)
        if self.pool is None:
            self.outputs = self._forward()
            self.grad_outputs = [torch.zeros_like(o) for o in self.outputs]
        else:
            self.forward_graph.replay()

    def _run_backward(self, grad_outputs):
        for static, output, g in zip(self.grad_outputs, self.outputs, grad_outputs):
            if output.requires_grad:
                static.copy_(g)
        if self.pool is None:  # into buffers kept from call to call, as a graph's are
            grads = self._backward()
            self.grads = self.grads or [None if g is None else torch.empty_like(g) for g in grads]
            for static, g in zip(self.grads, grads):
                if g is not None:
                    static.copy_(g)
        else:
            self.backward_graph.replay()
        grads = iter(self.grads)
        # None for what needs no gradient (and a parameter this pass left
        # unused, e.g. by LayerDrop: its .grad stays as it was, as in eager)
        return [None if x is None or not x.requires_grad else next(grads) for x in self.inputs] + list(grads)


class _Replay(torch.autograd.Function):
    """A GraphedFunction as one autograd node over its inputs and parameters.
    The gradients handed back are the backward graph's buffers themselves,
    held by it: autograd copies them into .grad rather than adopting them."""

    @staticmethod
    def forward(ctx, graphed: GraphedFunction, *inputs_and_params):
        ctx.graphed = graphed
        graphed._run_forward(inputs_and_params[: len(graphed.inputs)])
        outputs = tuple(o.detach() for o in graphed.outputs)
        ctx.mark_non_differentiable(*[o for o, static in zip(outputs, graphed.outputs) if not static.requires_grad])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs):
        return (None, *ctx.graphed._run_backward(grad_outputs))


class GraphCache:
    """Captured functions by shape key, the least recently used dropped past
    `size`, all on one memory pool (replays never overlap: one block's
    forward and backward run before the next block's)."""

    def __init__(self, size: int, capture: bool, name: str):
        self.size, self.name = size, name
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: "OrderedDict[Hashable, GraphedFunction]" = OrderedDict()
        self.captured = 0

    def __call__(self, key: Hashable, fn, inputs: Sequence[Optional[Tensor]], params: Sequence[Tensor] = (),
                 state: Sequence[Tensor] = ()):
        graphed = self.graphs.get(key)
        if graphed is None:
            if len(self.graphs) >= self.size:
                self.graphs.popitem(last=False)
            graphed = self.graphs[key] = GraphedFunction(fn, inputs, params, self.pool, state)
            self.captured += 1
            if self.pool is not None:
                logger.info(f"{self.name}: captured CUDA graph {self.captured} for {key} "
                            f"({len(self.graphs)} cached, at most {self.size})")
        self.graphs.move_to_end(key)
        return graphed(*inputs)

    def forget(self, captured_over: Callable[[Hashable], bool]) -> None:
        """Drops the graphs whose key says they were captured over buffers that are gone."""
        for key in [key for key in self.graphs if captured_over(key)]:
            del self.graphs[key]
