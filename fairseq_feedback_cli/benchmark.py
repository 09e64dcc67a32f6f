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
a third row runs them eagerly (--no-cuda-graphs) for comparison. Two more
columns come from a profile of one training step: kernels per target step
(a position of every row; on the CPU: operators dispatched, the count a GPU
would launch, the feedback loop's as a GPU replays it) and the share of the
step's wall time during which the GPU runs a kernel.
"""

import argparse
import collections
import contextlib
import statistics
import time
from typing import Optional

import torch
import torch.nn.functional as F
from fairseq import search
from fairseq.sequence_generator import SequenceGenerator
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from fairseq_feedback.models.feedback_decoder import FeedbackDecoder

from . import builders
from .builders import make_dictionary, size_flags
from .command_line import ArgumentParser, check_at_least, fail

PRESETS = {
    # the targets' settings: translation at base widths with a 6-layer decoder
    # and batches of ~4k tokens; the LM at d 256, 4 layers, block 64, 32 streams
    "base": dict(
        translation=dict(embed_dim=512, ffn_dim=2048, heads=8, layers=6, batch=128, length=32, vocab=10000,
                         beam_batch=128, repeats=3),
        lm=dict(embed_dim=256, ffn_dim=1024, heads=4, layers=4, streams=32, block=64, span=64, vocab=10000,
                sample_batch=32, repeats=7),
    ),
    # Table 8's IWSLT sizes with --max-tokens 8192-like batches; the LM at
    # feedback_lm_wiki103's sizes (without its adaptive input and softmax)
    "iwslt": dict(
        translation=dict(embed_dim=512, ffn_dim=1024, heads=4, layers=6, batch=256, length=32, vocab=10000,
                         beam_batch=128, repeats=5),
        lm=dict(embed_dim=512, ffn_dim=4096, heads=8, layers=4, streams=32, block=256, span=512, vocab=10000,
                sample_batch=32, repeats=5, head_dim=128),
    ),
    "tiny": dict(
        translation=dict(embed_dim=32, ffn_dim=64, heads=2, layers=2, batch=8, length=8, vocab=100,
                         beam_batch=2, repeats=2),
        lm=dict(embed_dim=32, ffn_dim=64, heads=2, layers=2, streams=4, block=8, span=8, vocab=100,
                sample_batch=2, repeats=2),
    ),
}
BEAM = 5
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def synchronize():
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def interleaved_rates(workloads, repeats):
    """Tokens per second of each workload (a call returning the tokens it
    processed), from the median of `repeats` calls made in turns."""
    times = {name: [] for name in workloads}
    tokens = {name: work() for name, work in workloads.items()}  # warm-up (and CUDA graphs captured)
    for _ in range(repeats):
        for name, work in workloads.items():
            synchronize()
            start = time.perf_counter()
            work()
            synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: tokens[name] / statistics.median(times[name]) for name in workloads}


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
def loop_as_a_gpu_replays_it(model):
    """A feedback decoder's loop through the CUDA-graph path, with the
    stand-in for capture (bucketed shapes, weight gradients once per block):
    on the CPU, the operators a GPU would replay rather than those of the
    eager loop."""
    decoder = model.decoder
    if not isinstance(decoder, FeedbackDecoder):
        yield
        return
    decoder.use_cuda_graphs("emulate")
    try:
        yield
    finally:
        decoder.use_cuda_graphs("off")


def counted_as_a_gpu_replays_it(model, work, warm_up: int = 2) -> _CountOps:
    """The operators of one call of `work` (a training step), on any device
    dispatched rather than launched: the feedback loop's as a GPU replays it.
    `warm_up`: calls before, through the graphs' path (a stream's memory
    takes a few blocks to fill its span, a graph per length)."""
    work()
    with loop_as_a_gpu_replays_it(model):
        for _ in range(warm_up):  # each shape's first calls: warm-up and capture, and the checks of new graphs
            work()
        with _CountOps() as ops:
            work(ops)
    return ops


def kernels_and_busy_share(model, work, steps_per_call: int, device: torch.device):
    """Kernels per target step (one position of every row) of one call of
    `work`, and the share of its
    wall time that the GPU spends running them (measured under the profiler,
    so a lower bound; None on the CPU, where the count is of dispatched
    operators, the feedback loop's as a GPU replays it)."""
    if device.type != "cuda":
        return counted_as_a_gpu_replays_it(model, work).count / steps_per_call, None
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
    return torch.randint(dictionary.nspecial, len(dictionary), (rows, length), generator=generator)


def shifted(dictionary, tokens):
    return torch.cat([torch.full((len(tokens), 1), dictionary.eos()), tokens[:, :-1]], dim=1)


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


def models(pairs, build, device, dtype, reference_loop=False):
    """Each (name, architecture, options) built on `device` in `dtype`; on a
    GPU, each feedback model also as it runs without CUDA graphs; with
    `reference_loop`, each feedback model also with the reference loop."""
    feedback = [(name, arch, extra) for name, arch, extra in pairs if arch.startswith("feedback")]
    if device.type == "cuda":
        pairs = [*pairs, *[(f"{name} (eager)", arch, [*extra, "--no-cuda-graphs"]) for name, arch, extra in feedback]]
    built = {name: build(arch, extra).to(device=device, dtype=dtype) for name, arch, extra in pairs}
    if reference_loop:
        for name, arch, extra in feedback:
            built[f"{name} (reference loop)"] = with_the_reference_loop(build(arch, extra).to(device=device,
                                                                                             dtype=dtype))
    return built


def with_the_reference_loop(model):
    """`model` with its feedback loop step by step through autograd, as
    before the fused block (--reference-loop): what the fused block saves."""
    model.decoder.use_fused_block(False)
    return model


def training_step(model, forward, target):
    """One optimizer step on `forward()`'s logits; returns the target tokens.
    `ops`: a _CountOps that counts its phases apart."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def work(ops: Optional[_CountOps] = None):
        phase = (lambda name: contextlib.nullcontext()) if ops is None else ops.phase
        model.train()
        optimizer.zero_grad()
        with phase("forward"):
            logits = forward()
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), target().reshape(-1))
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            optimizer.step()
        return target().numel()

    return work


def translation_training(model, dictionary, src, target):
    """A training step on the pairs (src, target), [rows, tokens] each."""
    lengths = torch.full((len(src),), src.size(1), device=src.device)
    return training_step(model, lambda: model(src, lengths, shifted(dictionary, target))[0], lambda: target)


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
        return sum(len(nbest[0]["tokens"]) for nbest in hypos)

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
    decoding `prev` and one beam reorder (which every beam-search step does)."""
    model.eval()
    if hasattr(model, "set_beam_size"):  # as SequenceGenerator does
        model.set_beam_size(BEAM)
    state = {}
    for t in range(prev.size(1)):
        model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
    model.decoder.reorder_incremental_state_scripting(state, torch.arange(len(prev)))
    return tensor_bytes(state) / prev.numel()


def translation(p, seed, device, dtype, reference_loop):
    dictionary = make_dictionary(p["vocab"])
    g = torch.Generator().manual_seed(seed)
    src, target = (random_tokens(dictionary, p["batch"], p["length"], g).to(device) for _ in range(2))
    lengths = torch.full((p["batch"],), p["length"], device=device)
    sentences = random_tokens(dictionary, p["beam_batch"], p["length"], g).to(device)
    sample = {"net_input": {"src_tokens": sentences, "src_lengths": torch.full((len(sentences),), p["length"],
                                                                               device=device)}}
    hypotheses = random_tokens(dictionary, p["beam_batch"] * BEAM, p["length"], g).to(device)

    built = models([("transformer", "transformer", []), ("feedback_transformer", "feedback_transformer", [])],
                   lambda arch, extra: build_translation_model(arch, p, dictionary, seed, extra), device, dtype,
                   reference_loop)
    train, beam, state, profiles = {}, {}, {}, {}
    for name, model in built.items():
        train[name] = translation_training(model, dictionary, src, target)
        beam[name] = generation(model, dictionary, sample, p["length"], beam_size=BEAM)
        with torch.no_grad():
            model.eval()
            encoder_out = model.encoder(sentences.repeat_interleave(BEAM, 0),
                                        lengths.new_full((len(hypotheses),), p["length"]))
        state[name] = state_bytes_per_token(model, encoder_out, shifted(dictionary, hypotheses))
        profiles[name] = kernels_and_busy_share(model, train[name], p["length"], device)
    train = interleaved_rates(train, p["repeats"])
    beam = interleaved_rates(beam, p["repeats"])
    print_table(
        f"translation: d={p['embed_dim']} ffn={p['ffn_dim']} heads={p['heads']} layers={p['layers']}+{p['layers']}, "
        f"training batches of {p['batch']}x{p['length']} tokens, beam {BEAM} over {p['beam_batch']} sentences of "
        f"{p['length']} tokens",
        ["train tok/s", f"beam-{BEAM} tok/s", "state B/token"],
        [(name, train[name], beam[name], state[name]) for name in built], profiles)


def language_model(p, seed, device, dtype, reference_loop):
    dictionary = make_dictionary(p["vocab"])
    g = torch.Generator().manual_seed(seed)
    blocks = stream_blocks(dictionary, p["streams"], p["block"], g, device)
    prompt = random_tokens(dictionary, p["sample_batch"], 1, g).to(device)
    sample = {"net_input": {"src_tokens": prompt, "src_lengths": torch.ones(len(prompt), dtype=torch.long,
                                                                            device=device)},
              "prefix_tokens": prompt}
    built = models(language_model_pairs(p), lambda arch, extra: build_language_model(arch, p, dictionary, seed, extra),
                   device, dtype, reference_loop)

    train, evaluate, sampling, profiles = {}, {}, {}, {}
    for name, model in built.items():
        forward, target = consecutive_blocks(model, blocks)
        train[name] = training_step(model, forward, target)

        @torch.no_grad()
        def evaluation(model=model, forward=forward, target=target):
            model.eval()
            F.cross_entropy(forward().float().reshape(-1, len(dictionary)), target().reshape(-1))
            return target().numel()

        evaluate[name] = evaluation
        # within transformer_lm's positions, the prompt and EOS included
        sampling[name] = generation(model, dictionary, sample, p["block"] - 2, beam_size=1,
                                    search_strategy=search.Sampling(dictionary))
        profiles[name] = kernels_and_busy_share(model, train[name], p["block"], device)
    rates = [interleaved_rates(w, p["repeats"]) for w in (train, evaluate, sampling)]
    print_table(
        f"language model: d={p['embed_dim']} ffn={p['ffn_dim']} heads={p['heads']} layers={p['layers']}, "
        f"{p['streams']} streams x blocks of {p['block']} (feedback span {p['span']}, memory carried), "
        f"sampling {p['sample_batch']} sequences of {p['block'] - 2} tokens",
        ["train tok/s", "eval tok/s", "sample tok/s"],
        [(name, *(r[name] for r in rates)) for name in built], profiles)


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
        counts[shape] = counted_as_a_gpu_replays_it(model, training(model, shape[1]), warm_up=6).kinds
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


def print_table(title, columns, rows, profiles):
    """Rates per model, the feedback model's (the second row's) as a ratio to
    fairseq's (the first), and each model's training-step profile."""
    gpu = any(busy is not None for _, busy in profiles.values())
    columns = [*columns, "kernels/step" if gpu else "ops/step", *(["GPU busy"] if gpu else [])]
    width = max(30, *(len(name) + 2 for name, *_ in rows))
    print(title)
    print(f"{'model':{width}s}" + "".join(f"{c:>16s}" for c in columns))
    for name, *values in rows:
        kernels, busy = profiles[name]
        print(f"{name:{width}s}" + "".join(f"{v:16.1f}" for v in (*values, kernels))
              + (f"{busy:16.0%}" if gpu else ""))
    (_, *theirs), (_, *ours) = rows[:2]
    print(f"{'feedback / fairseq':{width}s}" + "".join(f"{o / t:16.2f}" for o, t in zip(ours, theirs)))
    print()


def main(argv=None):
    parser = ArgumentParser(prog="feedback-benchmark", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="base")
    parser.add_argument("--only", choices=["translation", "lm"], help="run one of the two comparisons")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="the models' parameters and activations (fp16: on a GPU)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--breakdown", action="store_true",
                        help="instead of the rates: the feedback models' operators per target step of a training "
                             f"step by kind, forward and backward, in the loop and per layer ({BREAKDOWN_ROWS} rows, "
                             "on the CPU, as a GPU replays the loop)")
    parser.add_argument("--reference-loop", action="store_true",
                        help="also run each feedback model with its loop step by step through autograd (the "
                             "reference loop, as before the fused block): what the fused block saves; with "
                             "--breakdown, the reference loop's operators instead")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no GPU is visible to torch")
    if args.dtype == "fp16" and args.device == "cpu":
        fail("--dtype fp16 needs --device cuda (use bf16 on the CPU)")
    check_at_least(args, threads=1)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"{torch.get_num_threads()} CPU threads"
    print(f"torch {torch.__version__}, {where}, {args.dtype}, preset {args.preset}\n")
    if args.breakdown:
        breakdown(args.only, args.preset, args.seed, args.reference_loop)
        return
    if args.only in (None, "translation"):
        translation(PRESETS[args.preset]["translation"], args.seed, device, dtype, args.reference_loop)
    if args.only in (None, "lm"):
        language_model(PRESETS[args.preset]["lm"], args.seed, device, dtype, args.reference_loop)


if __name__ == "__main__":
    main()
