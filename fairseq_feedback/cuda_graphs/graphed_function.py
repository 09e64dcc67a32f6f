"""A function of fixed-shape tensors captured as graphs, forward and
backward, replayed, and given up for eager at any failure.

The feedback loop launches hundreds of small kernels per token, so on a GPU
it costs launches, not arithmetic: captured once per input shape, a block's
kernels replay without the host in the way. This follows
torch.cuda.make_graphed_callables (the forward's graph and the backward's,
replayed inside an autograd Function, replay.py) but captures by hand,
because that one hands autograd aliases of its gradient buffers and cannot
check a graph or fall back.

A shape is captured at its second sighting (graph_cache.py): its first ran
eagerly, forward and backward, which is the warm-up capture needs (lazy
initialisation: cuBLAS handles, the autograd engine's threads). Captures run
with Python's cyclic garbage collector paused: a graph it frees during a
capture (one that a dropped model left in a reference cycle) invalidates
that capture. A graph holds no reference to its cache or to this object, so
that nothing of it waits for the collector: it goes when its cache drops it,
released there and then (`release`). The function captured is the caller's:
what it holds, the graph holds (a caller's function must not hold what
holds the cache).

Every graph shares one memory pool, so a replay may overwrite memory that
another graph left there. Nothing a graph leaves in the pool is read after
another replay: static inputs and decoding state live outside the pool,
outputs are cloned as they are handed out, gradients are copied into .grad
by the backward that replays them, and while a training forward awaits its
backward (its activations are in the pool) every other call runs eagerly
(pool_ledger.py). The static inputs and output gradients of every graph
share one set of buffers, which a call overwrites (static_buffers.py). A
second backward over the same outputs (retain_graph) runs eagerly from the
block's inputs, or is refused once another call has copied its inputs
over them.

Replays are checked against the eager computation while checks are due
(checks.py). A mismatch, or a failure at any stage (capture, a replay, the
check's own eager computation), gives the eager result for that call; the
function records why (`failure`) and its cache gives it up.
"""

import contextlib
import gc
from functools import partial
from typing import Callable, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .autograd_pass import Outputs, Pass, autocast_dtype, pass_gradients, run_pass
from .checks import EagerChecks
from .failure import GraphFailure, stage
from .pool_account import PoolAccount
from .pool_ledger import PoolLedger
from .replay import Replay


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


class GraphedFunction:
    """fn(*inputs, *params) -> tuple of outputs, for inputs shaped as
    `sample_inputs`: one graph for the forward and, when gradients are on,
    one for the backward, with respect to the inputs and `params` that
    require them. `params`: what fn reads besides its inputs, handed over as
    arguments (as torch.func.functional_call takes a module's parameters),
    in place, never copied: a graph reads them where they are.
    `state`: tensors that fn updates in place (a decoding cache), left as
    they were by capture. `ledger`: what the graphs of the backend's pool
    share. `fully_checked`: checked at new inputs and after another graph's
    replay too (checks.py). Raises GraphFailure if capture fails (its device
    recovered, what it captured released); later failures give this call
    the eager result and are kept in `failure`."""

    def __init__(self, fn: Callable[..., Sequence[Tensor]], sample_inputs: Sequence[Optional[Tensor]],
                 params: Sequence[Tensor], backend, ledger: PoolLedger, state: Sequence[Tensor] = (),
                 shape: str = "", fully_checked: bool = True):
        self.backend, self.ledger, self.state, self.shape = backend, ledger, tuple(state), shape
        self.generator = backend.generator
        self.device_type = backend.device.type
        static = ledger.static
        with stage("static inputs"):
            self.inputs = [None if x is None else
                           static.holding(("input", i), x.detach()).requires_grad_(x.requires_grad)
                           for i, x in enumerate(sample_inputs)]
            static.written()
            before = [t.clone() for t in self.state]
        self.params = list(params)
        self.training = torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (*self.inputs, *self.params))
        # under --amp: autocast again inside (run_pass)
        self.autocast = autocast_dtype(self.device_type)
        self.calls = 0
        self.replays_seen: Optional[int] = None  # the pool's replay count after this graph's last replay
        self.failure: Optional[GraphFailure] = None  # why this graph gave its call the eager result
        self.eager_passes = 0  # eager forward (and backward) passes this graph cost beyond its calls' own
        self.forward_graph = self.backward_graph = None

        rng, made, recorded = self.generator.get_state(), PoolAccount(), Pass()
        try:
            with collector_paused(), torch.autocast(self.device_type, enabled=False):
                with stage("capture"), made:
                    self.forward_graph, self.outputs = backend.capture(
                        partial(run_pass, fn, [*self.inputs, *self.params], self.autocast, self.device_type,
                                self.training, recorded), self)
                self.differentiable = [o.requires_grad for o in recorded.outputs]
                self.grad_outputs = tuple(static.holding(("output gradient", i), torch.zeros_like(o))
                                          for i, o in enumerate(self.outputs))
                if self.training:
                    with stage("capture"), made:
                        self.backward_graph, self.grads = backend.capture(
                            partial(pass_gradients, recorded, self.grad_outputs, self.device_type), self)
        except GraphFailure:
            self.release()
            raise
        finally:  # capture draws nothing, and the stand-in's recording must not either
            self.generator.set_state(rng)
            self._restore(before)
        # the capture's pass goes (a replay records its own): what its autograd graph kept, back to the pool
        recorded.outputs, recorded.targets = (), ()
        self.eager_passes += 1
        precise = self.autocast is None and all(o.dtype in (torch.float32, torch.float64) for o in self.outputs)
        self.checks = EagerChecks(fully_checked, precise)
        self.nbytes = made.live  # in the pool; the static buffers are the cache's

    def release(self) -> None:
        """The graphs and what they hold in the pool, freed now (never during a capture)."""
        for graph in (self.forward_graph, self.backward_graph):
            if graph is not None:
                self.backend.release(graph)
        self.forward_graph = self.backward_graph = None
        self.outputs = self.grads = ()

    def forward_eagerly(self, fn: Callable) -> Pass:
        """fn on the static inputs, eagerly."""
        run = Pass()
        run_pass(fn, [*self.inputs, *self.params], self.autocast, self.device_type, self.training, run)
        return run

    def gradients(self, run: Pass, grad_outputs: Sequence[Tensor]) -> Outputs:
        return pass_gradients(run, grad_outputs, self.device_type)

    def _restore(self, saved: Sequence[Tensor]) -> None:
        for t, value in zip(self.state, saved):
            t.copy_(value)

    def _give_up(self, failure: GraphFailure) -> None:
        self.failure = self.failure or failure

    # --- a call -----------------------------------------------------------------------------------

    def __call__(self, fn: Callable[..., Sequence[Tensor]], *inputs: Optional[Tensor]) -> Outputs:
        """This call's `fn(*inputs, *params)`. The graph replays the function it
        captured; the checks and the eager fallback run this call's `fn`,
        so that a graph that kept a tensor from outside its inputs shows."""
        self.calls += 1
        for static, x in zip(self.inputs, inputs):
            if static is not None:
                static.detach().copy_(x)
        self.ledger.static.written()
        due = self.checks.due(self.replays_seen, self.ledger.replays)
        if self.training:
            outputs = Replay.apply(self, fn, due, *inputs, *self.params)
        else:
            outputs, _, _ = self.replay_forward(fn, due)
        # cloned: what a caller keeps (features, a criterion's second look) outlives the next replay
        return tuple(o.clone() for o in outputs)

    def replay_forward(self, fn: Callable, due: FrozenSet[str]) -> Tuple[Outputs, Optional[Pass], bool]:
        """This call's outputs; the eager pass when it is checked or has
        failed (with its autograd graph, in training), whose outputs are the
        call's after a failure; and whether the outputs passed a check."""
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
                judged = self.checks.judge("outputs", self.outputs, expected.outputs)
        except GraphFailure as e:
            failure = e
        if failure is not None:  # outside the except: nothing of the failure is held while eager runs
            self._give_up(failure)
            eager = self._rerun(fn, rng, before)
            return eager.outputs, eager, False
        if not due:
            return self.outputs, None, False
        if judged and not self.training:
            self.checks.passed(due)
        self._restore(replayed)
        return self.outputs, expected, judged

    def _rerun(self, fn: Callable, rng: Tensor, state: Sequence[Tensor]) -> Pass:
        """This call's eager computation, from the random state `rng` and decoding state `state`."""
        self.generator.set_state(rng)
        self._restore(state)
        return self.forward_eagerly(fn)

    def replay_backward(self, ctx, grad_outputs: Sequence[Tensor]) -> List[Optional[Tensor]]:
        """The gradients of a Replay node's inputs and parameters (replay.py)."""
        self.ledger.backward_done()
        if ctx.backwards:
            # a second backward over these outputs (retain_graph): other graphs
            # may have replayed over the activations in the pool, so eagerly,
            # from the inputs, unless a later call put others in their place
            if ctx.written != self.ledger.static.writes:
                raise RuntimeError("a second backward through a block replayed as a CUDA graph, after another call "
                                   "of its graphs copied its inputs over this one's: run the forward again before "
                                   "each backward, or --cuda-graphs off")
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
        return [None if x is None or not x.requires_grad else next(grads) for x in (*self.inputs, *self.params)]

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
            if self.checks.judge("gradients", self.grads, eager) and ctx.judged:
                self.checks.passed(ctx.due)
        return self.grads

    def _eager_gradients(self, ctx, grad_outputs: Sequence[Tensor]) -> Outputs:
        """The gradients of this call computed eagerly again, from its inputs
        (still in the static buffers: no other call replays this graph while
        its backward is awaited) and its dropout draws."""
        after = self.generator.get_state()
        run = self._rerun(ctx.fn, ctx.rng, ())
        self.generator.set_state(after)
        return self.gradients(run, grad_outputs)
