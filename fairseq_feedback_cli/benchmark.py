"""Speed of the feedback models as a ratio to fairseq's own models of the same size.

    feedback-benchmark                      # translation at base widths, and the LM
    feedback-benchmark --preset tiny        # seconds, to check that it runs
    feedback-benchmark --device cuda --dtype fp16 --preset iwslt   # IWSLT and feedback_lm_wiki103 sizes
    feedback-benchmark --reference-loop     # also the feedback models' loop through autograd

Translation: feedback_transformer against fairseq's transformer (training
target tokens/s, beam-5 output tokens/s, incremental-state bytes per decoded
token). Language modelling: feedback_lm against fairseq's transformer_lm
(training, evaluation and sampling tokens/s). Each pair is built through
fairseq's registry from the same options and runs the same random batches in
one process, the two models' calls interleaved, and each rate is taken from
the median call: the ratios compare architectures, not machines or moments.

On a GPU the feedback models replay their per-token loop as CUDA graphs, and
a third row runs them eagerly (--no-cuda-graphs) for comparison; the graphs'
rows say what capturing cost apart from the rates: the seconds that the calls
which captured graphs took beyond a steady call, and the graphs' memory
(--cuda-graphs emulate shows the same on the CPU, through the stand-in for
capture). Two more columns come from a profile of one training step: kernels
per target step (a position of every row; on the CPU: operators dispatched,
the count a GPU would launch, the feedback loop's as a GPU replays it) and
the share of the step's wall time during which the GPU runs a kernel.

fp16 and bf16 train as fairseq-train --fp16 and --bf16 do (fp32 master
weights, and for fp16 a dynamic loss scale), on any device. Every result is
checked to be finite before a rate is reported, and the weights and logits
before a search: one that is not ends the run in one line naming the model
and the phase.
"""

import argparse
import collections
import contextlib
import json
import logging
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from fairseq import search
from fairseq.optim import FP16Optimizer
from fairseq.sequence_generator import SequenceGenerator
from torch import Tensor
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from fairseq_feedback.models.feedback_decoder import FeedbackDecoder

from . import builders
from .builders import make_dictionary, size_flags
from .command_line import ArgumentParser, check_at_least, fail
from .outputs import atomic_file
from .sizes import PRESETS

logger = logging.getLogger(__name__)

BEAM = 5
LEARNING_RATE = 1e-4
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def synchronize():
    if torch.cuda.is_initialized():  # CUDA only
        torch.cuda.synchronize()


class NotFinite(Exception):
    """A result that is not finite: one line naming the model and the phase."""


class FiniteResults:
    """Whether each model's results of each phase were all finite, gathered
    on the device as the calls run (a timed call never waits for the GPU)
    and checked before a rate is reported."""

    def __init__(self):
        self.finite: Dict[tuple, Tensor] = {}  # (model, phase) -> a boolean on the device

    def record(self, model: str, phase: str, result: Tensor) -> None:
        finite = torch.isfinite(result).all()
        key = (model, phase)
        self.finite[key] = finite if key not in self.finite else self.finite[key] & finite

    def check(self) -> None:
        for (model, phase), finite in self.finite.items():
            if not finite:
                raise NotFinite(f"{model}: {phase} gave values that are not finite, so no rate is reported "
                                "(in fp16, try bf16 or fp32)")


class PeakMemory:
    """Each model's peak device memory in each phase, as
    torch.cuda.max_memory_allocated would read it with the model alone on
    the device, though the models run in turns in one process: what the
    model's own building and calls left allocated (weights, gradients,
    optimizer state, graphs, carried memory), plus the most that one of its
    calls allocated beyond what was allocated as that call began. The
    inputs, which all models share, are left out. Bytes, by (model, phase).

    `allocator`: the device's allocated() and peak() bytes and
    reset_peak(); None where nothing is measured (off CUDA)."""

    def __init__(self, allocator=None):
        self.allocator = allocator
        self.resident = collections.Counter()  # model -> bytes its building and calls left allocated
        self.peak: Dict[tuple, int] = {}

    @classmethod
    def on(cls, device: torch.device) -> "PeakMemory":
        if device.type != "cuda":
            return cls()
        # CUDA only: the caching allocator's figures (kept on the host: no synchronization needed)
        return cls(argparse.Namespace(allocated=torch.cuda.memory_allocated, peak=torch.cuda.max_memory_allocated,
                                      reset_peak=torch.cuda.reset_peak_memory_stats))

    @contextlib.contextmanager
    def charged(self, model: str, phase: Optional[str] = None):
        """What the block allocates, charged to `model`; with `phase`, its peak counted as one of that phase's."""
        if self.allocator is None:
            yield
            return
        before = self.allocator.allocated()
        self.allocator.reset_peak()
        yield
        if phase is not None:
            peak = self.resident[model] + self.allocator.peak() - before
            self.peak[model, phase] = max(self.peak.get((model, phase), 0), peak)
        self.resident[model] += self.allocator.allocated() - before

    def column(self, phase: str) -> Optional[Dict[str, float]]:
        """MB (2**20 bytes) by model of `phase`; None where nothing is measured."""
        if self.allocator is None:
            return None
        return {model: peak / 2**20 for (model, measured), peak in self.peak.items() if measured == phase}


@torch.no_grad()
def check_before_search(name: str, phase: str, model, forward: Callable[[], Tensor]) -> None:
    """The weights and the logits of `forward()` are finite: a search over
    non-finite ones ends in a device-side assert on a GPU (sampling) or a
    search that never finishes, neither naming the model. The forward runs
    eagerly: no graph is captured outside the timed calls."""
    model.eval()
    with feedback_loop_in_mode(model, "off"):
        values = [*model.parameters(), forward()]
    if not torch.stack([torch.isfinite(v).all() for v in values]).all():
        raise NotFinite(f"{name}: its weights or logits are not finite before {phase}, so no rate is reported "
                        "(in fp16, try bf16 or fp32)")


def graph_statistics(model):
    """The figures of the feedback loop's CUDA graphs (or of the stand-in's), or None: graphs off, or not
    started, or a model without them (fairseq's)."""
    statistics = getattr(model, "graph_statistics", None)
    return None if statistics is None else statistics()


def graphs_captured(model) -> int:
    statistics = graph_statistics(model)
    return 0 if statistics is None else statistics.captured


def awaiting_capture(model) -> bool:
    """Whether the model's graphs run but have captured nothing yet: a shape is captured at its second sighting."""
    statistics = graph_statistics(model)
    return statistics is not None and statistics.captured == 0 and statistics.failed is None


WARM_UP_CALLS = 8  # at most, while calls keep capturing graphs (a stream's memory filling its span: a graph per length)


def timed_call(name, work, phase: str, finite: FiniteResults, memory: Optional[PeakMemory] = None):
    """(seconds, tokens) of one call of `name`'s workload `work` (which
    returns the tokens it processed and a result to check), its result
    recorded in `finite` and its memory in `memory` as one of `phase`'s."""
    with (memory or PeakMemory()).charged(name, phase):
        synchronize()
        start = time.perf_counter()
        try:
            tokens, result = work()
        except FloatingPointError as error:  # fp16's loss scale fell to fairseq's minimum
            raise NotFinite(f"{name}: {phase}: {error}") from error
        synchronize()
        seconds = time.perf_counter() - start
    finite.record(name, phase, result)
    return seconds, tokens


def interleaved_rates(built, workloads, repeats, phase: str, finite: FiniteResults,
                      memory: Optional[PeakMemory] = None):
    """Tokens per second of each workload (a call returning the tokens it
    processed and a result to check), from the median of `repeats` calls
    made in turns after warm-up calls (one, or where graphs run, until a
    call after the first capture captures none); and for each, the seconds
    that its warm-up calls, and any later call that captured a graph, took
    beyond the median call.
    `built`: the models, by name; `memory`: where each call's memory is counted."""
    times = {name: [] for name in workloads}
    beyond_steady = {name: [] for name in workloads}  # the times of warm-up calls and of calls that captured
    tokens = {}

    def call(name) -> bool:
        """One timed call of `name`'s workload; whether it captured graphs."""
        captured = graphs_captured(built[name])
        seconds, tokens[name] = timed_call(name, workloads[name], phase, finite, memory)
        times[name].append(seconds)
        return graphs_captured(built[name]) > captured

    for name in workloads:
        for _ in range(WARM_UP_CALLS):
            if not call(name) and not awaiting_capture(built[name]):
                break
        beyond_steady[name], times[name] = times[name], []
    for _ in range(repeats):
        for name in workloads:
            if call(name):
                beyond_steady[name].append(times[name][-1])
    finite.check()
    median = {name: statistics.median(times[name]) for name in workloads}
    rates = {name: tokens[name] / median[name] for name in workloads}
    return rates, {name: sum(t - median[name] for t in beyond_steady[name]) for name in workloads}


FIRST_PASSES = 4  # at most, over the first batches, until a pass captures nothing


def first_batches(built, workloads, count: int, finite: FiniteResults, memory: Optional[PeakMemory] = None):
    """Each model's first `count` training calls, from its first (a first
    epoch's view): tokens per second over them, every capture and first
    sighting included; and for each graphed model, the seconds that each
    new shape (each graph captured) cost: what its passes over the same
    calls took beyond a pass that captured nothing, per graph captured.
    `workloads`: each model's training step, a new batch at each call,
    its `count` batches again at the next `count` calls."""
    rates, per_shape = {}, {}
    for name, work in workloads.items():
        model, passes, captured_before = built[name], [], graphs_captured(built[name])
        while len(passes) < FIRST_PASSES:
            captured, seconds, tokens = graphs_captured(model), 0.0, 0
            for _ in range(count):
                took, processed = timed_call(name, work, "training", finite, memory)
                seconds, tokens = seconds + took, tokens + processed
            passes.append(seconds)
            if len(passes) == 1:
                rates[name] = tokens / seconds
            if graph_statistics(model) is None or (graphs_captured(model) == captured and not awaiting_capture(model)):
                break
        new_graphs = graphs_captured(model) - captured_before
        if new_graphs:
            per_shape[name] = (sum(passes[:-1]) - (len(passes) - 1) * passes[-1]) / new_graphs
    finite.check()
    return rates, per_shape


class _CountOps(TorchDispatchMode):
    """Operators that reach a backend (each would be a kernel on a GPU), views
    and allocations left out, by phase of a training step and by kind."""

    def __init__(self):
        super().__init__()
        self.kinds = collections.defaultdict(collections.Counter)  # phase -> operator -> count
        self.current = "training step"

    @property
    def count(self) -> int:
        return sum(sum(kinds.values()) for kinds in self.kinds.values())

    @contextlib.contextmanager
    def phase(self, name: str):
        previous, self.current = self.current, name
        try:
            yield
        finally:
            self.current = previous

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func.namespace == "profiler"  # record_function's markers
                or func._schema.name in ("aten::empty", "aten::empty_strided", "aten::detach")):
            self.kinds[self.current][func._schema.name.replace("aten::", "")] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def feedback_loop_in_mode(model, mode: str):
    """Within, a feedback decoder's loop runs as --cuda-graphs `mode` says
    ("off", "emulate"; a cache of its own), then as before. Other models
    run as they are."""
    decoder = model.decoder
    if not isinstance(decoder, FeedbackDecoder):
        yield
        return
    before = decoder.graphed
    decoder.use_cuda_graphs(mode)
    try:
        yield
    finally:
        decoder.graphed = before


def loop_as_a_gpu_replays_it(model):
    """A feedback decoder that would replay its loop as CUDA graphs on a GPU
    (--cuda-graphs auto) runs it through the graphs' path with the stand-in
    for capture (bucketed shapes, weight gradients once per block): on the
    CPU, the operators a GPU would replay rather than those of the eager
    loop. A model with graphs off, or already through the stand-in, runs as
    it is."""
    graphed = getattr(model.decoder, "graphed", None)
    if graphed is None or graphed.mode != "auto":
        return contextlib.nullcontext()
    return feedback_loop_in_mode(model, "emulate")


def graphs_state(model) -> Optional[tuple]:
    """The model's graphs captured and the eager passes they made (None: no graphs)."""
    statistics = graph_statistics(model)
    return None if statistics is None else (statistics.captured, statistics.eager_passes)


def counted_as_a_gpu_replays_it(model, work, warm_up: int = WARM_UP_CALLS) -> _CountOps:
    """The operators of one call of `work` (a training step), on any device
    dispatched rather than launched: the feedback loop's as a GPU replays it.
    `warm_up`: calls at most before, through the graphs' path, until one
    captures nothing and checks nothing (a shape's first sighting runs
    eagerly, its second captures, a cache's first graphs are checked again
    at new inputs, and a stream's memory takes a few blocks to fill its
    span, a graph per length)."""
    work()
    with loop_as_a_gpu_replays_it(model):
        for _ in range(warm_up):
            before = graphs_state(model)
            work()
            if graphs_state(model) == before and not awaiting_capture(model):
                break
        with _CountOps() as ops:
            work(ops)
    return ops


def kernels_and_busy_share(model, work, steps_per_call: int, device: torch.device):
    """Kernels per target step (one position of every row) of one call of
    `work`, and the share of its wall time that the GPU spends running them
    (measured under the profiler, so a lower bound; None on the CPU, where
    the count is of dispatched operators, the feedback loop's as a GPU
    replays it)."""
    if device.type != "cuda":
        return counted_as_a_gpu_replays_it(model, work).count / steps_per_call, None
    # CUDA only, from here: the profiler's kernels
    work()
    synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        work()
        synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == DeviceType.CUDA)
    busy, reach = 0.0, float("-inf")
    for begin, end in kernels:  # the union of the kernels' intervals
        busy += max(0.0, end - max(begin, reach))
        reach = max(reach, end)
    return len(kernels) / steps_per_call, busy / wall_us


def random_tokens(dictionary, rows, length, generator):
    """Drawn on the generator's device (the CPU): the same tokens whatever device they are moved to."""
    return torch.randint(dictionary.nspecial, len(dictionary), (rows, length), generator=generator,
                         device=generator.device)


def shifted(dictionary, tokens):
    return torch.cat([tokens.new_full((len(tokens), 1), dictionary.eos()), tokens[:, :-1]], dim=1)


def build_translation_model(arch, p, dictionary, seed, extra=()):
    sizes = size_flags("encoder", p["embed_dim"], p["ffn_dim"], p["heads"], p["layers"]) + \
        size_flags("decoder", p["embed_dim"], p["ffn_dim"], p["heads"], p["layers"])
    return builders.translation_model(arch, [*sizes, "--dropout", "0.1", *extra], dictionary, seed=seed)


LM_TASKS = {"transformer_lm": "language_modeling", "feedback_lm": "feedback_language_modeling"}


def build_language_model(arch, p, dictionary, seed, extra=()):
    flags = ["--tokens-per-sample", p["block"], "--decoder-input-dim", p["embed_dim"],
             "--decoder-output-dim", p["embed_dim"], "--dropout", "0.1",
             *size_flags("decoder", p["embed_dim"], p["ffn_dim"], p["heads"], p["layers"]), *extra]
    return builders.language_model(arch, LM_TASKS[arch], flags, dictionary, seed=seed)[0]


def language_model_pairs(p):
    """(name, architecture, options) of the two language models compared."""
    head_dim = ["--head-dim", str(p["head_dim"])] if "head_dim" in p else []
    return [("transformer_lm", "transformer_lm", ["--decoder-normalize-before"]),
            ("feedback_lm", "feedback_lm", ["--memory-span", str(p["span"]), *head_dim])]


def graphs_run(device: torch.device, cuda_graphs: str) -> bool:
    """Whether the feedback models replay their loop as graphs: on a GPU, or through the stand-in."""
    return cuda_graphs == "emulate" or (cuda_graphs == "auto" and device.type == "cuda")


def models(pairs, build, device, dtype, cuda_graphs: str, reference_loop: bool = False,
           memory: Optional[PeakMemory] = None):
    """Each (name, architecture, options) built on `device` in `dtype`, the
    feedback models with `--cuda-graphs cuda_graphs`; where their graphs
    run, each feedback model also as it runs without them; with
    `reference_loop`, each feedback model also with the reference loop.
    `memory`: where each model's weights are counted."""
    pairs = [(name, arch, [*extra, "--cuda-graphs", cuda_graphs] if arch.startswith("feedback") else extra)
             for name, arch, extra in pairs]
    feedback = [(name, arch, extra) for name, arch, extra in pairs if arch.startswith("feedback")]
    if graphs_run(device, cuda_graphs):
        pairs += [(f"{name} (eager)", arch, [*extra, "--no-cuda-graphs"]) for name, arch, extra in feedback]

    def on_the_device(name, arch, extra):
        with (memory or PeakMemory()).charged(name):
            return build(arch, extra).to(device=device, dtype=dtype)

    built = {name: on_the_device(name, arch, extra) for name, arch, extra in pairs}
    if reference_loop:
        for name, arch, extra in feedback:
            name = f"{name} (reference loop)"
            built[name] = with_the_reference_loop(on_the_device(name, arch, extra))
    return built


def with_the_reference_loop(model):
    """`model` with its feedback loop step by step through autograd, as
    before the fused block (--reference-loop): what the fused block saves."""
    model.decoder.use_fused_block(False)
    return model


class TorchAdam:
    """fp32: torch's Adam steps the parameters."""

    def __init__(self, params: List[Tensor]):
        self.adam = torch.optim.Adam(params, lr=LEARNING_RATE)

    def zero_grad(self):
        self.adam.zero_grad()

    def backward(self, loss: Tensor):
        loss.backward()

    def step(self):
        self.adam.step()


class FairseqMixedPrecision:
    """fp16 and bf16 as `fairseq-train --fp16` / `--bf16` train: fairseq's
    FP16Optimizer keeps fp32 master weights for fairseq's Adam (a plain Adam
    over fp16 weights turns them NaN at once: eps 1e-8 is 0 in fp16) and,
    for fp16, scales the loss dynamically. Each step first takes the
    gradients' norm as fairseq-train does (--clip-norm 0: no clipping), and
    a step whose fp16 gradients overflowed is skipped, the scale lowered."""

    def __init__(self, params: List[Tensor], dtype: torch.dtype):
        flags = ["--optimizer", "adam", "--lr", LEARNING_RATE, "--fp16" if dtype == torch.float16 else "--bf16"]
        if params[0].device.type != "cuda":
            flags.append("--fp16-no-flatten-grads")  # fairseq flattens the fp32 copy onto the current CUDA device
        self.optimizer = FP16Optimizer.build_optimizer(builders.training_config(flags), params)

    def zero_grad(self):
        self.optimizer.zero_grad()

    def backward(self, loss: Tensor):
        self.optimizer.backward(loss)

    def step(self):
        try:
            self.optimizer.clip_grad_norm(0.0)
        except OverflowError as overflow:
            logger.info(f"gradient overflow, step skipped: {overflow}")
            return
        self.optimizer.step()


def optimizer_for(model):
    params = [p for p in model.parameters() if p.requires_grad]
    return TorchAdam(params) if params[0].dtype == torch.float32 else FairseqMixedPrecision(params, params[0].dtype)


def training_step(model, forward, target, optimizer=None):
    """One optimizer step on `forward()`'s logits, as fairseq-train takes it
    in the model's dtype (with `optimizer`, or one of its own); returns the
    target tokens and the loss. `ops`: a _CountOps that counts its phases apart."""
    optimizer = optimizer or optimizer_for(model)

    def work(ops: Optional[_CountOps] = None):
        phase = (lambda name: contextlib.nullcontext()) if ops is None else ops.phase
        model.train()
        optimizer.zero_grad()
        with phase("forward"):
            logits = forward()
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), target().reshape(-1))
        with phase("backward"):
            optimizer.backward(loss)
        with phase("optimizer"):
            optimizer.step()
        return target().numel(), loss.detach()

    return work


def translation_training(model, dictionary, src, target, optimizer=None):
    """A training step on the pairs (src, target), [rows, tokens] each."""
    return translation_training_on(model, dictionary, [(src, target)], optimizer)


def translation_training_on(model, dictionary, batches, optimizer=None):
    """A training step on each of `batches` in turn, (src, target) pairs of [rows, tokens] each."""
    turns, batch = iter(range(10**9)), {}

    def forward():
        batch["src"], batch["target"] = batches[next(turns) % len(batches)]
        lengths = torch.full((len(batch["src"]),), batch["src"].size(1), device=batch["src"].device)
        return model(batch["src"], lengths, shifted(dictionary, batch["target"]))[0]

    return training_step(model, forward, lambda: batch["target"], optimizer)


def max_tokens_batches(dictionary, p, count, generator, device):
    """`count` pairs of (src, target) batches as fairseq's --max-tokens makes
    them: about p["batch"] x p["length"] tokens each, the length of each
    drawn between half and one and a half times p["length"] (fairseq
    batches sentences of about one length), the rows filling the tokens."""
    tokens, batches = p["batch"] * p["length"], []
    for _ in range(count):
        length = int(torch.randint(p["length"] // 2, p["length"] * 3 // 2 + 1, (1,), generator=generator))
        batches.append(tuple(random_tokens(dictionary, max(1, tokens // length), length, generator).to(device)
                             for _ in range(2)))
    return batches


def consecutive_blocks(model, blocks):
    """forward() and target() of consecutive blocks of the same streams, each
    call the next block, the memory carried where the model carries one."""
    counter, state = iter(range(10**9)), {"k": 0}

    def forward():
        state["k"] = next(counter) % (len(blocks) - 1)
        stream = {"stream": "benchmark", "block": state["k"]} if hasattr(model, "streams") else {}
        return model(blocks[state["k"]], **stream)[0]

    def target():
        return blocks[state["k"] + 1]

    return forward, target


def stream_blocks(dictionary, streams, block, generator, device):
    return random_tokens(dictionary, streams, block * 64, generator).to(device).split(block, dim=1)


def generation(model, dictionary, sample, length, **kwargs):
    """Beam search or sampling of `length` tokens per sequence (min = max, so
    that every hypothesis runs the full length whatever the weights)."""
    generator = SequenceGenerator([model], dictionary, max_len_a=0, max_len_b=length, min_len=length, **kwargs)

    @torch.no_grad()
    def work():
        model.eval()
        hypos = generator.generate([model], sample, prefix_tokens=sample.get("prefix_tokens"))
        return sum(len(nbest[0]["tokens"]) for nbest in hypos), torch.stack([nbest[0]["score"] for nbest in hypos])

    return work


def tensor_bytes(state) -> int:
    storages = {}
    for entries in state.values():
        for value in entries.values():
            if isinstance(value, torch.Tensor):
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


@torch.no_grad()
def state_bytes_per_token(model, encoder_out, prev):
    """Bytes of the incremental state per decoded token and hypothesis after
    decoding `prev` and one beam reorder (which every beam-search step does),
    on the model's device and in its dtype. Decoded eagerly: with CUDA
    graphs, the memory's keys and values are kept in a ring of fixed shape
    outside the incremental state instead (static_memory.py)."""
    model.eval()
    if hasattr(model, "set_beam_size"):  # as SequenceGenerator does
        model.set_beam_size(BEAM)
    state = {}
    with feedback_loop_in_mode(model, "off"):
        for t in range(prev.size(1)):
            model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
        model.decoder.reorder_incremental_state_scripting(state, torch.arange(len(prev), device=prev.device))
    return tensor_bytes(state) / prev.numel()


def translation(p, seed, device, dtype, cuda_graphs, reference_loop, first: int = 0):
    """The translation table (printed, and returned as table() returns it);
    with `first`, the rate over each model's first `first` batches first."""
    dictionary = make_dictionary(p["vocab"])
    g = torch.Generator().manual_seed(seed)
    src, target = (random_tokens(dictionary, p["batch"], p["length"], g).to(device) for _ in range(2))
    sentences = random_tokens(dictionary, p["beam_batch"], p["length"], g).to(device)
    sentence_lengths = torch.full((len(sentences),), p["length"], device=device)
    sample = {"net_input": {"src_tokens": sentences, "src_lengths": sentence_lengths}}
    hypotheses = random_tokens(dictionary, p["beam_batch"] * BEAM, p["length"], g).to(device)
    batches = max_tokens_batches(dictionary, p, first, g, device)

    memory = PeakMemory.on(device)
    built = models([("transformer", "transformer", []), ("feedback_transformer", "feedback_transformer", [])],
                   lambda arch, extra: build_translation_model(arch, p, dictionary, seed, extra), device, dtype,
                   cuda_graphs, reference_loop, memory)
    optimizers = {}
    for name, model in built.items():
        with memory.charged(name):  # fp16's fp32 master weights
            optimizers[name] = optimizer_for(model)
    train = {name: translation_training(model, dictionary, src, target, optimizers[name])
             for name, model in built.items()}
    beam = {name: generation(model, dictionary, sample, p["length"], beam_size=BEAM) for name, model in built.items()}
    state = {}
    for name, model in built.items():
        with torch.no_grad():
            model.eval()
            encoder_out = model.encoder(sentences.repeat_interleave(BEAM, 0), sentence_lengths.repeat_interleave(BEAM))
        state[name] = state_bytes_per_token(model, encoder_out, shifted(dictionary, hypotheses))

    finite = FiniteResults()
    rates, per_shape = {}, {}
    if first:
        rates[f"first {first} tok/s"], per_shape = first_batches(
            built, {name: translation_training_on(model, dictionary, batches, optimizers[name])
                    for name, model in built.items()}, first, finite, memory)
    rates["train tok/s"], train_capture = interleaved_rates(built, train, p["repeats"], "training", finite, memory)
    for name, model in built.items():
        check_before_search(name, "beam search", model,
                            lambda: model(sentences, sentence_lengths, shifted(dictionary, sentences))[0])
    rates[f"beam-{BEAM} tok/s"], beam_capture = interleaved_rates(built, beam, p["repeats"], "beam search", finite,
                                                                  memory)
    rates["state B/token"] = state
    profiles = {name: kernels_and_busy_share(model, train[name], p["length"], device) for name, model in built.items()}
    others = {"capture s/shape": per_shape} if per_shape else {}
    return table(
        f"translation: d={p['embed_dim']} ffn={p['ffn_dim']} heads={p['heads']} layers={p['layers']}+{p['layers']}, "
        f"training batches of {p['batch']}x{p['length']} tokens, beam {BEAM} over {p['beam_batch']} sentences of "
        f"{p['length']} tokens" + (f"; first {first} batches of about {p['batch'] * p['length']} tokens, lengths "
                                   f"{p['length'] // 2}-{p['length'] * 3 // 2}" if first else ""),
        list(built), rates,
        {**others, **profile_columns(built, profiles, [train_capture, beam_capture], device, cuda_graphs)},
        memory, {"peak train MB": "training", "peak beam MB": "beam search"})


def language_model(p, seed, device, dtype, cuda_graphs, reference_loop, first: int = 0):
    """The language-model table (printed, and returned as table() returns
    it); with `first`, the rate over each model's first `first` blocks first."""
    dictionary = make_dictionary(p["vocab"])
    g = torch.Generator().manual_seed(seed)
    blocks = stream_blocks(dictionary, p["streams"], p["block"], g, device)
    prompt = random_tokens(dictionary, p["sample_batch"], 1, g).to(device)
    sample = {"net_input": {"src_tokens": prompt, "src_lengths": torch.ones(len(prompt), dtype=torch.long,
                                                                            device=device)},
              "prefix_tokens": prompt}
    memory = PeakMemory.on(device)
    built = models(language_model_pairs(p), lambda arch, extra: build_language_model(arch, p, dictionary, seed, extra),
                   device, dtype, cuda_graphs, reference_loop, memory)

    train, evaluate, sampling = {}, {}, {}
    for name, model in built.items():
        forward, target = consecutive_blocks(model, blocks)
        with memory.charged(name):  # fp16's fp32 master weights
            train[name] = training_step(model, forward, target)

        @torch.no_grad()
        def evaluation(model=model, forward=forward, target=target):
            model.eval()
            loss = F.cross_entropy(forward().float().reshape(-1, len(dictionary)), target().reshape(-1))
            return target().numel(), loss

        evaluate[name] = evaluation
        # within transformer_lm's positions, the prompt and EOS included
        sampling[name] = generation(model, dictionary, sample, p["block"] - 2, beam_size=1,
                                    search_strategy=search.Sampling(dictionary))

    finite = FiniteResults()
    rates, captures, per_shape = {}, [], {}
    if first:  # the training steps' first blocks: the streams from their start
        rates[f"first {first} tok/s"], per_shape = first_batches(built, train, first, finite, memory)

    def measure(column, phase, workloads):
        rates[column], capture = interleaved_rates(built, workloads, p["repeats"], phase, finite, memory)
        captures.append(capture)

    measure("train tok/s", "training", train)
    measure("eval tok/s", "evaluation", evaluate)
    for name, model in built.items():
        check_before_search(name, "sampling", model, lambda: model(prompt)[0])
    measure("sample tok/s", "sampling", sampling)
    profiles = {name: kernels_and_busy_share(model, train[name], p["block"], device) for name, model in built.items()}
    return table(
        f"language model: d={p['embed_dim']} ffn={p['ffn_dim']} heads={p['heads']} layers={p['layers']}, "
        f"{p['streams']} streams x blocks of {p['block']} (feedback span {p['span']}, memory carried), "
        f"sampling {p['sample_batch']} sequences of {p['block'] - 2} tokens",
        list(built), rates, {**({"capture s/shape": per_shape} if per_shape else {}),
                             **profile_columns(built, profiles, captures, device, cuda_graphs)},
        memory, {"peak train MB": "training", "peak sample MB": "sampling"})


# --- where the operators are (--breakdown) ----------------------------------------------------------------

BREAKDOWN_ROWS = 8  # the count does not depend on the rows: few, to be quick


def operator_breakdown(title, build, training, layers, steps):
    """A training step's operators per target step (a position of every
    row), by phase and kind, counted as the ops/step column counts them.
    The loop's share per step comes from blocks of `steps` and 2 x steps
    (buckets apart), per layer from `layers` and layers - 1 layers.
    `build(layers)`: a model; `training(model, steps)`: its training step."""
    counts = {}
    for shape in ((layers, steps), (layers, 2 * steps), (layers - 1, steps)):
        model = build(shape[0])
        counts[shape] = counted_as_a_gpu_replays_it(model, training(model, shape[1])).kinds
    full, double, fewer = counts[layers, steps], counts[layers, 2 * steps], counts[layers - 1, steps]

    def per_step(phase, kind):
        return (double[phase][kind] - full[phase][kind]) / steps

    kinds = sorted({k for phase in ("forward", "backward") for k in double[phase]},
                   key=lambda k: -sum(per_step(ph, k) for ph in ("forward", "backward")))
    print(title)
    print(f"{'operator':44s}{'forward':>10s}{'backward':>10s}{'per layer':>11s}")
    loop = {ph: 0.0 for ph in ("forward", "backward")}
    for kind in kinds:
        step = [per_step(ph, kind) for ph in ("forward", "backward")]
        layer = sum((full[ph][kind] - fewer[ph][kind]) / steps for ph in ("forward", "backward"))
        if max(abs(v) for v in (*step, layer)) >= 0.05:
            print(f"{kind:44s}{step[0]:10.1f}{step[1]:10.1f}{layer:11.1f}")
        loop["forward"] += step[0]
        loop["backward"] += step[1]
    total = {ph: sum(full[ph].values()) / steps for ph in ("forward", "backward", "optimizer")}
    print(f"{'in the loop, per step':44s}{loop['forward']:10.1f}{loop['backward']:10.1f}")
    print(f"{'outside the loop, per target step':44s}{total['forward'] - loop['forward']:10.1f}"
          f"{total['backward'] - loop['backward']:10.1f}")
    print(f"{'optimizer (Adam), per target step':44s}{total['optimizer']:20.1f}")
    print(f"{'total per target step (ops/step)':44s}{sum(total.values()):20.1f}\n")


def breakdown(which, preset, seed, reference_loop):
    """--breakdown: where the feedback models' operators are (with
    `reference_loop`, with the reference loop)."""
    loop = with_the_reference_loop if reference_loop else (lambda model: model)
    which_loop = ", the reference loop" if reference_loop else ""
    if which in (None, "translation"):
        p = PRESETS[preset]["translation"]
        dictionary = make_dictionary(p["vocab"])

        def training(model, steps):
            g = torch.Generator().manual_seed(seed)
            return translation_training(model, dictionary, *(random_tokens(dictionary, BREAKDOWN_ROWS, steps, g)
                                                             for _ in range(2)))

        operator_breakdown(
            f"operators per target step of a training step, feedback_transformer d={p['embed_dim']} "
            f"ffn={p['ffn_dim']} heads={p['heads']} layers={p['layers']}+{p['layers']}, {p['length']} target steps"
            + which_loop,
            lambda layers: loop(build_translation_model("feedback_transformer", dict(p, layers=layers), dictionary,
                                                        seed)),
            training, p["layers"], p["length"])
    if which in (None, "lm"):
        p = PRESETS[preset]["lm"]
        dictionary = make_dictionary(p["vocab"])
        (_, arch, extra), = [pair for pair in language_model_pairs(p) if pair[1] == "feedback_lm"]

        def training(model, steps):
            blocks = stream_blocks(dictionary, BREAKDOWN_ROWS, steps, torch.Generator().manual_seed(seed), "cpu")
            return training_step(model, *consecutive_blocks(model, blocks))

        operator_breakdown(
            f"operators per target step of a training step, feedback_lm d={p['embed_dim']} ffn={p['ffn_dim']} "
            f"heads={p['heads']} layers={p['layers']}, blocks of {p['block']} (span {p['span']}, memory carried)"
            + which_loop,
            lambda layers: loop(build_language_model(arch, dict(p, layers=layers), dictionary, seed, extra)),
            training, p["layers"], p["block"])


def profile_columns(built, profiles, captures, device, cuda_graphs) -> Dict[str, Dict[str, float]]:
    """Where graphs run, each graphed model's capture (the seconds its calls
    that captured graphs took beyond steady calls, every phase's
    `captures` summed) and its graphs' memory at the end; then each model's
    training-step profile (`profiles`: kernels_and_busy_share's)."""
    columns = {}
    if graphs_run(device, cuda_graphs):
        graphed = {name: graph_statistics(model) for name, model in built.items() if graph_statistics(model) is not None}
        columns["capture s"] = {name: sum(c[name] for c in captures) for name in graphed}
        columns["graphs MB"] = {name: statistics.nbytes / 2**20 for name, statistics in graphed.items()}
    gpu = device.type == "cuda"
    columns["kernels/step" if gpu else "ops/step"] = {name: kernels for name, (kernels, _) in profiles.items()}
    if gpu:  # CUDA only
        columns["GPU busy"] = {name: busy for name, (_, busy) in profiles.items()}
    return columns


FORMATS = {"capture s": "{:.2f}", "capture s/shape": "{:.2f}", "GPU busy": "{:.0%}"}  # others: "{:.1f}"
NOT_MEASURED = "not measured on this device"


def table(title, names, compared: Dict[str, Dict[str, float]], others: Dict[str, Dict[str, float]],
          memory: PeakMemory, peaks: Dict[str, str]) -> dict:
    """Prints the table (print_table), each model's peak memory by phase
    (`peaks`: column -> phase) among `others` where it is measured; returns
    it for --json: its title, models, figures by column (each column's name
    gives the unit) and model, the ratios, and the columns not measured."""
    measured = {column: memory.column(phase) for column, phase in peaks.items()}
    others = {**others, **{column: peak for column, peak in measured.items() if peak is not None}}
    print_table(title, names, compared, others)
    theirs, ours = names[:2]
    return {"title": title, "models": names, "figures": {**compared, **others},
            "feedback / fairseq": {c: compared[c][ours] / compared[c][theirs] for c in compared},
            NOT_MEASURED: [column for column, peak in measured.items() if peak is None]}


def print_table(title, names, compared: Dict[str, Dict[str, float]], others: Dict[str, Dict[str, float]]):
    """`compared`: figures by column and model, the feedback model's (the
    second model's) also as a ratio to fairseq's (the first); `others`:
    more figures by column and model, "-" for a model without one."""
    columns = [*compared, *others]
    width = max(30, *(len(name) + 2 for name in names))
    print(title)
    print(f"{'model':{width}s}" + "".join(f"{c:>16s}" for c in columns))
    for name in names:
        cells = [f"{compared[c][name]:.1f}" for c in compared] + \
                [FORMATS.get(c, "{:.1f}").format(others[c][name]) if name in others[c] else "-" for c in others]
        print(f"{name:{width}s}" + "".join(f"{cell:>16s}" for cell in cells))
    theirs, ours = names[:2]
    print(f"{'feedback / fairseq':{width}s}" + "".join(f"{compared[c][ours] / compared[c][theirs]:16.2f}"
                                                       for c in compared))
    print()


def machine(device: torch.device) -> dict:
    """What the figures were measured on."""
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else
            f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}


def main(argv=None):
    parser = ArgumentParser(prog="feedback-benchmark", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="base")
    parser.add_argument("--only", choices=["translation", "lm"], help="run one of the two comparisons")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="the models' parameters and activations; fp16 and bf16 train as fairseq-train --fp16 "
                             "and --bf16 do (fp32 master weights, and for fp16 a dynamic loss scale)")
    parser.add_argument("--cuda-graphs", choices=["auto", "off", "emulate"], default="auto",
                        help="the feedback models' --cuda-graphs: auto, graphs on a GPU; emulate, the graphs' path "
                             "through the stand-in for capture on any device. Where graphs run, each feedback model "
                             "also runs eagerly, and the capture's cost is reported apart")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--breakdown", action="store_true",
                        help="instead of the rates: the feedback models' operators per target step of a training "
                             f"step by kind, forward and backward, in the loop and per layer ({BREAKDOWN_ROWS} rows, "
                             "on the CPU, as a GPU replays the loop)")
    parser.add_argument("--reference-loop", action="store_true",
                        help="also run each feedback model with its loop step by step through autograd (the "
                             "reference loop, as before the fused block): what the fused block saves; with "
                             "--breakdown, the reference loop's operators instead")
    parser.add_argument("--first-batches", type=int, default=0, metavar="N",
                        help="first, each model's rate over its first N training batches, every capture included "
                             "(translation: batches of fairseq's --max-tokens kind, of varied lengths; the language "
                             "model: its first N blocks), and the seconds each new shape cost a graphed model")
    parser.add_argument("--json", metavar="FILE", help="also write every figure of the tables, by column and model, "
                                                       "with the machine, to FILE")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no GPU is visible to torch")
    check_at_least(args, threads=1, first_batches=0)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"{torch.get_num_threads()} CPU threads"
    print(f"torch {torch.__version__}, {where}, {args.dtype}, preset {args.preset}\n")
    if args.breakdown:
        breakdown(args.only, args.preset, args.seed, args.reference_loop)
        return
    tables = {}
    try:
        if args.only in (None, "translation"):
            tables["translation"] = translation(PRESETS[args.preset]["translation"], args.seed, device, dtype,
                                                args.cuda_graphs, args.reference_loop, args.first_batches)
        if args.only in (None, "lm"):
            tables["lm"] = language_model(PRESETS[args.preset]["lm"], args.seed, device, dtype, args.cuda_graphs,
                                          args.reference_loop, args.first_batches)
    except NotFinite as error:
        fail(str(error))
    if args.json:
        with atomic_file(args.json) as f:
            json.dump({"command": ["feedback-benchmark", *sys.argv[1:]] if argv is None else
                       ["feedback-benchmark", *argv], "machine": machine(device), "dtype": args.dtype,
                       "preset": args.preset, "cuda_graphs": args.cuda_graphs,
                       "sizes": {name: PRESETS[args.preset][name] for name in tables}, "tables": tables}, f, indent=1)


if __name__ == "__main__":
    main()
