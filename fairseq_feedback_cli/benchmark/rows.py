"""--rows: speed against rows. A kernel's time barely grows with its rows until the device is full,
and a feedback step is many small kernels over few rows, so its tokens/s should grow with the rows a
step carries (the language model's streams, translation's sentences) where fairseq's flattens once
its batch fills the device. Each pair is trained at each batch, built afresh for it (its peak memory
its own), the two models' calls interleaved; then each model at its fastest batch within a memory
budget, and the ratio of the two: how much slower exact feedback is when each trains as it trains
best. With --train-passes, the feedback model also trained in passes, a third model measured the
same way, with its own ratio to fairseq's. The exact feedback model's step is profiled at the
smallest and the largest batch (profile.py)."""

import gc
from typing import List, Optional, Sequence

import torch

from fairseq_feedback.loop.graphed_loop import GraphedFeedbackLoop
from fairseq_feedback.loop.passes import Passes
from fairseq_feedback.models.feedback_decoder import FeedbackDecoder

from ..builders import make_dictionary
from .graphs import graph_statistics, graphs_run
from .measure import FiniteResults, PeakMemory, interleaved_rates
from .operators import kernels_and_busy_share
from .profile import print_profile, where_the_time_goes
from .tables import graph_memory, ratio_name
from .workloads import (build_language_model, build_translation_model, consecutive_blocks, language_model_pairs,
                        models, optimizer_for, random_tokens, stream_blocks, training_step, translation_training)

# The vendors' memory bandwidths (bytes/s) by a part of the name torch gives the card, the first that matches
BANDWIDTHS = [("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
              ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12),
              ("A10G", 0.6e12), ("L4", 0.3e12), ("V100", 0.9e12)]


def device_bandwidth(device: torch.device) -> Optional[float]:
    """The card's memory bandwidth in bytes/s, where BANDWIDTHS knows it (None on the CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)  # CUDA only
    return next((bandwidth for part, bandwidth in BANDWIDTHS if part in name), None)


def device_memory(device: torch.device) -> Optional[int]:
    """The memory budget's default: the card's memory (None on the CPU, where peaks are not measured)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None  # CUDA only


def bytes_read(model, steps: int, rows: int, carried: bool, source_len: Optional[int]) -> int:
    """The bytes a training step must read at least, forward and backward
    each: fairseq's model its weights once; a feedback model, whose every
    step reads the loop's weights, those at each of its `steps` and the
    memory's keys and values over the span for each layer (each step of a
    block from the start of the memory, or over the whole span where the
    memory is `carried`), and where it translates, the encoder's keys and
    values of its `source_len` positions, for each layer and step. Where
    its blocks run from graphs (padded_by_graphs), at the shape of their
    bucket: rows, steps and source positions padded (buckets.py), the
    span's window too, the padding read as any row is.

    A feedback model trained in passes (decoder.passes) takes K passes
    over each group of G positions, all G at once: each pass reads the
    loop's weights once, and for each layer the slots before the group (up
    to the span) and the group's own but its last, and the encoder's, once
    for all G queries; ceil(steps / G) x K passes in place of the steps."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    decoder = model.decoder
    if not isinstance(decoder, FeedbackDecoder):
        return 2 * weights
    memory, element = decoder.memory, next(model.parameters()).element_size()
    loop = sum(p.numel() * p.element_size() for p in [*memory.parameters(), *decoder.layers.parameters()])
    slot = 2 * memory.num_heads * memory.head_dim * element  # a key and a value
    span = decoder.current_span()
    if padded_by_graphs(model):
        rows, steps, source_len = GraphedFeedbackLoop.block_shape(rows, steps, source_len)
        span = GraphedFeedbackLoop.window(span, decoder.span)
    passes = decoder.passes
    if passes is None:
        loop_runs = steps
        slots = steps * span if carried else sum(min(t + 1, span) for t in range(steps))  # m_{-1} at the start
    else:
        groups = range(0, steps, passes.group)  # each group's first position
        loop_runs = len(groups) * passes.passes
        slots = passes.passes * sum(group_slots(start, min(passes.group, steps - start), span, carried)
                                    for start in groups)
    reads = len(decoder.layers) * rows * slot * (slots + (loop_runs * source_len if source_len else 0))
    return 2 * (weights - loop + loop_runs * loop + reads)


def padded_by_graphs(model) -> bool:
    """Whether a feedback model's training blocks run from graphs, padded to
    their bucket: with --cuda-graphs on a GPU or through the stand-in, until
    the graphs give up; never in passes, which run eagerly. On the CPU
    without the stand-in the loop runs eagerly, at the real rows."""
    decoder, statistics = model.decoder, graph_statistics(model)
    return (decoder.passes is None and graphs_run(next(model.parameters()).device, decoder.cuda_graphs_mode)
            and (statistics is None or statistics.failed is None))


def group_slots(start: int, length: int, span: int, carried: bool) -> int:
    """The memory slots a pass over the group of `length` positions from
    `start` reads, in each layer and row: those before the group, up to the
    span (from m_{-1} at the block's start, or the whole span where the
    memory is `carried`), and the group's own but its last."""
    return (span if carried else min(start + 1, span)) + length - 1


def translation_at(p, rows, built, dictionary, seed, device, memory):
    """Training steps of the translation pair `built` on `rows` sentences a
    batch, each with an optimizer of its own (charged to its model in
    `memory`): (the steps, target steps per call, bytes_read's arguments)."""
    g = torch.Generator().manual_seed(seed)
    src, target = (random_tokens(dictionary, rows, p["length"], g).to(device) for _ in range(2))
    train = {}
    for name, model in built.items():
        with memory.charged(name):  # fp16's fp32 master weights
            train[name] = translation_training(model, dictionary, src, target, optimizer_for(model))
    return train, p["length"], dict(carried=False, source_len=p["length"])


def language_model_at(p, rows, built, dictionary, seed, device, memory):
    """The language-model pair's on `rows` streams, the memory carried from block to block."""
    blocks = stream_blocks(dictionary, rows, p["block"], torch.Generator().manual_seed(seed), device)
    train = {}
    for name, model in built.items():
        with memory.charged(name):
            train[name] = training_step(model, *consecutive_blocks(model, blocks))
    return train, p["block"], dict(carried=True, source_len=None)


PAIRS = {"translation": (translation_at, build_translation_model,
                         lambda p: [("transformer", "transformer", []),
                                    ("feedback_transformer", "feedback_transformer", [])]),
         "lm": (language_model_at, build_language_model, language_model_pairs)}
UNITS = {"translation": "sentences a batch", "lm": "streams"}


def as_built(built, initial) -> None:
    """Each model's weights as they were built, and a feedback model's graphs
    afresh (--cuda-graphs as before): each batch trains from the same start."""
    for name, model in built.items():
        model.load_state_dict(initial[name])
        if isinstance(model.decoder, FeedbackDecoder):
            model.decoder.use_cuda_graphs(model.decoder.cuda_graphs_mode)


def sweep(which: str, p: dict, rows: Sequence[int], seed: int, device: torch.device, dtype, cuda_graphs: str,
          budget: Optional[int], bandwidth: Optional[float], passes: Optional[Passes] = None) -> dict:
    """Each batch of `rows`, every model (fairseq's, exact feedback, and with
    `passes` the feedback model trained in passes): printed, and returned
    for --json (figures by batch and model, each feedback model's ratio to
    fairseq's among them, the fastest batch of each within `budget` bytes of
    peak memory (None: every batch), the ratios at it, and the exact
    feedback model's profiles at the smallest and the largest batch). The
    models are built once (fairseq's option parsing takes seconds a model),
    and each batch starts them from the same weights, with an optimizer and
    graphs of its own, its peak memory counted from their weights."""
    pair, build, pairs = PAIRS[which]
    dictionary = make_dictionary(p["vocab"])
    weights = PeakMemory.on(device)
    built = models(pairs(p), lambda arch, extra: build(arch, p, dictionary, seed, extra), device, dtype, cuda_graphs,
                   memory=weights, eager_too=False, passes=passes)
    initial = {name: {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
               for name, model in built.items()}
    batches: List[dict] = []
    profiles = {}
    for n in rows:
        as_built(built, initial)
        memory = weights.copy()
        try:
            workloads = pair(p, n, built, dictionary, seed, device, memory)
            batch = measured(built, *workloads, n, device, memory, p["repeats"], bandwidth,
                             profile=n in (min(rows), max(rows)))
        except torch.cuda.OutOfMemoryError as error:  # CUDA only: the larger batches are not tried
            batches.append({"rows": n, "out of memory": str(error).splitlines()[0]})
            break
        finally:
            workloads = None
            if device.type == "cuda":  # CUDA only: the batch's optimizers and graphs go before the next
                gc.collect()
                torch.cuda.empty_cache()
        profiles.update(batch.pop("profile"))
        batches.append(batch)
    names = list(built)
    result = {"rows": list(rows), "unit": UNITS[which], "models": names, "batches": batches,
              "best": fastest(batches, names, budget), "memory budget MB": None if budget is None else budget / 2**20,
              "bandwidth GB/s": None if bandwidth is None else bandwidth / 1e9, "profiles": profiles}
    print_sweep(which, p, result)
    return result


def measured(built, train, steps, shape, n, device, memory, repeats, bandwidth, profile: bool) -> dict:
    """One batch of the sweep, of `n` rows: the figures of each model (its
    training step `train[name]`, of `steps` target steps; `shape`:
    bytes_read's arguments; a feedback model's rate as a ratio to fairseq's,
    the first model's, under "feedback / fairseq"), exact feedback's ratio
    (the second model's) again on its own, and with `profile`, exact
    feedback's profile, by batch."""
    finite = FiniteResults()
    rates, _ = interleaved_rates(built, train, repeats, "training", finite, memory)
    peaks = memory.column("training")
    theirs, ours = list(built)[:2]
    figures, profiles = {}, {}
    for name, model in built.items():
        statistics = graph_statistics(model)
        if profile and name == ours:  # its figures of the two columns too
            profiles[str(n)] = where_the_time_goes(model, train[name], steps, device)
            kernels, busy = profiles[str(n)]["counted per step"], profiles[str(n)]["busy"]
        else:
            kernels, busy = kernels_and_busy_share(model, train[name], steps, device)
        seconds = n * steps / rates[name]
        figures[name] = {
            "train tok/s": rates[name], "feedback / fairseq": None if name == theirs else rates[name] / rates[theirs],
            "ms/step": 1000 * seconds,
            "peak MB": None if peaks is None else peaks[name],
            "graphs MB": None if statistics is None else graph_memory(statistics) / 2**20,
            "graphs gave up": None if statistics is None else statistics.failed,
            "kernels/step" if device.type == "cuda" else "ops/step": kernels, "GPU busy": busy,
            "MB read/step": bytes_read(model, steps, n, **shape) / 2**20}
        if bandwidth:
            figures[name]["ms at the bandwidth"] = 1000 * bytes_read(model, steps, n, **shape) / bandwidth
    return {"rows": n, "figures": figures, "feedback / fairseq": rates[ours] / rates[theirs], "profile": profiles}


def fastest(batches: List[dict], names: List[str], budget: Optional[int]) -> dict:
    """Each model's fastest batch whose peak memory fits `budget` (and whose
    graphs did not give up), a feedback model's with its rate there as a
    ratio to fairseq's (the first model's) at its own; and exact feedback's
    ratio (the second model's) again on its own, None where either fits no
    batch."""
    best = {}
    for name in names:
        fitting = [b for b in batches if "figures" in b and not b["figures"][name]["graphs gave up"]
                   and (budget is None or b["figures"][name]["peak MB"] is None
                        or b["figures"][name]["peak MB"] * 2**20 <= budget)]
        if fitting:
            chosen = max(fitting, key=lambda b: b["figures"][name]["train tok/s"])
            best[name] = {"rows": chosen["rows"], "train tok/s": chosen["figures"][name]["train tok/s"]}
    theirs, ours = names[:2]
    for name in names[1:]:
        if name in best:
            best[name]["feedback / fairseq"] = (best[name]["train tok/s"] / best[theirs]["train tok/s"]
                                                if theirs in best else None)
    return {**best, "feedback / fairseq": best[ours]["feedback / fairseq"] if ours in best else None}


COLUMNS = ["train tok/s", "feedback / fairseq", "ms/step", "peak MB", "graphs MB", "ops/step", "kernels/step",
           "GPU busy", "MB read/step", "ms at the bandwidth"]


def print_sweep(which: str, p: dict, result: dict) -> None:
    names = result["models"]
    shown = [c for c in COLUMNS if any(
        c in b["figures"][name] and b["figures"][name][c] is not None for b in result["batches"] if "figures" in b
        for name in names)]
    width = max(24, *(len(name) + 2 for name in names))
    sizes = f"d={p['embed_dim']} ffn={p['ffn_dim']} heads={p['heads']} layers={p['layers']}"
    what = (f"translation: {sizes}+{p['layers']}, sentences of {p['length']} tokens, source and target"
            if which == "translation"
            else f"language model: {sizes}, blocks of {p['block']} (feedback span {p['span']}, memory carried)")
    bandwidth = result["bandwidth GB/s"]
    print(f"speed against rows, {what}; rows: {result['unit']}"
          + (f"; the bandwidth {bandwidth:,.0f} GB/s" if bandwidth else ""))
    print(f"{'rows':>6s}  {'model':{width}s}" + "".join(f"{c:>20s}" for c in shown))
    for batch in result["batches"]:
        if "figures" not in batch:
            print(f"{batch['rows']:6d}  out of memory: {batch['out of memory']}")
            continue
        for name in names:
            figures = batch["figures"][name]
            cells = ["-" if figures.get(c) is None else f"{figures[c]:.0%}" if c == "GPU busy" else
                     f"{figures[c]:.2f}" if c == "feedback / fairseq" else f"{figures[c]:,.1f}" for c in shown]
            gave_up = f"  (graphs gave up: {figures['graphs gave up']})" if figures["graphs gave up"] else ""
            print(f"{batch['rows']:6d}  {name:{width}s}" + "".join(f"{cell:>20s}" for cell in cells) + gave_up)
    best = result["best"]
    budget = result["memory budget MB"]
    within = f"within {budget / 1024:,.1f} GB" if budget else "(peak memory not measured here: every batch counts)"
    ratios = [f"{ratio_name(name, names)} {best[name]['feedback / fairseq']:.2f}" for name in names[1:]
              if name in best and best[name]["feedback / fairseq"] is not None]
    print(f"each at its fastest batch {within}: " + ", ".join(
        f"{name} {best[name]['rows']} rows ({best[name]['train tok/s']:,.1f} tok/s)" for name in names
        if name in best) + ("; " + ", ".join(ratios) if ratios else "; no ratio: a model fits no batch"))
    print()
    for n, table in result["profiles"].items():
        print_profile(f"{names[1]} at {n} rows, one training step profiled", table)
