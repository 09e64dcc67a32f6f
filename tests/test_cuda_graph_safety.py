"""The CUDA-graph path never gives a wrong number, checked on the CPU through
the stand-in for the CUDA calls (fairseq_feedback/cuda_graphs/backends.py), which
takes the path a GPU takes: warm-up forward and backward, capture, replays
into static outputs that graphs sharing a pool overwrite, the checks. A graph
that fails at any stage, or disagrees with eager, gives way to the eager
loop with one warning; a step that is not finite is not judged; what a graph
hands out outlives other graphs' replays; a search never reads what an
earlier one left in the static memory; a forward awaiting its backward is
never overwritten; the byte bound counts what graphs hold; and a real
corpus's batches fit the cache in a few shapes."""

import ast
import gc
import json
import logging
from copy import deepcopy
import re
import types
import weakref
from pathlib import Path

import pytest
import torch
from helpers import (PLUGIN, assert_same_hypotheses, assert_same_loss_and_gradients, batch, loop_graph_cache,
                     loss_and_gradients, on_loop_runs, run, run_as_a_user, run_module, search, tiny_translation_model)
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from fairseq_feedback.loop.graphed_loop import GraphedFeedbackLoop
from fairseq_feedback.loop.fused_block import BlockFunction
from fairseq_feedback.loop import block_weight_gradients
from fairseq_feedback import cuda_graphs
from fairseq_feedback.cuda_graphs import (CudaGraphBackend, GraphCache, GraphedFunction, RecordedGraphBackend,
                                          capabilities, graph_cache)
from fairseq_feedback.cuda_graphs.backends import SharedPool, unowned
from fairseq_feedback.cuda_graphs.pool_account import PoolAccount
from fairseq_feedback.cuda_graphs.checks import (AFTER_ANOTHER_GRAPH, FIRST_REPLAY, FULLY_CHECKED, MAX_UNJUDGED,
                                                 NEW_INPUTS, EagerChecks)
from fairseq_feedback.cuda_graphs.graphed_function import collector_paused

BATCHES = Path(__file__).parent / "data" / "debian_de_en_batches.json"
STATISTICS = re.compile(r"graph cache \| keys (\d+) \| calls (\d+) \| hits (\d+) \| hit rate ([\d.]+)%")
CPU = torch.device("cpu")


def stand_in_cache(**bounds):
    return GraphCache(RecordedGraphBackend(CPU), name="test", **bounds)


def training_results(model, batches):
    """Loss and gradients of each (src, lengths, prev, target) batch."""
    model.train()
    results = []
    for src, lengths, prev, target in batches:
        model.zero_grad()
        results.append(loss_and_gradients(model, lambda: model(src, lengths, prev)[0], target))
    return results


def translation_batches(d, shapes=((3, 5, 7), (3, 5, 7), (5, 9, 3))):
    batches = []
    for rows, src_len, tgt_len in shapes:
        src, lengths, prev = batch(d, rows=rows, src_len=src_len, tgt_len=tgt_len)
        batches.append((src, lengths, prev, torch.randint(d.nspecial, len(d), prev.shape)))
    return batches


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def replays_then(monkeypatch, change):
    """After every replay of the stand-in: change(graph, replay number)."""
    replay, count = RecordedGraphBackend.replay, iter(range(1, 10**6))

    def replay_and_change(self, graph):
        replay(self, graph)
        change(graph, next(count))

    monkeypatch.setattr(RecordedGraphBackend, "replay", replay_and_change)


def fail_at(monkeypatch, cls, method, when):
    """cls.method raises an injected error once: at the first call for which
    when(call number, arguments) holds."""
    original, count, failed = getattr(cls, method), iter(range(1, 10**6)), []

    def failing(self, *args, **kwargs):
        if not failed and when(next(count), args, kwargs):
            failed.append(True)
            raise RuntimeError("CUDA out of memory (injected)")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, failing)


def fail_inside_capture(monkeypatch, nth: int):
    """The stand-in's `nth` capture (1: the first graph's forward, 2: its
    backward) records a function that fails, as a host sync would on a GPU."""
    capture, count = RecordedGraphBackend.capture_graph, iter(range(1, 10**6))

    def failing():
        raise RuntimeError("CUDA out of memory (injected)")

    def capture_or_fail(self, fn, owner):
        return capture(self, failing if next(count) == nth else fn, owner)

    monkeypatch.setattr(RecordedGraphBackend, "capture_graph", capture_or_fail)


def test_the_graph_package_is_general_code_that_imports_nothing_of_this_project():
    package = Path(cuda_graphs.__file__).parent
    for module in package.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1 and not (node.module or "").startswith("fairseq"), (module.name, node.module)
            elif isinstance(node, ast.Import):
                assert not any(alias.name.startswith("fairseq") for alias in node.names), module.name


def test_the_graphed_runners_call_nothing_of_the_decoder():
    """They are handed the functions they replay (FeedbackLoop's), with their
    inputs: they import nothing of the models, and hold no decoder to call."""
    loop = Path(cuda_graphs.__file__).parent.parent / "loop"
    runners = sorted(loop.glob("graphed_*.py"))
    assert [module.name for module in runners] == ["graphed_decoding.py", "graphed_loop.py"]
    for module in runners:
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "models" not in (node.module or ""), (module.name, node.module)
            assert not (isinstance(node, ast.Name) and "decoder" in node.id.lower()), (module.name, node.lineno)
            assert not (isinstance(node, ast.arg) and "decoder" in node.arg.lower()), (module.name, node.lineno)


# --- the stand-in fails where a GPU would ---------------------------------------------------------

class Owner:
    """A graph's stand-in, as the pool knows it."""


def test_a_graph_freed_during_a_capture_invalidates_it_as_on_a_gpu():
    backend = RecordedGraphBackend(CPU)
    doomed, _ = backend.capture(lambda: (torch.ones(1),), Owner())

    def frees_a_graph():
        nonlocal doomed
        doomed = None  # its last reference: freed here, mid-capture
        return (torch.ones(1),)

    with pytest.warns(RuntimeWarning, match="operation not permitted when stream is capturing"), \
            pytest.raises(RuntimeError, match="operation failed due to a previous error during capture"):
        backend.capture(frees_a_graph, Owner())


def test_a_gradient_taken_in_a_capture_with_respect_to_a_leaf_invalidates_it_as_on_a_gpu():
    """On a GPU autograd waits, in a backward, on the stream where a leaf's
    AccumulateGrad node was made: the default stream whenever a graph from
    before the capture holds the node (a loss still held; DDP's reducer), and
    that wait invalidates the capture. An alias made in the capture is a node
    of the capture's own; the stand-in refuses every leaf."""
    weight = nn.Parameter(torch.ones(3))
    held = (weight * 1).sum()  # holds weight's AccumulateGrad node, made outside the capture
    with pytest.raises(RuntimeError, match="previous error during capture .*gradient with respect to a leaf"):
        RecordedGraphBackend(CPU).capture(lambda: torch.autograd.grad([(weight * 2).sum()], [weight]), Owner())

    def through_an_alias():
        alias = weight.view_as(weight)
        return torch.autograd.grad([(alias * 2).sum()], [alias])

    _, (grad,) = RecordedGraphBackend(CPU).capture(through_an_alias, Owner())
    assert torch.equal(grad, torch.full((3,), 2.0)) and held.requires_grad


def test_the_collector_runs_in_the_middle_of_a_stand_in_capture_unless_paused():
    collected = []
    gc.callbacks.append(lambda phase, info: collected.append(phase))
    try:
        RecordedGraphBackend(CPU).capture(lambda: (torch.ones(1),), Owner())
        assert collected
        collected.clear()
        with collector_paused():
            RecordedGraphBackend(CPU).capture(lambda: (torch.ones(1),), Owner())
        assert not collected
    finally:
        gc.callbacks.pop()


def test_a_failed_capture_leaves_the_generator_unusable_until_the_backend_recovers_it():
    """As torch before 2.13 leaves CUDA's; GraphBackend.capture recovers before it raises."""
    backend = RecordedGraphBackend(CPU)

    def fails():
        raise RuntimeError("host sync (injected)")

    with pytest.raises(RuntimeError, match="Offset increment outside graph capture"):
        try:
            backend.capture_graph(fails, Owner())
        except RuntimeError:
            torch.randint(10, (1,))  # the device's capture, failed: its generator is stuck
    backend.recover()
    torch.randint(10, (1,))
    with pytest.raises(RuntimeError, match="host sync"):
        backend.capture(fails, Owner())
    torch.randint(10, (1,))


def test_a_failed_capture_gives_up_every_cache_on_the_device(monkeypatch, caplog):
    """The generator got a fresh state: graphs captured before drew from the old one."""
    other = stand_in_cache()
    for _ in range(2):
        other("kept", lambda x: (x + 1,), [torch.zeros(1)])
    assert other.graphs
    failing = stand_in_cache()
    fail_inside_capture(monkeypatch, 1)  # the next capture: the failing cache's first
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert failing("sync", lambda x: (x + 2,), [torch.zeros(1)])[0].item() == 2
    assert failing.failed and other.failed and not other.graphs
    assert len(warnings_of(caplog)) == 1
    assert other("kept", lambda x: (x + 1,), [torch.zeros(1)])[0].item() == 1


@pytest.fixture
def nothing_said_yet(monkeypatch):
    """What a torch lacks is said once in a process: as if no cache had said it before."""
    monkeypatch.setattr(graph_cache, "_UNSUPPORTED_SAID", set())


def test_a_device_that_cannot_recover_a_failed_capture_never_captures(monkeypatch, caplog, nothing_said_yet):
    monkeypatch.setattr(RecordedGraphBackend, "unsupported", lambda self: "this torch cannot (injected)")
    with caplog.at_level(logging.WARNING):
        cache = stand_in_cache()
    assert warnings_of(caplog) == ["test: CUDA graph: this torch cannot (injected); running eagerly from now on"]
    for _ in range(3):
        cache("key", lambda x: (x,), [torch.zeros(1)])
    assert cache.captured == 0


# --- the torch at hand: what the CUDA backend needs of it, by name (cuda_graphs/capabilities.py) ----------

def test_this_torch_has_every_call_the_cuda_backend_needs_under_one_of_its_names():
    """Under each torch the core tests run under (make test-torch): 2.6's
    allocator call has its old name, the newest torch's the new one."""
    assert capabilities.end_allocating_to_pool() is not None
    assert capabilities.cuda_graphs_unsupported(torch.default_generator) is None


class RecordingGenerator:
    def __init__(self):
        self.states = []

    def clone_state(self):
        return "a fresh state"

    def graphsafe_set_state(self, state):
        self.states.append(state)


def test_the_cuda_backend_recovers_from_a_failed_capture_through_the_allocator_call_by_2_6s_name(monkeypatch):
    """CudaGraphBackend.recover, whose lines a CPU can run, under a torch
    that calls the allocator's call by its name before 2.8."""
    ended = []
    new, old = capabilities.END_ALLOCATING_TO_POOL
    monkeypatch.delattr(torch._C, new, raising=False)
    monkeypatch.setattr(torch._C, old, lambda device, pool: ended.append((device, pool)), raising=False)
    backend = object.__new__(CudaGraphBackend)  # without its __init__, which needs a GPU
    backend.device, backend.pool, backend.generator = torch.device("cuda", 0), (0, 1), RecordingGenerator()
    assert backend.unsupported() is None
    backend.recover()
    assert ended == [(0, (0, 1))] and backend.generator.states == ["a fresh state"]


class GeneratorWithoutGraphSafeState:
    """A generator that cannot be given a fresh state during a capture's recovery."""


# what the CUDA backend needs of torch._C, by every name a torch gives it
TORCH_C_NAMES = {"torch._C._cuda_endAllocateToPool": capabilities.END_ALLOCATING_TO_POOL,
                 "torch._C._cuda_releasePool": ("_cuda_releasePool",)}


def lacking(monkeypatch, what: str):
    """This torch as one that lacks `what`; the generator the CUDA backend would probe."""
    if what == "Generator.graphsafe_set_state":
        return GeneratorWithoutGraphSafeState()
    for name in TORCH_C_NAMES[what]:
        monkeypatch.delattr(torch._C, name, raising=False)
    return torch.default_generator


@pytest.mark.parametrize("what", ["Generator.graphsafe_set_state", *TORCH_C_NAMES])
def test_a_torch_that_lacks_a_call_the_cuda_backend_needs_runs_eagerly_said_once(what, monkeypatch, caplog,
                                                                                  nothing_said_yet):
    """The stand-in asks what the CUDA backend asks: two models (a cache
    each) train with graphs off from their first call, and give the eager
    numbers; one line in the log names what is missing."""
    generator = lacking(monkeypatch, what)
    monkeypatch.setattr(RecordedGraphBackend, "unsupported", lambda self: CudaGraphBackend.unsupported(
        types.SimpleNamespace(generator=generator)))
    for seed in (0, 1):
        model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0", layers=3, seed=seed)
        batches = translation_batches(d)
        model.decoder.use_cuda_graphs("off")
        eager = training_results(model, batches)
        model.decoder.use_cuda_graphs("emulate")
        with caplog.at_level(logging.WARNING):
            graphed = training_results(model, batches)
        for got, expected in zip(graphed, eager):
            assert_same_loss_and_gradients(got, expected)
        statistics = model.graph_statistics()
        assert statistics.captured == 0 and statistics.calls == 0
    (warning,) = warnings_of(caplog)
    assert re.fullmatch(rf"feedback loop: CUDA graph: torch \S+ lacks {re.escape(what)}, which recovering from a "
                        r"failed capture needs; CUDA graphs stay off in this process; running eagerly from now on",
                        warning), warning


def test_graphs_that_share_a_pool_overwrite_each_others_outputs_as_they_replay():
    pool = SharedPool(CPU)
    a, b = Owner(), Owner()
    (x,) = pool.place(a, (torch.ones(4),))
    (y,) = pool.place(b, (torch.full((6,), 2.0),))
    assert torch.equal(x, torch.full((4,), 2.0))  # b's placing overwrote a's output
    (z,) = pool.place(b, (torch.zeros(1000),))  # the pool grows: what was handed out moves with it
    y.fill_(3.0)
    assert torch.equal(x, torch.full((4,), 3.0)) and z.data_ptr() > y.data_ptr()


def test_what_a_graph_hands_out_outlives_other_graphs_replays():
    cache = stand_in_cache()
    double, shift = (lambda x: (2 * x,)), (lambda x: (x + 100,))
    results = [cache(name, fn, [torch.full((3,), value)]) for value in (1.0, 5.0, 7.0)
               for name, fn in (("double", double), ("shift", shift))]
    assert [r[0].tolist() for r in results] == [[v] * 3 for v in (2.0, 101.0, 10.0, 105.0, 14.0, 107.0)]
    assert cache.captured == 2 and cache.failed is None


def test_a_shape_is_captured_at_its_second_sighting():
    """A shape seen once does not repay a capture; its first call, eager, is
    the warm-up that capture needs."""
    cache = stand_in_cache()
    for n in range(1, 4):
        cache("once", lambda x: (x + 1,), [torch.zeros(1)]) if n == 1 else None
        assert cache("twice", lambda x: (x + n,), [torch.zeros(1)])[0].item() == n
        assert cache.captured == (0 if n == 1 else 1)
    assert list(cache.graphs) == ["twice"]


# --- what a graph holds, and when it goes -----------------------------------------------------------

def recorded_graphs(cache):
    return [graph for graphed in cache.graphs.values() for graph in (graphed.forward_graph, graphed.backward_graph)
            if graph is not None]


def graphed_for_training_and_decoding():
    """A 2-layer translation model whose cache holds training's graphs and beam search's."""
    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0", layers=2)
    model.decoder.use_cuda_graphs("emulate")
    training_results(model, translation_batches(d))
    model.eval()
    src, lengths, _ = batch(d, rows=3, src_len=5)
    search(model, d, dict(beam_size=2, max_len_b=8), {"net_input": {"src_tokens": src, "src_lengths": lengths}})
    return model


def test_a_dropped_model_frees_its_graphs_at_once_not_at_the_collectors_next_run():
    """Graphs have one owner, their cache, and nothing of theirs points back:
    a dropped model's graphs go with it, whatever the collector does (left to
    it, they were freed inside a later capture on the GPU, which invalidated it)."""
    model = graphed_for_training_and_decoding()
    cache = loop_graph_cache(model)
    assert any(key[0] == "decode" for key in cache.graphs) and len(cache.graphs) >= 2
    graphs = [weakref.ref(graph) for graph in recorded_graphs(cache)]
    collector = gc.isenabled()
    gc.disable()
    try:
        del model, cache
        assert [graph() for graph in graphs] == [None] * len(graphs)
    finally:
        if collector:
            gc.enable()


def test_a_graphs_function_holds_the_modules_it_runs_never_the_decoder():
    """The decoder hands the graphs a function of the modules it runs
    (loop/feedback_loop.py): with their cache kept, a dropped decoder goes
    at once, and every graph, training's and decoding's, still replays
    without it (a function that reached the decoder by a weak reference
    would fail here)."""
    model = graphed_for_training_and_decoding()
    cache = loop_graph_cache(model)
    assert {key[0] == "decode" for key in cache.graphs} == {True, False}
    decoder = weakref.ref(model.decoder)
    collector = gc.isenabled()
    gc.disable()
    try:
        del model
        assert decoder() is None
    finally:
        if collector:
            gc.enable()
    for graph in recorded_graphs(cache):
        cache.backend.replay(graph)


def test_an_evicted_graph_is_released_there_and_then():
    cache = stand_in_cache(max_graphs=1)
    for key in "AABB":
        cache(key, lambda x: (x,), [torch.zeros(1)])
    (graphed,) = cache.graphs.values()
    assert graphed.shape == "B" and cache.captured == 2
    assert all(graph.fn is not None for graph in recorded_graphs(cache))


# --- the first backward through a new graph ---------------------------------------------------------

# the two Functions whose backward consumes per-block state: the fused block's, and (for options it does not
# cover, here persistent vectors) the per-block weight gradients of the loop run through autograd
BLOCK_BACKWARDS = {"fused block": ([], BlockFunction, lambda ctx: ctx.loop),
                   "through autograd": (["--persistent-vectors", "2"], block_weight_gradients.BlockWeights,
                                        lambda ctx: ctx.block)}


@pytest.mark.parametrize("loop", BLOCK_BACKWARDS.values(), ids=BLOCK_BACKWARDS.keys())
@pytest.mark.parametrize("layers", [1, 3, 12])
def test_a_new_graph_runs_one_backward_over_each_autograd_graph(layers, loop, monkeypatch):
    """The warm-up before capture is an autograd graph of its own, run
    forward and backward once, and so is the check's eager reference: the
    per-block weight gradients consume what their forward left, and a second
    backward over the warm-up's graph failed at every GPU user's first update
    (IndexError at block.inputs[t], found by review)."""
    flags, function, state = loop
    backward, backwards = function.backward, []

    def counted(ctx, *grads):
        backwards.append(state(ctx))  # held: a freed block's id could come again
        return backward(ctx, *grads)

    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0", *flags, layers=layers)
    batches = translation_batches(d)
    model.decoder.use_cuda_graphs("off")
    eager = training_results(model, batches)
    monkeypatch.setattr(function, "backward", staticmethod(counted))
    model.decoder.use_cuda_graphs("emulate")
    for got, expected in zip(training_results(model, batches), eager):
        assert_same_loss_and_gradients(got, expected)
    assert backwards and len(set(map(id, backwards))) == len(backwards)
    assert model.graph_statistics().failed is None


@pytest.mark.parametrize("loop", BLOCK_BACKWARDS.values(), ids=BLOCK_BACKWARDS.keys())
def test_in_a_graph_only_the_loop_through_autograd_takes_per_block_linear_layers(loop, monkeypatch):
    """The fused block takes its weight gradients once per block by itself:
    per-block linear layers around it would add autograd nodes that no
    gradient reaches."""
    flags, per_block = loop[0], []
    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0", *flags, layers=2)
    kv_proj = model.decoder.memory.kv_proj
    # within weight_gradients_per_block, a linear layer runs a per-block forward of its own (an instance attribute)
    on_loop_runs(monkeypatch, lambda runner: per_block.append("forward" in vars(kv_proj)))
    model.decoder.use_cuda_graphs("emulate")
    training_results(model, translation_batches(d))
    assert per_block and set(per_block) == {bool(flags)}
    assert model.graph_statistics().failed is None


# --- any failure gives way to the eager loop ----------------------------------------------------------

FAILURES = {
    "capture": lambda m: fail_inside_capture(m, 1),
    "backward capture": lambda m: fail_inside_capture(m, 2),
    "first replay": lambda m: fail_at(m, RecordedGraphBackend, "replay", lambda n, a, k: n == 1),
    "backward replay": lambda m: fail_at(m, RecordedGraphBackend, "replay", lambda n, a, k: n == 2),
    "check's eager forward": lambda m: fail_at(m, GraphedFunction, "forward_eagerly", lambda n, a, k: n == 1),
    "check's eager backward": lambda m: fail_at(m, GraphedFunction, "gradients", lambda n, a, k: n == 1),
    "later replay": lambda m: fail_at(m, RecordedGraphBackend, "replay", lambda n, a, k: n == 5),  # the 4th call
    "outputs differ": lambda m: replays_then(m, lambda graph, n: n == 1 and graph.outputs[0].add_(1)),
    "gradients differ": lambda m: replays_then(m, lambda graph, n: n == 2 and [g.mul_(2) for g in graph.outputs
                                                                              if g is not None]),
    "gradients not finite": lambda m: replays_then(m, lambda graph, n: n == 2 and [
        g.fill_(float("nan")) for g in graph.outputs if g is not None]),
}
WARNINGS = {
    "capture": r": capture failed \(RuntimeError: CUDA out of memory \(injected\)\)",
    "backward capture": r": capture failed \(RuntimeError: CUDA out of memory \(injected\)\)",
    "first replay": r": replay failed \(RuntimeError: CUDA out of memory",
    "backward replay": r"backward replay failed \(RuntimeError: CUDA out of memory",
    "check's eager forward": r"the check's eager forward failed \(RuntimeError: CUDA out of memory",
    "check's eager backward": r"the check's eager backward failed \(RuntimeError",
    "later replay": r": replay failed \(RuntimeError: CUDA out of memory",
    "outputs differ": r"its outputs differ from eager by [\d.]+ \(at most 0.0001\)",
    "gradients differ": r"its gradients differ from eager by 1 \(at most 0.0001\)",
    "gradients not finite": r"its gradients are not finite where eager's are",
}


@pytest.mark.parametrize("failure", FAILURES)
def test_a_graph_that_fails_at_any_stage_gives_the_eager_numbers_with_one_warning(failure, monkeypatch, caplog):
    """A fault injected at one stage of the first batch's graph (captured at
    its shape's second sighting; for a later replay, its fourth call's,
    unchecked), or a replay that computes something else: every batch's loss
    and gradients are --cuda-graphs off's, one warning names the stage, the
    batches after it run eagerly, and dropout still draws (a failed capture
    leaves the generator as it was)."""
    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0", layers=3)
    batches = translation_batches(d, shapes=((3, 5, 7),) * 4 + ((5, 9, 3),))
    model.decoder.use_cuda_graphs("off")
    eager = training_results(model, batches)
    FAILURES[failure](monkeypatch)
    model.decoder.use_cuda_graphs("emulate")
    with caplog.at_level(logging.WARNING):
        graphed = training_results(model, batches)
    for got, expected in zip(graphed, eager):
        assert_same_loss_and_gradients(got, expected)
    (warning,) = warnings_of(caplog)
    assert "8 rows x 8 steps x 8 source positions" in warning and "running eagerly from now on" in warning
    assert re.search(WARNINGS[failure], warning), warning
    # the batches after the failure never reached the cache
    statistics = model.graph_statistics()
    assert statistics.calls == (4 if failure == "later replay" else 2)
    assert statistics.cached == 0
    torch.nn.functional.dropout(torch.ones(4), 0.5)


def an_eager_search(span: int, max_len: int):
    """A 3-layer model in evaluation, beam 5 over 9 sentences, and its
    hypotheses with --cuda-graphs off: (model, dictionary, search options, sample, hypotheses)."""
    model, d = tiny_translation_model("--memory-span", str(span), layers=3)
    model.eval()
    src, lengths, _ = batch(d, rows=9, src_len=6)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    args = dict(beam_size=5, max_len_b=max_len)
    model.decoder.use_cuda_graphs("off")
    return model, d, args, sample, search(model, d, args, sample)


def test_a_search_whose_graph_disagrees_continues_eagerly_with_the_eager_hypotheses(monkeypatch, caplog):
    model, d, args, sample, eager = an_eager_search(span=6, max_len=12)
    replays_then(monkeypatch, lambda graph, n: graph.outputs[0].add_(1))
    model.decoder.use_cuda_graphs("emulate")
    with caplog.at_level(logging.WARNING):
        assert_same_hypotheses(search(model, d, args, sample), eager)
        assert_same_hypotheses(search(model, d, args, sample), eager)  # the next search: the eager loop's cache
    (warning,) = warnings_of(caplog)
    assert "decoding 80 rows, 7 memory slots, 8 source positions" in warning


# --- what the checks see ------------------------------------------------------------------------------

def test_a_graph_is_checked_at_its_first_replay_at_new_inputs_and_after_another_graphs_replay(monkeypatch):
    judge, judged = EagerChecks.judge, []
    cache = stand_in_cache()

    def recorded(self, what, got, expected):
        judged.append(next(graphed.shape for graphed in cache.graphs.values() if graphed.checks is self))
        return judge(self, what, got, expected)

    monkeypatch.setattr(EagerChecks, "judge", recorded)
    for name in "AAABBAA":
        cache(name, lambda x: (x + 1,), [torch.randn(3)], shape=name)
    # A's first replay, its first of new inputs, B's first, and A's first after B's
    assert judged == ["A", "A", "B", "A"]
    assert all(not graphed.checks.pending for graphed in cache.graphs.values() if graphed.shape == "A")
    judged.clear()
    # past the first few graphs, only a graph's first replay: what the other
    # checks catch is the code's, which every graph shares
    for name in [str(n) for n in range(FULLY_CHECKED)] * 3 + ["A"]:
        cache(name, lambda x: (x + 1,), [torch.randn(3)], shape=name)
    # A and B were the cache's first two graphs: graphs 3 and 4 (0 and 1) are
    # checked again at new inputs, graphs 5 and 6 (2 and 3) at their first replay alone
    assert FULLY_CHECKED == 4 and judged == ["0", "1", "2", "3", "0", "1"]


def test_a_new_shape_costs_two_eager_passes_past_the_first_graphs():
    """Its capture (forward and backward) and its first replay's check:
    the warm-up is the shape's first sighting, eager anyway."""
    weight = nn.Parameter(torch.ones(3))
    cache = stand_in_cache()
    for n in range(FULLY_CHECKED + 3):
        for _ in range(4):
            (out,) = cache(n, lambda x, weight: (x * weight,), [torch.randn(2, 3)], [weight])
            out.sum().backward()
            cache("other", lambda x: (x + 1,), [torch.randn(2)])
    passes = {key: graphed.eager_passes for key, graphed in cache.graphs.items() if key != "other"}
    assert [passes[n] for n in range(FULLY_CHECKED, FULLY_CHECKED + 3)] == [2, 2, 2]
    assert all(passes[n] <= 4 for n in range(FULLY_CHECKED))


def test_a_graph_that_kept_a_tensor_from_outside_its_inputs_is_caught_at_its_next_call(caplog):
    """A graph replays the addresses it captured: a function that reads a
    tensor made anew for each call (not one of its inputs) replays the first
    call's. The check runs the call's own function, so it shows."""
    cache = stand_in_cache()
    results = []
    with caplog.at_level(logging.WARNING):
        for scale in (1.0, 3.0, 5.0):  # eager, then captured with 3.0
            results.append(cache("scaled", lambda x, factor=torch.tensor(scale): (x * factor,), [torch.ones(2)])[0])
    assert [r.tolist() for r in results] == [[1.0, 1.0], [3.0, 3.0], [5.0, 5.0]]
    (warning,) = warnings_of(caplog)
    assert "its outputs differ from eager by 0.4" in warning


def linear_graph(cache, weight, x):
    """A graphed x * weight, summed, and its backward."""
    (out,) = cache("linear", lambda x, weight: (x * weight,), [x], [weight])
    out.sum().backward()
    return out


def test_a_step_that_eager_finds_not_finite_is_not_judged_and_the_next_one_is():
    """Under fp16, the loss scaler's overflow steps give inf: inf in both
    results is no mismatch, but no agreement either. Such a step is not
    judged; the next is. A graph whose every check is such a step is given up."""
    weight = nn.Parameter(torch.ones(3))
    finite, overflowing = torch.ones(2, 3), torch.full((2, 3), float("inf"))
    cache = stand_in_cache()
    linear_graph(cache, weight, finite)  # its first sighting: eager
    linear_graph(cache, weight, overflowing)
    (graphed,) = cache.graphs.values()
    assert cache.failed is None and graphed.checks.pending == {FIRST_REPLAY, NEW_INPUTS, AFTER_ANOTHER_GRAPH}
    linear_graph(cache, weight, 2 * finite)
    assert cache.failed is None and graphed.checks.pending == {AFTER_ANOTHER_GRAPH}

    cache("other", lambda x: (x,), [finite])  # its first sighting: eager
    for _ in range(MAX_UNJUDGED):
        cache("other", lambda x: (x,), [finite])  # another graph's replay: the check is due
        weight.grad = None
        linear_graph(cache, weight, overflowing)
    assert cache.failed == f"its outputs were not finite at {MAX_UNJUDGED} checks in a row"


def test_a_graph_whose_result_alone_is_not_finite_fails_and_the_call_gets_eagers(monkeypatch):
    """A NaN of the graph's own is a defect, never an overflow: handed to
    fairseq, it would skip the update and halve the loss scale."""
    weight, x = nn.Parameter(torch.ones(3)), torch.ones(2, 3)
    cache = stand_in_cache()
    replays_then(monkeypatch, lambda graph, n: n == 2 and graph.outputs[0].fill_(float("nan")))
    linear_graph(cache, weight, x)
    weight.grad = None
    linear_graph(cache, weight, x)  # captured; its backward replay gives NaN
    torch.testing.assert_close(weight.grad, x.sum(0))
    cache("next", lambda x: (x,), [x])  # the cache learns it at its next call, and gives up
    assert cache.failed == "its gradients are not finite where eager's are" and not cache.graphs


# --- backward: once, and never over overwritten memory ------------------------------------------------

def test_a_second_backward_over_the_same_outputs_equals_eager():
    """retain_graph: the second backward runs eagerly from the block's inputs,
    since the backward's replay may have overwritten its activations."""
    weight, x = nn.Parameter(torch.arange(3.0)), torch.ones(2, 3)
    cache = stand_in_cache()
    for _ in range(5):  # eager, then the graph: checked at its first calls, not later
        weight.grad = None
        (out,) = cache("linear", lambda x, weight: (x * weight,), [x], [weight])
        out.pow(2).sum().backward(retain_graph=True)
        out.pow(2).sum().backward()
        torch.testing.assert_close(weight.grad, 2 * (2 * x * weight * x).sum(0))
    assert cache.failed is None


@pytest.mark.parametrize("between", ["linear", "other"], ids=["the graph again", "another graph"])
def test_a_second_backward_after_a_call_copied_other_inputs_in_is_refused(between):
    """Every graph of a cache reads its inputs from the same static buffers
    (static_buffers.py): once a call has copied its own over them, the first
    call's inputs are gone."""
    weight, x = nn.Parameter(torch.ones(3)), torch.ones(2, 3)
    cache = stand_in_cache()
    for name in ("linear", "other"):  # first sightings: eager
        cache(name, lambda x, weight: (x * weight,), [x], [weight])
    (out,) = cache("linear", lambda x, weight: (x * weight,), [x], [weight])
    out.sum().backward(retain_graph=True)
    cache(between, lambda x, weight: (x * weight,), [2 * x], [weight])[0].sum().backward()
    with pytest.raises(RuntimeError, match="a second backward through a block replayed as a CUDA graph, after "
                                           "another call of its graphs copied its inputs over this one's"):
        out.sum().backward()


def test_a_second_forward_before_the_first_backward_runs_eagerly():
    """A criterion that runs the model twice before one backward (as R-Drop
    does): the second call must not overwrite what the first call's
    backward reads, so it runs eagerly; the gradients are the eager loop's."""
    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0", layers=3)
    src, lengths, prev, target = translation_batches(d)[0]
    other = torch.randint(d.nspecial, len(d), target.shape)

    def twice():
        model.train()
        model.zero_grad()
        first, second = model(src, lengths, prev)[0], model(src, lengths, prev)[0]
        return loss_and_gradients(model, lambda: torch.cat([first, second]), torch.cat([target, other]))

    model.decoder.use_cuda_graphs("off")
    eager = twice()
    model.decoder.use_cuda_graphs("emulate")
    # first a forward whose backward never comes (its loss dropped, as fairseq
    # does after running out of memory): it holds nothing back (the first, eager, captures nothing)
    model.train()
    model(src, lengths, prev)
    model(src, lengths, prev)
    assert_same_loss_and_gradients(twice(), eager)
    statistics = model.graph_statistics()
    assert statistics.calls == 3 and statistics.captured == 1 and statistics.failed is None


# --- memory ---------------------------------------------------------------------------------------------

def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def test_graphs_of_every_shape_share_one_set_of_buffers_and_the_pool_holds_one_captures_memory():
    """Lighter graphs, counted as a GPU's allocator keeps them (backends.py,
    PoolAccount). Graphs of three shapes read their static inputs and output
    gradients from one set of buffers, the largest graph's (measured here:
    249 kB, against 349 kB as a set a graph); nothing of a graph stays in
    the pool after its capture (its outputs and gradients, read before
    another replay, and what its autograd graph kept, go back for later
    captures), so the three hold the pool that the largest holds alone
    (2.05 MB), what its capture needed, no more than the same training step
    run eagerly at the graph's padded shape (3.09 MB)."""
    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0", layers=3)
    largest, *others = translation_batches(d, ((9, 17, 9), (3, 5, 7), (5, 9, 3)))
    model.decoder.graphed = GraphedFeedbackLoop("emulate")
    training_results(model, [largest] * 2)
    alone = model.graph_statistics()
    model.decoder.graphed = GraphedFeedbackLoop("emulate")
    training_results(model, [b for b in (largest, *others) for _ in range(2)])
    three, graphs = model.graph_statistics(), loop_graph_cache(model).graphs.values()
    assert (alone.captured, three.captured) == (1, 3)
    assert three.static_bytes == alone.static_bytes < 0.75 * sum(nbytes([*g.inputs, *g.grad_outputs]) for g in graphs)
    assert [g.nbytes for g in graphs] == [0, 0, 0] and three.nbytes == three.static_bytes
    assert three.pool_bytes == alone.pool_bytes > 0
    padded, = translation_batches(d, ((16, 32, 16),))  # the largest graph's bucket
    model.decoder.use_cuda_graphs("off")
    with PoolAccount() as eager:
        training_results(model, [padded])
    assert alone.pool_bytes < eager.reserved


def test_the_stand_ins_pool_keeps_the_most_that_was_ever_alive_in_it_at_once():
    """PoolAccount's rules, CUDA's caching allocator's for a graph's pool:
    what an operator makes is counted until it is freed, and what is freed
    stays in the pool for later captures (reserved: the most alive at once);
    views, writes in place and the tensors an operator reads make nothing,
    and a storage is counted once however many tensors share it."""
    x = torch.ones(256)  # 1 kB, from before: not the pool's
    with PoolAccount() as pool:
        a = x * 2  # 1 kB
        square = a.view(16, 16)
        a.add_(1)
        both = torch.cat([a, a])  # 2 kB: 3 kB alive
        del both
        b = a + square.flatten()  # 1 kB: 2 kB alive
    assert (pool.live, pool.reserved) == (2048, 3072)
    del a
    assert pool.live == 2048  # the view keeps its storage
    del square, b
    assert (pool.live, pool.reserved) == (0, 3072)


def test_on_a_gpu_a_captures_outputs_are_views_that_own_no_memory():
    """What makes nothing of a graph stay in the pool on a GPU: its outputs
    and gradients are handed out as views that own none of their memory
    (backends.unowned), which goes back to the pool when the capture's own
    tensors go. Views of one storage stay views of one storage."""
    x = torch.arange(12.0).view(3, 4)
    whole, none, column = unowned((x, None, x[:, 1]))
    assert none is None and torch.equal(whole, x) and torch.equal(column, x[:, 1])
    assert (whole.data_ptr(), column.data_ptr()) == (x.data_ptr(), x[:, 1].data_ptr())
    assert whole.untyped_storage().data_ptr() == column.untyped_storage().data_ptr()
    storage = StorageWeakRef(x.untyped_storage())
    del x
    assert storage.expired()  # freed, though the views live (never read again here: on the CPU the memory is gone)


def test_graphs_hold_one_set_of_buffers_the_largests_whatever_order_shapes_come_in():
    """The largest shape captured last needs larger static buffers than the
    graphs before it were captured over, whose addresses a replay cannot
    move: those graphs go, and each is captured again over the larger
    buffers at its next call (sighted already: no eager first run). The
    buffers held are the largest's alone (249 kB, where the three graphs
    kept 336 kB before), as with the largest first, and every result is
    eager's."""
    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0", layers=3)
    largest, *others = translation_batches(d, ((9, 17, 9), (3, 5, 7), (5, 9, 3)))
    model.decoder.graphed = GraphedFeedbackLoop("emulate")
    training_results(model, [largest] * 2)
    alone = model.graph_statistics()
    smaller_first, largest_last, smaller_again = ([b for b in batches for _ in range(2)]
                                                  for batches in (others, [largest], others))
    model.decoder.use_cuda_graphs("off")
    eager = training_results(model, [*smaller_first, *largest_last, *smaller_again])
    model.decoder.graphed = GraphedFeedbackLoop("emulate")
    got = training_results(model, [*smaller_first, *largest_last])
    statistics = model.graph_statistics()
    assert (statistics.captured, statistics.cached) == (3, 1)
    assert statistics.static_bytes == alone.static_bytes
    got += training_results(model, smaller_again)
    statistics = model.graph_statistics()
    assert (statistics.captured, statistics.cached, statistics.hits) == (5, 3, 2)
    assert statistics.static_bytes == statistics.nbytes == alone.static_bytes
    for result, expected in zip(got, eager):
        assert_same_loss_and_gradients(result, expected)


def test_the_byte_bound_counts_the_buffers_and_what_each_graph_holds_and_evicts_to_stay_under_it():
    """A graph holds, besides the static buffers every graph shares, what
    its capture left alive in the pool (here a tensor its function keeps;
    the loop's keep nothing): past the bound the least recently used go."""
    kept = {}

    def keeping(key):
        def fn(x):
            kept[key] = 2 * x  # 4 kB, alive after the capture
            return (x + 1,)
        return fn

    x = torch.zeros(1024)
    static = 2 * x.nbytes  # the input and the output's gradient
    cache = stand_in_cache(max_bytes=static + 2 * x.nbytes + 1)
    for key in "AABBCCB":
        assert torch.equal(cache(key, keeping(key), [x])[0], x + 1)
    assert cache.captured == 3 and cache.cached_keys() == ["C", "B"]
    assert [g.nbytes for g in cache.graphs.values()] == [x.nbytes] * 2 and cache.nbytes() == cache.max_bytes - 1


# --- decoding -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("span", [3, 40], ids=["the ring wraps", "the memory grows"])
def test_a_search_reads_nothing_an_earlier_search_left_in_the_static_memory(span):
    """Masked slots get weight 0, and 0 times NaN is NaN: a ring poisoned
    with NaN (an earlier search's fp16 overflow, say) must change nothing."""
    model, d, args, sample, eager = an_eager_search(span, max_len=24)
    model.decoder.use_cuda_graphs("emulate")
    search(model, d, args, sample)
    for memory in model.decoder.graphed.decoding.memories.values():
        memory.slots.fill_(float("nan"))
    assert_same_hypotheses(search(model, d, args, sample), eager)


def test_shapes_that_vary_too_much_for_graphs_to_pay_run_eagerly_with_one_warning(caplog):
    cache = stand_in_cache(max_graphs=4)
    with caplog.at_level(logging.WARNING):
        for n in range(300):
            assert cache(n % 200, lambda x: (x + 1,), [torch.zeros(1)])[0].item() == 1
    assert cache.failed == ("only 0 of the last 256 calls found their graph cached: "
                            "shapes vary too much for graphs to pay")
    assert len(warnings_of(caplog)) == 1 and cache.statistics.calls == 256


def test_a_caches_last_statistics_line_is_logged_when_it_goes(caplog):
    """fairseq-train's last validation is followed by no call that could log
    its line: a cache logs it when it goes (dropped with its model, or at the
    program's end, which the fairseq-train test below shows)."""
    caches = [stand_in_cache(), stand_in_cache()]
    for cache, calls in zip(caches, (1, 4)):
        for _ in range(calls):
            cache("key", lambda x: (x,), [torch.zeros(1)])
    with caplog.at_level(logging.INFO):
        del cache, caches
    lines = {r.getMessage() for r in caplog.records}
    assert {"graph cache | keys 1 | calls 1 | hits 0 | hit rate 0.0%",
            "graph cache | keys 1 | calls 4 | hits 2 | hit rate 50.0%"} <= lines


def test_a_copy_of_the_model_captures_graphs_of_its_own():
    """--ema and the like copy the model: the copy's graphs would otherwise replay over the original's buffers."""
    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0", layers=1)
    model.decoder.graphed = GraphedFeedbackLoop("emulate", max_graphs=3)
    training_results(model, translation_batches(d)[:2])
    copy = deepcopy(model)
    assert copy.graph_statistics() is None and copy.decoder.graphed.cache_options == {"max_graphs": 3}
    assert model.graph_statistics().captured == 1


# --- a real corpus, and fairseq-train ------------------------------------------------------------------

def test_an_epoch_of_a_real_corpus_fits_the_cache_and_the_next_epoch_finds_its_graphs():
    """Debian de-en's batches as fairseq makes them with --max-tokens 4096
    (rows, source and target lengths, recorded in tests/data): one epoch and
    its validation need at most the cache's graphs; the second epoch finds
    at least 90% of its blocks' graphs cached (the shapes seen once in the
    first are captured at their second sighting, in the second), and the
    third every one. Its inputs sized as the block's (rows x steps, rows,
    rows x source positions), a shape larger than the static buffers drops the
    graphs over the smaller ones: one capture more in the first epoch."""
    recorded = json.loads(BATCHES.read_text())
    cache = stand_in_cache()

    def epoch(train):
        for mode, batches in (("train", train), ("valid", recorded["valid"])):
            for rows, source, target in batches:
                shape = GraphedFeedbackLoop.block_shape(rows, target, source)
                rows, steps, positions = shape
                inputs = [torch.zeros(rows * steps), torch.zeros(rows), torch.zeros(rows * positions)]
                cache((shape, mode), lambda x, initial, encoder: (x,), inputs)
        return [int(n) for n in STATISTICS.fullmatch(cache.statistics.line()).groups()[:3]]

    keys, calls, _ = epoch(recorded["train"][0])
    assert calls == 304 + 12 and keys <= cache.max_graphs and cache.captured == 33 + 1
    keys, calls, hits = epoch(recorded["train"][1])
    assert keys <= cache.max_graphs and hits >= 0.9 * calls and cache.failed is None
    keys, calls, hits = epoch(recorded["train"][0])
    assert keys <= cache.max_graphs and hits == calls and cache.failed is None


@pytest.fixture(scope="module")
def synthetic_translation(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    run_module("fairseq_feedback_cli.data_prep.synthetic_translation", "--out", root / "corpus", "--train", 300,
               "--vocab", 12, "--max-len", 8)
    run("preprocess", "--source-lang", "src", "--target-lang", "tgt", "--trainpref", root / "corpus" / "train",
        "--validpref", root / "corpus" / "valid", "--testpref", root / "corpus" / "valid", "--destdir",
        root / "data", "--joined-dictionary", "--workers", "1")
    return root / "data"


def train_options(data, dropout):
    return [data, "--arch", "feedback_transformer", "--cpu", "--num-workers", 0,
            "--encoder-layers", 1, "--decoder-layers", 2, "--encoder-embed-dim", 16, "--decoder-embed-dim", 16,
            "--encoder-ffn-embed-dim", 32, "--decoder-ffn-embed-dim", 32, "--encoder-attention-heads", 2,
            "--decoder-attention-heads", 2, "--dropout", dropout, "--optimizer", "adam", "--lr", "1e-3",
            "--max-tokens", 250, "--update-freq", 2, "--max-epoch", 2, "--log-format", "simple",
            "--log-interval", 1, "--seed", 1]


def losses(log):
    return [float(x) for x in re.findall(r"train_inner \| .*? loss=([\d.]+)", log)]


@pytest.mark.slow
def test_fairseq_train_through_the_stand_in_follows_the_eager_loss_curve(synthetic_translation, tmp_path):
    """--cuda-graphs emulate (the path a GPU takes, the CUDA calls stood in
    for) against --no-cuda-graphs, dropout 0, --update-freq 2 and a
    validation between the two epochs: the same losses, the cache's
    statistics after every epoch and validation, and fairseq-generate's
    beam search through graphed decoding gives eager's hypotheses and scores."""
    options = train_options(synthetic_translation, 0)
    # a process of its own: the last validation's statistics are logged as fairseq-train exits
    emulated = run_as_a_user("fairseq_cli.train", *options, "--user-dir", PLUGIN, "--cuda-graphs", "emulate",
                             "--save-dir", tmp_path / "checkpoints", "--no-epoch-checkpoints")
    assert emulated.returncode == 0, emulated.stderr
    assert "WARNING" not in emulated.stdout + emulated.stderr.replace("UserWarning", "")
    logs = [emulated.stdout,
            run("train", *options, "--no-cuda-graphs", "--no-save", "--save-dir", tmp_path / "eager").stdout]
    graphed, eager = map(losses, logs)
    assert len(graphed) >= 10 and graphed == pytest.approx(eager, abs=2e-3)
    statistics = STATISTICS.findall(logs[0])
    assert len(statistics) == 4  # after each epoch's training and each validation
    keys = [int(k) for k, *_ in statistics]
    assert keys == sorted(keys) and keys[-1] <= 64
    assert not STATISTICS.search(logs[1])

    def generate(mode):
        out = run("generate", synthetic_translation, "--path", tmp_path / "checkpoints" / "checkpoint_last.pt",
                  "--gen-subset", "test", "--beam", 4, "--batch-size", 16, "--cpu", "--model-overrides",
                  f"{{'cuda_graphs': '{mode}'}}").stdout
        return re.findall(r"^H-(\d+)\t(\S+)\t(.*)$", out, re.MULTILINE)

    graphed, eager = generate("emulate"), generate("off")
    assert len(graphed) >= 20 and [(i, h) for i, _, h in graphed] == [(i, h) for i, _, h in eager]
    assert [float(s) for _, s, _ in graphed] == pytest.approx([float(s) for _, s, _ in eager], abs=1e-5)


def test_fairseq_train_with_dropout_through_the_stand_in_ends_near_the_eager_loss(synthetic_translation, caplog,
                                                                                  tmp_path):
    """With dropout, padded shapes draw other masks than eager's: no fallback,
    no traceback, and a final loss within 3% of --cuda-graphs off's."""
    options = train_options(synthetic_translation, 0.1)
    with caplog.at_level(logging.WARNING):
        graphed = losses(run("train", *options, "--cuda-graphs", "emulate", "--no-save", "--save-dir", tmp_path).stdout)
    assert not warnings_of(caplog)
    eager = losses(run("train", *options, "--no-cuda-graphs", "--no-save", "--save-dir", tmp_path).stdout)
    assert len(graphed) == len(eager) >= 10 and graphed[-1] == pytest.approx(eager[-1], rel=0.03)
