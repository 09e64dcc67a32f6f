"""A function of fixed-shape tensors replayed as a graph, forward and backward,
checked against eager, and given up for eager at any failure.

The feedback loop launches hundreds of small kernels per token, so on a GPU
it costs launches, not arithmetic: captured once per input shape, a block's
kernels replay without the host in the way. This follows
torch.cuda.make_graphed_callables (a warm-up forward and backward on a side
stream, then the forward's graph and the backward's, replayed inside an
autograd Function so that parameters get their gradients through autograd,
where DDP's hooks see them). Written here rather than used from there
because its backward hands autograd detached aliases of the graph's
gradient buffers, which AccumulateGrad may adopt as a parameter's .grad
(with --update-freq the next replay would overwrite gradients already
accumulated), and because it cannot check a graph or fall back.

The warm-up is an autograd graph of its own, run forward and backward once:
a backward never runs twice over one autograd graph (the loop's per-block
weight gradients consume what their forward left).

Every graph shares one memory pool, so a replay may overwrite memory that
another graph left there. Nothing a graph leaves in the pool is read after
another replay: static inputs and decoding state live outside the pool,
outputs are cloned as they are handed out, gradients are copied into .grad
by the backward that replays them, and while a training forward awaits its
backward (its activations are in the pool) every other call runs eagerly. A
second backward over the same outputs (retain_graph) runs eagerly from the
block's inputs, or is refused once the graph has run again on other inputs.

The checks. A replay is compared with the eager computation on the same
inputs and dropout draws (outputs, and in training gradients), at a
tolerance by precision, at three moments: its first replay, its first
replay of inputs copied in afresh, and its first replay after another graph
replayed (which may have overwritten what it left in the pool). A step with
a non-finite value in either result (an fp16 overflow, which the loss
scaler skips) is not judged: the next replay is checked instead. A mismatch,
or a failure at any stage (warm-up forward or backward, capture, a replay,
the check's own eager computation), gives one warning; that call's result
comes from the eager path, and every later call runs eagerly.
"""

import contextlib
from typing import Callable, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

Outputs = Tuple[Optional[Tensor], ...]

# the largest difference allowed, relative to the largest value, by precision
TOLERANCE_FP32, TOLERANCE_HALF = 1e-4, 2e-2
# checks in a row left unjudged (non-finite values) after which a graph is given up
MAX_UNJUDGED = 8
FIRST_REPLAY, NEW_INPUTS, AFTER_ANOTHER_GRAPH = "first replay", "new inputs", "after another graph"


class GraphFailure(Exception):
    """A graph that cannot be trusted: the message says why."""


@contextlib.contextmanager
def stage(name: str):
    """Any error in this stage is a GraphFailure naming it."""
    try:
        yield
    except Exception as e:  # out of memory, a host sync in the loop, an operator capture refuses, ...
        message = str(e).splitlines()[0] if str(e) else ""
        raise GraphFailure(f"{name} failed ({type(e).__name__}: {message})") from e


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast casts to on this kind of device, or None."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def largest_difference(got: Tensor, expected: Tensor) -> Optional[float]:
    """max |got - expected| / max |expected|, or None where either holds a
    non-finite value (a step that cannot be judged)."""
    got, expected = got.detach().float(), expected.detach().float()
    if not (torch.isfinite(got).all() and torch.isfinite(expected).all()):
        return None
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-6))


class _StoragesMade(TorchDispatchMode):
    """The storages that operators make while active; `held()` counts those
    still alive: what a capture leaves in the pool (static outputs and
    gradients, and whatever its autograd graph keeps)."""

    def __init__(self):
        super().__init__()
        self.made = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (func.is_view or func._schema.is_mutable):
            for t in tree_leaves(out):
                if isinstance(t, Tensor):
                    storage = t.untyped_storage()
                    self.made.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
        return out

    def held(self) -> int:
        return sum(nbytes for ref, nbytes in self.made.values() if not ref.expired())


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class GraphedFunction:
    """fn(*inputs) -> tuple of outputs, for inputs shaped as `sample_inputs`:
    one graph for the forward and, when gradients are on, one for the
    backward, with respect to the inputs that require them and `params`.
    `state`: tensors that fn updates in place (a decoding cache), left as
    they were by warm-up and capture. Raises GraphFailure if warm-up or
    capture fails; later failures fall back to eager within the call."""

    def __init__(self, fn: Callable[..., Sequence[Tensor]], sample_inputs: Sequence[Optional[Tensor]],
                 params: Sequence[Tensor], cache, state: Sequence[Tensor] = (), shape: str = ""):
        self.fn, self.cache, self.state, self.shape = fn, cache, tuple(state), shape
        self.backend = cache.backend
        self.generator = self.backend.generator
        with stage("static inputs"):
            self.inputs = [None if x is None else x.detach().clone().requires_grad_(x.requires_grad)
                           for x in sample_inputs]
            before = [t.clone() for t in self.state]
        self.params = [p for p in params if p.requires_grad] if torch.is_grad_enabled() else []
        self.grad_targets = [x for x in self.inputs if x is not None and x.requires_grad] + self.params
        self.training = torch.is_grad_enabled() and bool(self.grad_targets)
        # under --amp: autocast again inside, without its cache of cast weights,
        # which would otherwise hand the graphs the weights of the warm-up
        self.autocast = autocast_dtype(self.backend.device.type)
        self.live: Outputs = ()  # the outputs as autograd knows them (the last replay's, in the stand-in)
        self.pending = {FIRST_REPLAY, NEW_INPUTS, AFTER_ANOTHER_GRAPH}  # checks still to make
        self.unjudged = {"outputs": 0, "gradients": 0}  # checks in a row that could not be judged
        self.calls = 0
        self.replays_seen: Optional[int] = None  # the cache's replay count after this graph's last replay

        rng, made = self.generator.get_state(), _StoragesMade()
        try:
            self._warm_up()
            with stage("capture"), torch.autocast(self.backend.device.type, enabled=False), made:
                self.forward_graph, self.outputs = self.backend.capture(self._forward_live, self)
                if self.training:
                    self.backward_graph, self.grads = self.backend.capture(lambda: self._backward(self.live), self)
        finally:  # capture draws nothing, and the stand-in's recording must not either
            self.generator.set_state(rng)
            self._restore(before)
        precise = self.autocast is None and all(o.dtype in (torch.float32, torch.float64) for o in self.outputs)
        self.tolerance = TOLERANCE_FP32 if precise else TOLERANCE_HALF
        self.nbytes = made.held() + _nbytes([*self.inputs, *self.grad_outputs])

    def _warm_up(self) -> None:
        """A forward and a backward over an autograd graph of their own,
        before capture, as capture requires (lazy initialisation)."""
        with self.backend.side_stream():
            with stage("warm-up forward"):
                outputs = self._forward()
                self.grad_outputs = tuple(torch.zeros_like(o) for o in outputs)
            if self.training:
                with stage("warm-up backward"):
                    self._backward(outputs)

    def _forward(self, fn: Optional[Callable] = None) -> Outputs:
        """fn (by default the captured one) on the static inputs."""
        autocast = contextlib.nullcontext()
        if self.autocast is not None:
            autocast = torch.autocast(self.backend.device.type, self.autocast, cache_enabled=False)
        with autocast, torch.enable_grad() if self.training else torch.no_grad():
            return tuple((fn or self.fn)(*self.inputs))

    def _forward_live(self) -> Outputs:
        self.live = self._forward()
        return self.live

    def _backward(self, outputs: Outputs, grad_outputs: Optional[Sequence[Tensor]] = None) -> Outputs:
        differentiable = [(o, g) for o, g in zip(outputs, grad_outputs or self.grad_outputs) if o.requires_grad]
        # never under autocast: its weight cache is what capture forbids, and a backward needs no casts
        with torch.autocast(self.backend.device.type, enabled=False):
            return torch.autograd.grad([o for o, _ in differentiable], self.grad_targets,
                                       [g for _, g in differentiable], allow_unused=True)

    def _restore(self, saved: Sequence[Tensor]) -> None:
        for t, value in zip(self.state, saved):
            t.copy_(value)

    # --- a call -----------------------------------------------------------------------------------

    def __call__(self, fn: Callable[..., Sequence[Tensor]], *inputs: Optional[Tensor]) -> Outputs:
        """This call's `fn(*inputs)`. The graph replays the function it
        captured; the checks and the eager fallback run this call's `fn`,
        so that a graph that kept a tensor from outside its inputs shows."""
        self.call_fn = fn
        self.calls += 1
        for static, x in zip(self.inputs, inputs):
            if static is not None:
                static.detach().copy_(x)
        due = self._checks_due()
        if self.training:
            outputs = _Replay.apply(self, due, *inputs, *self.params)
        else:
            outputs, _, _ = self.replay_forward(due)
        # cloned: what a caller keeps (features, a criterion's second look) outlives the next replay
        return tuple(o.clone() for o in outputs)

    def _checks_due(self) -> FrozenSet[str]:
        met = {FIRST_REPLAY}  # until one is judged
        if self.replays_seen is not None:
            met.add(NEW_INPUTS)
            if self.cache.replays != self.replays_seen:
                met.add(AFTER_ANOTHER_GRAPH)
        return frozenset(met & self.pending)

    def replay_forward(self, due: FrozenSet[str]) -> Tuple[Outputs, Optional[Outputs], bool]:
        """This call's outputs; the eager computation's when it is checked or
        has failed (with its autograd graph, in training); and whether the
        outputs passed a check."""
        rng = self.generator.get_state()
        before = [t.clone() for t in self.state] if due else ()
        try:
            with stage("replay"):  # a replay that fails has run nothing
                self.backend.replay(self.forward_graph)
            self.cache.replayed(self)
            if not due:
                return self.outputs, None, False
            replayed = [t.clone() for t in self.state]
            with stage("the check's eager forward"):
                expected = self._rerun(rng, before)
            judged = self._judge("outputs", self.outputs, expected)
        except GraphFailure as failure:
            self.cache.fail(self.shape, failure)
            eager = self._rerun(rng, before)
            return eager, eager, False
        if judged and not self.training:
            self.pending -= due
        self._restore(replayed)
        return self.outputs, expected, judged

    def _rerun(self, rng: Tensor, state: Sequence[Tensor]) -> Outputs:
        """This call's eager computation, from the random state `rng` and decoding state `state`."""
        self.generator.set_state(rng)
        self._restore(state)
        return self._forward(self.call_fn)

    def replay_backward(self, ctx, grad_outputs: Sequence[Tensor]) -> List[Optional[Tensor]]:
        self.cache.pending = None
        if ctx.backwards:
            # a second backward over these outputs (retain_graph): other graphs
            # may have replayed over the activations in the pool, so eagerly,
            # from the inputs, unless a later call put others in their place
            if ctx.call != self.calls:
                raise RuntimeError("a second backward through a block replayed as a CUDA graph, after the graph ran "
                                   "again on other inputs: run the forward again before each backward, or "
                                   "--cuda-graphs off")
            grads = self._eager_gradients(ctx, grad_outputs)
        elif ctx.eager:
            grads = self._backward(ctx.expected, grad_outputs)
        else:
            try:
                grads = self._replayed_gradients(ctx, grad_outputs)
            except GraphFailure as failure:
                self.cache.fail(self.shape, failure)
                grads = self._eager_gradients(ctx, grad_outputs)
        ctx.expected = None
        ctx.backwards += 1
        grads = iter(grads)
        # None for what needs no gradient (and a parameter this pass left
        # unused, e.g. by LayerDrop: its .grad stays as it was, as in eager)
        return [None if x is None or not x.requires_grad else next(grads) for x in self.inputs] + list(grads)

    def _replayed_gradients(self, ctx, grad_outputs: Sequence[Tensor]) -> Outputs:
        for static, live, g in zip(self.grad_outputs, self.live, grad_outputs):
            if live.requires_grad:
                static.copy_(g)
        with stage("backward replay"):
            self.backend.replay(self.backward_graph)
        self.cache.replayed(self)
        if ctx.expected is not None:
            with stage("the check's eager backward"):
                eager = self._backward(ctx.expected, grad_outputs)
            if self._judge("gradients", self.grads, eager) and ctx.judged:
                self.pending -= ctx.due
        return self.grads

    def _eager_gradients(self, ctx, grad_outputs: Sequence[Tensor]) -> Outputs:
        """The gradients of this call computed eagerly again, from its inputs
        (still in the static buffers: no other call replays this graph while
        its backward is awaited) and its dropout draws."""
        after = self.generator.get_state()
        outputs = self._rerun(ctx.rng, ())
        self.generator.set_state(after)
        return self._backward(outputs, grad_outputs)

    def _judge(self, what: str, got: Outputs, expected: Outputs) -> bool:
        """Whether the graph's `got` passed against eager's `expected`: False
        if the step cannot be judged (not finite); raises GraphFailure if they
        differ, or after MAX_UNJUDGED steps in a row that could not be judged."""
        differences = [largest_difference(g, e) for g, e in zip(got, expected) if g is not None and e is not None]
        if None in differences:
            self.unjudged[what] += 1
            if self.unjudged[what] >= MAX_UNJUDGED:
                raise GraphFailure(f"its {what} were not finite at {MAX_UNJUDGED} checks in a row")
            return False
        self.unjudged[what] = 0
        worst = max(differences, default=0.0)
        if worst > self.tolerance:
            raise GraphFailure(f"its {what} differ from eager by {worst:.3g} (at most {self.tolerance:g})")
        return True


class _Replay(torch.autograd.Function):
    """A GraphedFunction's call as one autograd node over its inputs and
    parameters. The gradients handed back are the backward graph's buffers
    themselves, held by it: autograd copies them into .grad rather than
    adopting them."""

    @staticmethod
    def forward(ctx, graphed: GraphedFunction, due: FrozenSet[str], *inputs_and_params):
        ctx.graphed, ctx.due = graphed, due
        ctx.pending = graphed.cache.backward_pending()
        ctx.rng = graphed.generator.get_state()
        ctx.call, ctx.backwards = graphed.calls, 0
        outputs, ctx.expected, ctx.judged = graphed.replay_forward(due)
        ctx.eager = outputs is ctx.expected  # the graph failed: eager for the backward too
        outputs = tuple(o.detach() for o in outputs)
        ctx.mark_non_differentiable(*[o for o, live in zip(outputs, graphed.live) if not live.requires_grad])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs):
        return (None, None, *ctx.graphed.replay_backward(ctx, grad_outputs))
