"""Functions of fixed-shape tensors replayed as CUDA graphs, forward and backward,
each checked once against the eager computation, the eager path taken if it
fails.

The feedback loop launches hundreds of small kernels per token, so on a GPU
it costs launches, not arithmetic: captured once per input shape, a block's
kernels replay without the host in the way. This follows
torch.cuda.make_graphed_callables (warm up on a side stream, capture the
forward and then the backward, replay both inside an autograd Function so
that parameters get their gradients through autograd, where DDP's hooks
see them). Written here rather than used from there because its backward
hands autograd detached aliases of the graph's gradient buffers, which
AccumulateGrad may adopt as a parameter's .grad (with --update-freq the next
replay would overwrite gradients already accumulated), and because it
cannot check a graph or fall back.

Every graph shares one memory pool, so a replay may overwrite memory that
another graph left there. PyTorch allows this only for graphs replayed in
their capture order; here any order is safe because nothing a graph leaves in
the pool is read after another replay: static inputs and decoding state live
outside the pool, outputs are cloned as they are handed out, gradients are
copied into .grad by the backward that replays them, and while a training
forward awaits its backward (its saved activations are in the pool) every
other call runs eagerly, captured or replayed by nothing.

The self-check: the warm-up that capture needs is the eager computation on
the same inputs, so its outputs (and, in training, its gradients at the first
backward) are compared with the first replay's, at a tolerance by precision,
non-finite values in the same places. A mismatch, a failed capture or
running out of memory while capturing gives one warning naming the shape and
the difference; that call's result comes from the eager path, and every later
call runs eagerly (`GraphCache.failed`). So does a hit rate that stays low.

Without capture (`--cuda-graphs emulate`, and the CPU tests) the same
bookkeeping and checks run, with the function itself where a graph would
replay.
"""

import collections
import contextlib
import logging
import os
import weakref
from collections import OrderedDict
from typing import Callable, Hashable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

# the largest difference allowed, relative to the largest value, by precision
TOLERANCE_FP32, TOLERANCE_HALF = 1e-4, 2e-2
# a hit rate under LOW_HIT_RATE over HIT_WINDOW lookups means shapes vary too much for graphs to pay
HIT_WINDOW, LOW_HIT_RATE = 256, 0.5


def bucket(n: int) -> int:
    """Time steps: n rounded up to a multiple of 8, or from 128 on of a
    sixteenth of the power of two below it. The loop's cost grows with its
    steps, so they are padded by little: less than 8 or n/8."""
    step = max(8, 2 ** (n.bit_length() - 4))
    return -(-n // step) * step


def bucket_wide(n: int) -> int:
    """Rows and source positions: the power of two at or above n (at least
    8). A step costs about the same for more of them, and --max-tokens
    batches pair many short rows with few long ones: one epoch of Debian
    de-en's batches fits in 40 graphs this way, against 101 with bucket()."""
    return max(8, 1 << (n - 1).bit_length())


class GraphFailure(Exception):
    """A graph that cannot be trusted: the message says why."""


def largest_difference(got: Tensor, expected: Tensor) -> float:
    """max |got - expected| / max |expected| over the finite values; inf if
    the non-finite values are not in the same places."""
    got, expected = got.detach().float(), expected.detach().float()
    finite = torch.isfinite(expected)
    if not torch.equal(finite, torch.isfinite(got)):
        return float("inf")
    if not finite.any():
        return 0.0
    scale = expected[finite].abs().max().clamp_min(1e-6)
    return float((got[finite] - expected[finite]).abs().max() / scale)


def _rng_state(capture: bool) -> Tensor:
    return torch.cuda.get_rng_state() if capture else torch.get_rng_state()


def _set_rng_state(capture: bool, state: Tensor) -> None:
    (torch.cuda.set_rng_state if capture else torch.set_rng_state)(state)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))


class GraphedFunction:
    """fn(*inputs) -> tuple of outputs, for inputs shaped as `sample_inputs`:
    one graph for the forward and, when gradients are on, one for the
    backward, with respect to the inputs that require them and `params`.
    `state`: tensors that fn updates in place (a decoding cache), restored
    after the runs that capturing takes. Raises GraphFailure if capture
    fails, and from its first call if the replay disagrees with eager."""

    def __init__(self, fn: Callable[..., Tuple[Tensor, ...]], sample_inputs: Sequence[Optional[Tensor]],
                 params: Sequence[Tensor], cache: "GraphCache", state: Sequence[Tensor] = (), shape: str = ""):
        self.fn, self.cache, self.state, self.shape = fn, cache, state, shape
        self.capture = cache.pool is not None
        self.inputs = [None if x is None else x.detach().clone().requires_grad_(x.requires_grad) for x in sample_inputs]
        self.params = [p for p in params if p.requires_grad] if torch.is_grad_enabled() else []
        self.grad_targets = [x for x in self.inputs if x is not None and x.requires_grad] + self.params
        self.training = torch.is_grad_enabled() and bool(self.grad_targets)
        # under --amp: autocast again inside, without its cache of cast weights,
        # which would otherwise hand the graphs the weights of the warm-up
        self.autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        self.grad_outputs: List[Tensor] = []
        self.grads: List[Optional[Tensor]] = []

        before = [t.clone() for t in state]
        self.rng = _rng_state(self.capture)  # the first replay draws dropout as the warm-up did
        with self._side_stream():
            self.expected = self._forward()  # the eager computation, the self-check's reference
            self.outputs = self.expected
            self.grad_outputs = [torch.zeros_like(o) for o in self.outputs]
            if self.capture and self.training:  # lazy initialisation of the backward's kernels, outside the graph
                self._backward(retain_graph=True)
        self._restore(before)
        precise = self.autocast is None and all(o.dtype in (torch.float32, torch.float64) for o in self.expected)
        self.tolerance = TOLERANCE_FP32 if precise else TOLERANCE_HALF
        self.first_forward = self.first_backward = True
        self.pool_bytes = 0
        try:
            self._capture()
        except Exception as e:  # out of memory, a host sync in the loop, an operator capture refuses
            self.forward_graph = self.backward_graph = self.expected = None
            raise GraphFailure(f"capture failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")

    def _side_stream(self):
        return _SideStream() if self.capture else contextlib.nullcontext()

    def _restore(self, before: Sequence[Tensor]) -> None:
        for t, saved in zip(self.state, before):
            t.copy_(saved)

    def nbytes(self) -> int:
        """What this graph keeps: its buffers and what its capture added to the pool."""
        kept = [*self.inputs, *self.outputs, *self.grad_outputs, *self.grads]
        if self.expected is not None:
            kept += list(self.expected)
        return _nbytes(kept) + self.pool_bytes

    def _forward(self):
        autocast = torch.autocast("cuda", self.autocast, cache_enabled=False) if self.autocast is not None else None
        with autocast or contextlib.nullcontext(), torch.enable_grad() if self.training else torch.no_grad():
            return tuple(self.fn(*self.inputs))

    def _backward(self, retain_graph=False, outputs=None):
        differentiable = [(o, g) for o, g in zip(outputs or self.outputs, self.grad_outputs) if o.requires_grad]
        # never under autocast: its weight cache is what capture forbids, and a backward needs no casts
        with torch.autocast("cuda", enabled=False) if torch.cuda.is_available() else contextlib.nullcontext():
            return torch.autograd.grad([o for o, _ in differentiable], self.grad_targets,
                                       [g for _, g in differentiable], allow_unused=True, retain_graph=retain_graph)

    def _capture(self):
        """With a pool: the forward's graph, then the backward's, outside
        autocast (the forward casts for itself)."""
        if not self.capture:
            return
        reserved = torch.cuda.memory_reserved()
        with torch.autocast("cuda", enabled=False):
            self.forward_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.forward_graph, pool=self.cache.pool, capture_error_mode="thread_local"):
                self.outputs = self._forward()
            if self.training:
                self.backward_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.backward_graph, pool=self.cache.pool, capture_error_mode="thread_local"):
                    self.grads = list(self._backward())
        self.pool_bytes = max(0, torch.cuda.memory_reserved() - reserved)

    # --- replay -----------------------------------------------------------------------------------

    def __call__(self, *inputs: Optional[Tensor]) -> Tuple[Tensor, ...]:
        before = [t.clone() for t in self.state] if self.first_forward else ()
        if self.training:
            outputs = _Replay.apply(self, *inputs, *self.params)
        else:
            self._run_forward(inputs)
            outputs = self.outputs
        if self.first_forward:
            self.first_forward = False
            self._check("outputs", outputs, self.expected, before)
            if not self.training:
                self.expected = None
        # cloned: what a caller keeps (features, a criterion's second look) outlives the next replay
        return tuple(o.clone() for o in outputs)

    def _check(self, what, got, expected, before=()):
        worst = max((largest_difference(g, e) for g, e in zip(got, expected) if g is not None and e is not None),
                    default=0.0)
        if worst > self.tolerance:
            self._restore(before)
            raise GraphFailure(f"its {what} differ from eager by {worst:.3g} (at most {self.tolerance:g})")

    def _run_forward(self, inputs):
        if not self.first_forward:  # the first call's are the warm-up's: untouched, its autograd graph reads them
            for static, x in zip(self.inputs, inputs):
                if static is not None:
                    static.detach().copy_(x)
            if self.first_backward and self.training:  # the first call's backward never came: check this one's
                self.rng = _rng_state(self.capture)
                self.expected = self._forward()
        if self.expected is not None:  # the replay that is checked draws dropout as its reference did
            _set_rng_state(self.capture, self.rng)
        if self.capture:
            self.forward_graph.replay()
        else:
            self.outputs = self._forward()

    def _run_backward(self, grad_outputs):
        self.cache.pending = None
        for static, output, g in zip(self.grad_outputs, self.outputs, grad_outputs):
            if output.requires_grad:
                static.copy_(g)
        if self.capture:
            self.backward_graph.replay()
        else:  # into buffers kept from call to call, as a graph's are
            grads = self._backward()
            self.grads = self.grads or [None if g is None else torch.empty_like(g) for g in grads]
            for static, g in zip(self.grads, grads):
                if g is not None:
                    static.copy_(g)
        grads = self.grads
        if self.first_backward:
            self.first_backward = False
            eager = self._backward(outputs=self.expected)
            self.expected = None
            try:
                self._check("gradients", grads, eager)
            except GraphFailure as failure:  # in autograd's backward: no exception, eager gradients instead
                self.cache.fail(self.shape, failure)
                grads = eager
        grads = iter(grads)
        # None for what needs no gradient (and a parameter this pass left
        # unused, e.g. by LayerDrop: its .grad stays as it was, as in eager)
        return [None if x is None or not x.requires_grad else next(grads) for x in self.inputs] + list(grads)


class _SideStream:
    """Warm-up on a side stream, as capture requires, joined before capture."""

    def __enter__(self):
        self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        self.context = torch.cuda.stream(self.stream)
        self.context.__enter__()

    def __exit__(self, *exc):
        self.context.__exit__(*exc)
        torch.cuda.current_stream().wait_stream(self.stream)
        torch.cuda.synchronize()


class _PendingBackward:
    """Held by a replay's autograd node: alive while its backward may come."""


class _Replay(torch.autograd.Function):
    """A GraphedFunction as one autograd node over its inputs and parameters.
    The gradients handed back are the backward graph's buffers themselves,
    held by it: autograd copies them into .grad rather than adopting them."""

    @staticmethod
    def forward(ctx, graphed: GraphedFunction, *inputs_and_params):
        ctx.graphed = graphed
        ctx.pending = graphed.cache.backward_pending()
        graphed._run_forward(inputs_and_params[: len(graphed.inputs)])
        outputs = tuple(o.detach() for o in graphed.outputs)
        ctx.mark_non_differentiable(*[o for o, static in zip(outputs, graphed.outputs) if not static.requires_grad])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs):
        return (None, *ctx.graphed._run_backward(grad_outputs))


def _memory_bytes(capture: bool) -> int:
    if capture:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class GraphCache:
    """Captured functions by shape key, the least recently used dropped past
    `max_graphs` or `max_bytes` (default: a quarter of the device's memory),
    all on one memory pool. `capture=False` runs the same bookkeeping
    without graphs."""

    def __init__(self, capture: bool, name: str, max_graphs: int = 64, max_bytes: Optional[int] = None):
        self.name, self.max_graphs = name, max_graphs
        self.max_bytes = max_bytes if max_bytes is not None else _memory_bytes(capture) // 4
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: "OrderedDict[Hashable, GraphedFunction]" = OrderedDict()
        self.keys = set()  # every key seen
        self.calls = self.hits = 0  # since the last statistics line
        self.recent = collections.deque(maxlen=HIT_WINDOW)  # hit or miss of the last lookups
        self.captured = 0
        self.pending: Optional[Callable] = None  # weak reference to the node of a forward awaiting its backward
        self.failed: Optional[str] = None  # why every call now runs eagerly

    def __call__(self, key: Hashable, fn, inputs: Sequence[Optional[Tensor]], params: Sequence[Tensor] = (),
                 state: Sequence[Tensor] = (), shape: str = ""):
        """fn(*inputs), from the graph cached for `key` (captured now if
        missing), or eagerly once the cache has failed or while another
        forward awaits its backward. `shape`: the key in words, for the log."""
        if self.failed is not None or self.awaiting_backward():
            return tuple(fn(*inputs))
        graphed = self.graphs.get(key)
        self.calls += 1
        self.hits += graphed is not None
        self.recent.append(graphed is not None)
        self.keys.add(key)
        try:
            if graphed is None:
                graphed = GraphedFunction(fn, inputs, params, self, state, shape or str(key))
                self._insert(key, graphed)
            self.graphs.move_to_end(key)
            outputs = graphed(*inputs)
        except GraphFailure as failure:
            self.fail(shape or str(key), failure)
            return tuple(fn(*inputs))
        if len(self.recent) == HIT_WINDOW and sum(self.recent) < LOW_HIT_RATE * HIT_WINDOW:
            self.fail("", GraphFailure(f"only {sum(self.recent)} of the last {HIT_WINDOW} calls found their graph "
                                       "cached: shapes vary too much for graphs to pay"))
        return outputs

    def _insert(self, key, graphed: GraphedFunction) -> None:
        self.graphs[key] = graphed
        self.captured += 1
        while len(self.graphs) > 1 and (len(self.graphs) > self.max_graphs or
                                        sum(g.nbytes() for g in self.graphs.values()) > self.max_bytes):
            self.graphs.popitem(last=False)
        if self.pool is not None:
            logger.info(f"{self.name}: captured CUDA graph {self.captured} for {graphed.shape} "
                        f"({len(self.graphs)} cached)")

    def fail(self, shape: str, failure: GraphFailure) -> None:
        """Every later call runs eagerly; said once."""
        if self.failed is None:
            self.failed = str(failure)
            where = f" for {shape}" if shape else ""
            logger.warning(f"{self.name}: CUDA graph{where}: {failure}; running eagerly from now on")
            self.graphs.clear()

    # --- a forward awaiting its backward ----------------------------------------------------------

    def backward_pending(self) -> _PendingBackward:
        """A token for the replay's autograd node to hold: while it lives (and
        its backward has not run), the graph's saved activations are in the pool."""
        token = _PendingBackward()
        self.pending = weakref.ref(token)
        return token

    def awaiting_backward(self) -> bool:
        return self.pending is not None and self.pending() is not None

    def forget(self, captured_over: Callable[[Hashable], bool]) -> None:
        """Drops the graphs whose key says they were captured over buffers that are gone."""
        for key in [key for key in self.graphs if captured_over(key)]:
            del self.graphs[key]

    def statistics(self) -> str:
        """One line for the log; calls and hits since the previous line, keys since the start."""
        rate = 100 * self.hits / self.calls if self.calls else 0.0
        line = f"graph cache | keys {len(self.keys)} | calls {self.calls} | hits {self.hits} | hit rate {rate:.1f}%"
        self.calls = self.hits = 0
        return line
