"""A function of fixed-shape tensors replayed as a graph, forward and backward,
checked against eager, and given up for eager at any failure.

The feedback loop launches hundreds of small kernels per token, so on a GPU
it costs launches, not arithmetic: captured once per input shape, a block's
kernels replay without the host in the way. This follows
torch.cuda.make_graphed_callables (the forward's graph and the backward's,
replayed inside an autograd Function so that parameters get their gradients
through autograd, where DDP's hooks see them). Written here rather than used
from there because its backward hands autograd detached aliases of the
graph's gradient buffers, which AccumulateGrad may adopt as a parameter's
.grad (with --update-freq the next replay would overwrite gradients already
accumulated), and because it cannot check a graph or fall back.

A shape is captured at its second sighting (graph_cache.py): its first ran
eagerly, forward and backward, which is the warm-up capture needs (lazy
initialisation: cuBLAS handles, the autograd engine's threads). Captures run
with Python's cyclic garbage collector paused: a graph it frees during a
capture (one that a dropped model left in a reference cycle) invalidates
that capture. A graph holds no reference to its cache or to this object, so
that nothing of it waits for the collector: it goes when its cache drops it,
released there and then (`release`).

Every graph shares one memory pool, so a replay may overwrite memory that
another graph left there. Nothing a graph leaves in the pool is read after
another replay: static inputs and decoding state live outside the pool,
outputs are cloned as they are handed out, gradients are copied into .grad
by the backward that replays them, and while a training forward awaits its
backward (its activations are in the pool) every other call runs eagerly
(PoolLedger). A second backward over the same outputs (retain_graph) runs
eagerly from the block's inputs, or is refused once the graph has run again
on other inputs.

The checks. A replay is compared with the eager computation on the same
inputs and dropout draws (outputs, and in training gradients), at a
tolerance by precision: at its first replay, and, for a cache's first
FULLY_CHECKED graphs, at their first replay of inputs copied in afresh and
their first replay after another graph replayed (which may have overwritten
what it left in the pool). Those two catch defects of the code around the
graphs (a tensor captured from outside the inputs, a result read from the
pool after another replay), which every graph of a cache shares, so a few
graphs show them. A step with non-finite values in both results (an fp16
overflow, which the loss scaler skips) is not judged: the next replay is
checked instead; non-finite values in the graph's result alone are a
failure. A mismatch, or a failure at any stage (capture, a replay, the
check's own eager computation), gives the eager result for that call; the
function records why (`failure`) and its cache gives it up.
"""

import contextlib
import gc
import weakref
from functools import partial
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
# a cache's graphs checked at new inputs and after another graph's replay, too
FULLY_CHECKED = 4


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
    """max |got - expected| / max |expected|; None where the eager result
    holds a non-finite value (a step that cannot be judged), infinity where
    only the graph's does."""
    got, expected = got.detach().float(), expected.detach().float()
    if not torch.isfinite(expected).all():
        return None
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-6))


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector held off (as vLLM and sglang hold it
    off while they capture): a graph it frees during a capture invalidates it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _PendingBackward:
    """Held by a replay's autograd node: alive while its backward may come."""


class PoolLedger:
    """What the graphs of one memory pool must know of each other: how many
    replays the pool has seen (a graph's leftovers may have been overwritten
    since its own), and the training forward whose backward is still to come
    (its activations are in the pool). Held by every graph of the pool and
    by their cache; it holds no graph."""

    def __init__(self):
        self.replays = 0
        self._pending: Optional[Callable] = None  # weak reference to the token of a forward awaiting its backward

    def replayed(self) -> int:
        self.replays += 1
        return self.replays

    def await_backward(self) -> _PendingBackward:
        """A token for the replay's autograd node to hold: while it lives (and
        its backward has not run), the graph's saved activations are in the pool."""
        token = _PendingBackward()
        self._pending = weakref.ref(token)
        return token

    def backward_done(self) -> None:
        self._pending = None

    def awaiting_backward(self) -> bool:
        return self._pending is not None and self._pending() is not None


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


class _Recorded:
    """The outputs of the forward graph's capture (in the stand-in, of its
    last replay), as autograd knows them: what the backward graph differentiates."""

    outputs: Outputs = ()


def _run(fn: Callable, inputs: Sequence[Optional[Tensor]], autocast: Optional[torch.dtype], device_type: str,
         training: bool, recorded: Optional[_Recorded] = None) -> Outputs:
    """fn(*inputs), under autocast again if the caller was (without its
    cache of cast weights, which would hand the graphs the weights of an
    earlier call), with gradients if training. A function of its arguments
    alone: what a graph records holds nothing that holds the graph."""
    cast = contextlib.nullcontext()
    if autocast is not None:
        cast = torch.autocast(device_type, autocast, cache_enabled=False)
    with cast, torch.enable_grad() if training else torch.no_grad():
        outputs = tuple(fn(*inputs))
    if recorded is not None:
        recorded.outputs = outputs
    return outputs


def _gradients(outputs: Outputs, grad_outputs: Sequence[Tensor], targets: Sequence[Tensor],
               device_type: str) -> Outputs:
    """The gradients of `targets` from those of the differentiable outputs."""
    differentiable = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    # never under autocast: its weight cache is what capture forbids, and a backward needs no casts
    with torch.autocast(device_type, enabled=False):
        return torch.autograd.grad([o for o, _ in differentiable], targets, [g for _, g in differentiable],
                                   allow_unused=True)


def _recorded_gradients(recorded: _Recorded, grad_outputs: Sequence[Tensor], targets: Sequence[Tensor],
                        device_type: str) -> Outputs:
    return _gradients(recorded.outputs, grad_outputs, targets, device_type)


class GraphedFunction:
    """fn(*inputs) -> tuple of outputs, for inputs shaped as `sample_inputs`:
    one graph for the forward and, when gradients are on, one for the
    backward, with respect to the inputs that require them and `params`.
    `state`: tensors that fn updates in place (a decoding cache), left as
    they were by capture. `ledger`: what the graphs of the backend's pool
    share. `fully_checked`: checked at new inputs and after another graph's
    replay too. Raises GraphFailure if capture fails (its device recovered,
    what it captured released); later failures give this call the eager
    result and are kept in `failure`."""

    def __init__(self, fn: Callable[..., Sequence[Tensor]], sample_inputs: Sequence[Optional[Tensor]],
                 params: Sequence[Tensor], backend, ledger: PoolLedger, state: Sequence[Tensor] = (),
                 shape: str = "", fully_checked: bool = True):
        self.backend, self.ledger, self.state, self.shape = backend, ledger, tuple(state), shape
        self.generator = backend.generator
        self.device_type = backend.device.type
        with stage("static inputs"):
            self.inputs = [None if x is None else x.detach().clone().requires_grad_(x.requires_grad)
                           for x in sample_inputs]
            before = [t.clone() for t in self.state]
        self.params = [p for p in params if p.requires_grad] if torch.is_grad_enabled() else []
        self.grad_targets = [x for x in self.inputs if x is not None and x.requires_grad] + self.params
        self.training = torch.is_grad_enabled() and bool(self.grad_targets)
        # under --amp: autocast again inside (_run)
        self.autocast = autocast_dtype(self.device_type)
        self.pending = {FIRST_REPLAY} | ({NEW_INPUTS, AFTER_ANOTHER_GRAPH} if fully_checked else set())
        self.unjudged = {"outputs": 0, "gradients": 0}  # checks in a row that could not be judged
        self.calls = 0
        self.replays_seen: Optional[int] = None  # the pool's replay count after this graph's last replay
        self.failure: Optional[GraphFailure] = None  # why this graph gave its call the eager result
        self.eager_passes = 0  # eager forward (and backward) passes this graph cost beyond its calls' own
        self.forward_graph = self.backward_graph = None

        rng, made, recorded = self.generator.get_state(), _StoragesMade(), _Recorded()
        try:
            with collector_paused(), torch.autocast(self.device_type, enabled=False):
                with stage("capture"), made:
                    self.forward_graph, self.outputs = backend.capture(
                        partial(_run, fn, self.inputs, self.autocast, self.device_type, self.training, recorded), self)
                self.differentiable = [o.requires_grad for o in recorded.outputs]
                self.grad_outputs = tuple(torch.zeros_like(o) for o in self.outputs)
                if self.training:
                    with stage("capture"), made:
                        self.backward_graph, self.grads = backend.capture(
                            partial(_recorded_gradients, recorded, self.grad_outputs, self.grad_targets,
                                    self.device_type), self)
        except GraphFailure:
            self.release()
            raise
        finally:  # capture draws nothing, and the stand-in's recording must not either
            self.generator.set_state(rng)
            self._restore(before)
        self.eager_passes += 1
        precise = self.autocast is None and all(o.dtype in (torch.float32, torch.float64) for o in self.outputs)
        self.tolerance = TOLERANCE_FP32 if precise else TOLERANCE_HALF
        self.nbytes = made.held() + _nbytes([*self.inputs, *self.grad_outputs])

    def release(self) -> None:
        """The graphs and what they hold in the pool, freed now (never during a capture)."""
        for graph in (self.forward_graph, self.backward_graph):
            if graph is not None:
                self.backend.release(graph)
        self.forward_graph = self.backward_graph = None
        self.outputs = self.grads = ()

    def forward_eagerly(self, fn: Callable) -> Outputs:
        """fn on the static inputs, eagerly."""
        return _run(fn, self.inputs, self.autocast, self.device_type, self.training)

    def gradients(self, outputs: Outputs, grad_outputs: Sequence[Tensor]) -> Outputs:
        return _gradients(outputs, grad_outputs, self.grad_targets, self.device_type)

    def _restore(self, saved: Sequence[Tensor]) -> None:
        for t, value in zip(self.state, saved):
            t.copy_(value)

    def _give_up(self, failure: GraphFailure) -> None:
        self.failure = self.failure or failure

    # --- a call -----------------------------------------------------------------------------------

    def __call__(self, fn: Callable[..., Sequence[Tensor]], *inputs: Optional[Tensor]) -> Outputs:
        """This call's `fn(*inputs)`. The graph replays the function it
        captured; the checks and the eager fallback run this call's `fn`,
        so that a graph that kept a tensor from outside its inputs shows."""
        self.calls += 1
        for static, x in zip(self.inputs, inputs):
            if static is not None:
                static.detach().copy_(x)
        due = self._checks_due()
        if self.training:
            outputs = _Replay.apply(self, fn, due, *inputs, *self.params)
        else:
            outputs, _, _ = self.replay_forward(fn, due)
        # cloned: what a caller keeps (features, a criterion's second look) outlives the next replay
        return tuple(o.clone() for o in outputs)

    def _checks_due(self) -> FrozenSet[str]:
        met = {FIRST_REPLAY}  # until one is judged
        if self.replays_seen is not None:
            met.add(NEW_INPUTS)
            if self.ledger.replays != self.replays_seen:
                met.add(AFTER_ANOTHER_GRAPH)
        return frozenset(met & self.pending)

    def replay_forward(self, fn: Callable, due: FrozenSet[str]) -> Tuple[Outputs, Optional[Outputs], bool]:
        """This call's outputs; the eager computation's when it is checked or
        has failed (with its autograd graph, in training); and whether the
        outputs passed a check."""
        rng = self.generator.get_state()
        before = [t.clone() for t in self.state] if due else ()
        failure = expected = None
        judged = False
        try:
            with stage("replay"):  # a replay that fails has run nothing
                self.backend.replay(self.forward_graph)
            self.replays_seen = self.ledger.replayed()
            if due:
                replayed = [t.clone() for t in self.state]
                self.eager_passes += 1
                with stage("the check's eager forward"):
                    expected = self._rerun(fn, rng, before)
                judged = self.judge("outputs", self.outputs, expected)
        except GraphFailure as e:
            failure = e
        if failure is not None:  # outside the except: nothing of the failure is held while eager runs
            self._give_up(failure)
            eager = self._rerun(fn, rng, before)
            return eager, eager, False
        if not due:
            return self.outputs, None, False
        if judged and not self.training:
            self.pending -= due
        self._restore(replayed)
        return self.outputs, expected, judged

    def _rerun(self, fn: Callable, rng: Tensor, state: Sequence[Tensor]) -> Outputs:
        """This call's eager computation, from the random state `rng` and decoding state `state`."""
        self.generator.set_state(rng)
        self._restore(state)
        return self.forward_eagerly(fn)

    def replay_backward(self, ctx, grad_outputs: Sequence[Tensor]) -> List[Optional[Tensor]]:
        self.ledger.backward_done()
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
            grads = self.gradients(ctx.expected, grad_outputs)
        else:
            failure = None
            try:
                grads = self._replayed_gradients(ctx, grad_outputs)
            except GraphFailure as e:
                failure = e
            if failure is not None:
                self._give_up(failure)
                grads = self._eager_gradients(ctx, grad_outputs)
        ctx.expected = None
        ctx.backwards += 1
        grads = iter(grads)
        # None for what needs no gradient (and a parameter this pass left
        # unused, e.g. by LayerDrop: its .grad stays as it was, as in eager)
        return [None if x is None or not x.requires_grad else next(grads) for x in self.inputs] + list(grads)

    def _replayed_gradients(self, ctx, grad_outputs: Sequence[Tensor]) -> Outputs:
        for static, differentiable, g in zip(self.grad_outputs, self.differentiable, grad_outputs):
            if differentiable:
                static.copy_(g)
        with stage("backward replay"):
            self.backend.replay(self.backward_graph)
        self.replays_seen = self.ledger.replayed()
        if ctx.expected is not None:
            with stage("the check's eager backward"):
                eager = self.gradients(ctx.expected, grad_outputs)
            if self.judge("gradients", self.grads, eager) and ctx.judged:
                self.pending -= ctx.due
        return self.grads

    def _eager_gradients(self, ctx, grad_outputs: Sequence[Tensor]) -> Outputs:
        """The gradients of this call computed eagerly again, from its inputs
        (still in the static buffers: no other call replays this graph while
        its backward is awaited) and its dropout draws."""
        after = self.generator.get_state()
        outputs = self._rerun(ctx.fn, ctx.rng, ())
        self.generator.set_state(after)
        return self.gradients(outputs, grad_outputs)

    def judge(self, what: str, got: Outputs, expected: Outputs) -> bool:
        """Whether the graph's `got` passed against eager's `expected`: False
        if the step cannot be judged (eager's not finite); raises GraphFailure
        if they differ (the graph's alone not finite, too), or after
        MAX_UNJUDGED steps in a row that could not be judged."""
        differences = [largest_difference(g, e) for g, e in zip(got, expected) if g is not None and e is not None]
        if None in differences:
            self.unjudged[what] += 1
            if self.unjudged[what] >= MAX_UNJUDGED:
                raise GraphFailure(f"its {what} were not finite at {MAX_UNJUDGED} checks in a row")
            return False
        self.unjudged[what] = 0
        worst = max(differences, default=0.0)
        if worst == float("inf"):
            raise GraphFailure(f"its {what} are not finite where eager's are")
        if worst > self.tolerance:
            raise GraphFailure(f"its {what} differ from eager by {worst:.3g} (at most {self.tolerance:g})")
        return True


class _Replay(torch.autograd.Function):
    """A GraphedFunction's call as one autograd node over its inputs and
    parameters. The gradients handed back are the backward graph's buffers
    themselves, held by it: autograd copies them into .grad rather than
    adopting them."""

    @staticmethod
    def forward(ctx, graphed: GraphedFunction, fn: Callable, due: FrozenSet[str], *inputs_and_params):
        ctx.graphed, ctx.fn, ctx.due = graphed, fn, due
        ctx.pending = graphed.ledger.await_backward()
        ctx.rng = graphed.generator.get_state()
        ctx.call, ctx.backwards = graphed.calls, 0
        outputs, ctx.expected, ctx.judged = graphed.replay_forward(fn, due)
        ctx.eager = outputs is ctx.expected  # the graph failed: eager for the backward too
        outputs = tuple(o.detach() for o in outputs)
        ctx.mark_non_differentiable(*[o for o, d in zip(outputs, graphed.differentiable) if not d])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs):
        return (None, None, None, *ctx.graphed.replay_backward(ctx, grad_outputs))
