"""The two tables, translation and language modelling: each pair's rates in every phase as a
ratio (and those of a feedback model trained in passes, with --train-passes), beside the figures
of each model (state bytes, capture, graphs' memory, operators or kernels per step, peak memory)."""

from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from fairseq import search

from fairseq_feedback.loop.passes import Passes

from ..builders import make_dictionary
from .graphs import graph_statistics, graphs_run
from .measure import FiniteResults, PeakMemory, check_before_search, first_batches, interleaved_rates
from .operators import kernels_and_busy_share
from .workloads import (BEAM, build_language_model, build_translation_model, consecutive_blocks, generation,
                        language_model_pairs, max_tokens_batches, models, optimizer_for, random_tokens, shifted,
                        state_bytes_per_token, stream_blocks, trained_in_passes, training_step,
                        translation_training, translation_training_on)


def translation(p, seed, device, dtype, cuda_graphs, reference_loop, first: int = 0, passes: Optional[Passes] = None):
    """The translation table (printed, and returned as table() returns it);
    with `first`, the rate over each model's first `first` batches first;
    with `passes`, the feedback model also trained in passes."""
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
                   cuda_graphs, reference_loop, memory, passes=passes)
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
        memory, {"peak train MB": "training", "peak beam MB": "beam search"},
        [name for name, model in built.items() if trained_in_passes(model)])


def language_model(p, seed, device, dtype, cuda_graphs, reference_loop, first: int = 0,
                   passes: Optional[Passes] = None):
    """The language-model table (printed, and returned as table() returns
    it); with `first`, the rate over each model's first `first` blocks first;
    with `passes`, the feedback model also trained in passes."""
    dictionary = make_dictionary(p["vocab"])
    g = torch.Generator().manual_seed(seed)
    blocks = stream_blocks(dictionary, p["streams"], p["block"], g, device)
    prompt = random_tokens(dictionary, p["sample_batch"], 1, g).to(device)
    sample = {"net_input": {"src_tokens": prompt, "src_lengths": torch.ones(len(prompt), dtype=torch.long,
                                                                            device=device)},
              "prefix_tokens": prompt}
    memory = PeakMemory.on(device)
    built = models(language_model_pairs(p), lambda arch, extra: build_language_model(arch, p, dictionary, seed, extra),
                   device, dtype, cuda_graphs, reference_loop, memory, passes=passes)

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
        memory, {"peak train MB": "training", "peak sample MB": "sampling"},
        [name for name, model in built.items() if trained_in_passes(model)])


def profile_columns(built, profiles, captures, device, cuda_graphs) -> Dict[str, Dict[str, float]]:
    """Where graphs run, each graphed model's capture (the seconds its calls
    that captured graphs took beyond steady calls, every phase's
    `captures` summed) and its graphs' memory at the end; then each model's
    training-step profile (`profiles`: kernels_and_busy_share's)."""
    columns = {}
    if graphs_run(device, cuda_graphs):
        graphed = {name: graph_statistics(model) for name, model in built.items() if graph_statistics(model) is not None}
        columns["capture s"] = {name: sum(c[name] for c in captures) for name in graphed}
        columns["graphs MB"] = {name: graph_memory(statistics) / 2**20 for name, statistics in graphed.items()}
    gpu = device.type == "cuda"
    columns["kernels/step" if gpu else "ops/step"] = {name: kernels for name, (kernels, _) in profiles.items()}
    if gpu:  # CUDA only
        columns["GPU busy"] = {name: busy for name, (_, busy) in profiles.items()}
    return columns


def graph_memory(statistics) -> int:
    """What a model's graphs take from the device: their static buffers and their memory pool (or, where
    the pool's bytes are not known, what the graphs hold)."""
    return statistics.nbytes if statistics.pool_bytes is None else statistics.static_bytes + statistics.pool_bytes


FORMATS = {"capture s": "{:.2f}", "capture s/shape": "{:.2f}", "GPU busy": "{:.0%}"}  # others: "{:.1f}"
NOT_MEASURED = "not measured on this device"


def ratio_name(name: str, names: List[str]) -> str:
    """The name of the ratio of model `name`'s rates to fairseq's model's (the
    first of `names`): exact feedback's (the second's) "feedback / fairseq",
    another's after it, as "feedback_lm (passes 16x4) / fairseq"."""
    return "feedback / fairseq" if name == names[1] else f"{name} / fairseq"


def table(title, names, compared: Dict[str, Dict[str, float]], others: Dict[str, Dict[str, float]],
          memory: PeakMemory, peaks: Dict[str, str], passes_rows: Sequence[str] = ()) -> dict:
    """Prints the table (print_table), each model's peak memory by phase
    (`peaks`: column -> phase) among `others` where it is measured; returns
    it for --json: its title, models, figures by column (each column's name
    gives the unit) and model, the ratios (exact feedback's to fairseq's, and
    those of the models trained in passes, `passes_rows`, each by ratio_name),
    and the columns not measured."""
    measured = {column: memory.column(phase) for column, phase in peaks.items()}
    others = {**others, **{column: peak for column, peak in measured.items() if peak is not None}}
    ratios = {ratio_name(name, names): {c: compared[c][name] / compared[c][names[0]] for c in compared}
              for name in [names[1], *passes_rows]}
    print_table(title, names, compared, others, ratios)
    return {"title": title, "models": names, "figures": {**compared, **others}, **ratios,
            NOT_MEASURED: [column for column, peak in measured.items() if peak is None]}


def print_table(title, names, compared: Dict[str, Dict[str, float]], others: Dict[str, Dict[str, float]],
                ratios: Dict[str, Dict[str, float]]):
    """`compared`: figures by column and model; `others`: more figures by
    column and model, "-" for a model without one; `ratios`: lines under
    the models, each a ratio of the `compared` columns, by its name."""
    columns = [*compared, *others]
    width = max(30, *(len(name) + 2 for name in [*names, *ratios]))
    print(title)
    print(f"{'model':{width}s}" + "".join(f"{c:>16s}" for c in columns))
    for name in names:
        cells = [f"{compared[c][name]:.1f}" for c in compared] + \
                [FORMATS.get(c, "{:.1f}").format(others[c][name]) if name in others[c] else "-" for c in others]
        print(f"{name:{width}s}" + "".join(f"{cell:>16s}" for cell in cells))
    for ratio, by_column in ratios.items():
        print(f"{ratio:{width}s}" + "".join(f"{by_column[c]:16.2f}" for c in compared))
    print()
