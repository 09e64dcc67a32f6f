"""Steps 3a-3e: feedback-benchmark in fp16 at the translation and the language-model sizes (graphs
against eager against fairseq's Transformer), fairseq-eval-lm's tokens/s at the language-model size,
and feedback-benchmark --rows at both sizes (speed against rows, the language model's also trained in
passes, each model at its best batch, and where the feedback model's training step spends its time,
kernel by kernel)."""

import contextlib
import json
import os
import re
from typing import Dict, List

from ..presets import PRESETS
from .check import NOT_MEASURED, PLUGIN, Check, Command, Outcome, StepFailed, read
from .corpora import text_corpus
from .training import graphs_in


def figure(column: str, value) -> str:
    """A cell of a benchmark's table: a share as a percentage, small figures to 2 decimals, others whole."""
    if value is None:
        return "-"
    return f"{value:.0%}" if column == "GPU busy" else f"{value:.2f}" if abs(value) < 10 else f"{value:,.0f}"


def rate_ratios(figures: Dict[str, Dict[str, float]], models: List[str]) -> Dict[str, Dict[str, float]]:
    """Each rate (a column in tokens per second) of the feedback model with graphs and without as a ratio
    to fairseq's model (models[0]), and graphs to eager, by the ratio's name."""
    fairseq, graphed, *eager = models
    pairs = {f"{graphed} / {fairseq}": (graphed, fairseq)}
    if eager:
        pairs.update({f"{eager[0]} / {fairseq}": (eager[0], fairseq), "graphs / eager": (graphed, eager[0])})
    return {ratio: {column: by_model[ours] / by_model[theirs] for column, by_model in figures.items()
                    if column.endswith("tok/s")} for ratio, (ours, theirs) in pairs.items()}


def benchmark(check: Check, only: str) -> Outcome:
    """feedback-benchmark --only `only` (translation, lm) in fp16."""
    sizes = check.sizes["benchmark"]
    written = check.path("work", f"benchmark-{only}.json")
    command = Command("fairseq_feedback_cli.benchmark", [
        "--only", only, "--preset", sizes["preset"], "--dtype", "fp16", "--device", check.args.device, "--cuda-graphs",
        check.graphs, "--first-batches", sizes["first_batches"], "--json", written], f"benchmark-{only}.log")
    check.run(command)
    with open(written) as f:
        table = json.load(f)["tables"][only]
    models, figures = table["models"], table["figures"]
    ratios = rate_ratios(figures, models)
    columns = [*figures, *table[NOT_MEASURED]]
    rows = [f"| {model} | " + " | ".join(NOT_MEASURED if column not in figures else
                                         figure(column, figures[column].get(model)) for column in columns) + " |"
            for model in models]
    rows += [f"| {ratio} | " + " | ".join(f"{by_column[column]:.2f}" if column in by_column else ""
                                          for column in columns) + " |" for ratio, by_column in ratios.items()]
    graphed = ratios[f"{models[1]} / {models[0]}"]
    first = next((column for column in figures if column.startswith("first")), None)
    summary = (f"feedback's training words/s {graphed['train tok/s']:.2f}x fairseq's with graphs"
               + (f", {ratios[f'{models[2]} / {models[0]}']['train tok/s']:.2f}x eagerly" if len(models) > 2 else "")
               + (f"; its first {sizes['first_batches']} batches at {graphed[first]:.2f}x" if first else "")
               + (f"; {figures['capture s/shape'][models[1]]:.2f} s per new shape" if "capture s/shape" in figures
                  else ""))
    outcome = Outcome(summary, table, [
        f"On {check.machine['device']}, fp16, `feedback-benchmark --preset {sizes['preset']}`: {table['title']}.", "",
        "tok/s: target tokens per second (fairseq's words/s), the median of steady calls; first N tok/s: over each "
        "model's first N training batches, every capture and first sighting included; capture s/shape: what a graphed "
        "model's first passes over those batches took beyond a steady pass, per graph captured; capture s: the "
        "steady workloads' calls that captured, beyond a steady call; MB: 2^20 bytes (peak: "
        "torch.cuda.max_memory_allocated as with the model alone on the GPU); ops/step or kernels/step: per target "
        "position of a training step; GPU busy: the share of a training step's wall time the GPU ran kernels.", "",
        "| model | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns), *rows])
    _, gave_up = graphs_in(read(check.path("logs", command.log)))
    if gave_up:  # the graphed rows are eager ones
        raise StepFailed(f"the graphs gave up: {gave_up}", outcome)
    return outcome


def eval_lm(check: Check) -> Outcome:
    """fairseq-eval-lm's tokens/s at the benchmark's language-model size, in
    fp16, of feedback_lm with graphs and eagerly and of transformer_lm (each
    from a checkpoint of one update: the rate does not depend on the weights)."""
    sizes = check.sizes["eval_lm"]
    p = PRESETS[sizes["preset"]]["lm"]
    data = text_corpus(check, "lm", [*sizes["corpus"], "--vocab", p["vocab"] - 4])  # with fairseq's 4 symbols
    shape = ["--decoder-embed-dim", p["embed_dim"], "--decoder-ffn-embed-dim", p["ffn_dim"],
             "--decoder-attention-heads", p["heads"], "--decoder-layers", p["layers"], "--decoder-input-dim",
             p["embed_dim"], "--decoder-output-dim", p["embed_dim"]]
    blocks = ["--tokens-per-sample", p["block"], "--batch-size", p["streams"], "--num-workers", 0]
    task = {"feedback_lm": "feedback_language_modeling", "transformer_lm": "language_modeling"}
    options = {"feedback_lm": ["--memory-span", p["span"], "--cuda-graphs", "off",
                               *(["--head-dim", p["head_dim"]] if "head_dim" in p else [])],
               "transformer_lm": ["--decoder-normalize-before"]}
    checkpoint = {arch: check.path("work", "lm", arch, "checkpoint_last.pt") for arch in options}
    try:
        check.run(*[Command("fairseq_cli.train", [
            data, "--user-dir", PLUGIN, "--task", task[arch], "--arch", arch, *flags, *shape, *blocks,
            "--optimizer", "adam", "--lr", "1e-4", "--max-update", 1, "--save-dir", os.path.dirname(checkpoint[arch]),
            "--disable-validation", "--no-epoch-checkpoints", "--seed", 1, *check.device_flags()],
            f"eval-lm-checkpoint-{arch}.log") for arch, flags in options.items()])
        rates, losses, logs = {}, {}, {}
        for name, arch, graphs in (("feedback_lm", "feedback_lm", check.graphs),
                                   ("feedback_lm (eager)", "feedback_lm", "off"),
                                   ("transformer_lm", "transformer_lm", None)):
            command = Command("fairseq_cli.eval_lm", [
                data, "--user-dir", PLUGIN, "--task", task[arch], "--path", checkpoint[arch], "--gen-subset", "valid",
                *blocks, *check.device_flags("fp16"), *(["--model-overrides", json.dumps({"cuda_graphs": graphs})]
                                                       if graphs else [])],
                f"eval-lm-{name.replace(' (eager)', '-eager')}.log")
            check.run(command)  # one at a time: each rate is measured alone
            logs[name] = read(check.path("logs", command.log))
            evaluated = re.search(r"Evaluated [\d,]+ tokens in [\d.]+s \(([\d.]+) tokens/s\)", logs[name])
            loss = re.search(r"Loss \(base 2\): ([\d.]+)", logs[name])
            if not (evaluated and loss):
                raise StepFailed(f"fairseq-eval-lm printed no rate or loss for {name} (logs/{command.log})")
            rates[name], losses[name] = float(evaluated.group(1)), float(loss.group(1))
    finally:  # one-update checkpoints, of hundreds of MB at the full size
        for path in checkpoint.values():
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    captured, gave_up = graphs_in(logs["feedback_lm"])
    difference = abs(losses["feedback_lm"] - losses["feedback_lm (eager)"])
    figures = {"tokens/s": rates, "loss (bits/token)": losses, "graphs captured": captured,
               "feedback_lm / transformer_lm": rates["feedback_lm"] / rates["transformer_lm"],
               "feedback_lm (eager) / transformer_lm": rates["feedback_lm (eager)"] / rates["transformer_lm"],
               "graphs / eager": rates["feedback_lm"] / rates["feedback_lm (eager)"]}
    outcome = Outcome(
        f"feedback_lm's tokens/s {figures['feedback_lm / transformer_lm']:.2f}x transformer_lm's with graphs, "
        f"{figures['feedback_lm (eager) / transformer_lm']:.2f}x eagerly", figures,
        [f"On {check.machine['device']}, fp16, `feedback-benchmark --preset {sizes['preset']}`'s language-model "
         f"size, {p['streams']} streams x blocks of {p['block']} tokens; fairseq-eval-lm's own figure, whose timer "
         "includes the graphs' capture.", "", "| model | tokens/s | loss (bits/token) |", "|---|---:|---:|",
         *[f"| {name} | {rates[name]:,.0f} | {losses[name]:.4f} |" for name in rates], "",
         f"Ratios: feedback_lm with graphs / transformer_lm {figures['feedback_lm / transformer_lm']:.2f}, eager / "
         f"transformer_lm {figures['feedback_lm (eager) / transformer_lm']:.2f}, graphs / eager "
         f"{figures['graphs / eager']:.2f}."])
    if gave_up or not captured:
        raise StepFailed(f"fairseq-eval-lm with graphs ran eagerly: {gave_up or 'no graph was captured'}", outcome)
    if difference > check.tolerance("fp16"):
        raise StepFailed(f"fairseq-eval-lm's loss with graphs ({losses['feedback_lm']}) and eagerly "
                         f"({losses['feedback_lm (eager)']}) differ by more than {check.tolerance('fp16'):g}", outcome)
    return outcome


SWEEP_COLUMNS = ["train tok/s", "feedback / fairseq", "ms/step", "peak MB", "graphs MB", "kernels/step", "ops/step",
                 "GPU busy", "MB read/step", "ms at the bandwidth"]


def best_ratios(sweep: dict) -> str:
    """Each feedback model's rate at its fastest batch as a ratio to fairseq's
    at its: "feedback / fairseq 0.41, feedback_lm (passes 16x4) / fairseq 0.65"
    (exact feedback first, under the name the benchmark prints it by); ""
    where none fits a batch."""
    feedback, best = sweep["models"][1], sweep["best"]
    return ", ".join(f"{'feedback' if model == feedback else model} / fairseq {best[model]['feedback / fairseq']:.2f}"
                     for model in sweep["models"][1:]
                     if model in best and best[model]["feedback / fairseq"] is not None)


def rows_sweep(check: Check, only: str) -> Outcome:
    """feedback-benchmark --only `only` --rows in fp16: every model at each
    batch (fairseq's, exact feedback, and where the sizes say so the
    feedback model trained in passes, each feedback model with its ratio to
    fairseq's), each at its fastest, and the exact feedback model's step
    profiled at the smallest and the largest batch."""
    sizes = check.sizes["benchmark"]
    rows = check.sizes["rows"][only]
    passes = check.sizes["passes"].get(only)
    options = ["--rows", ",".join(map(str, rows)),
               *([] if passes is None else ["--train-passes", passes["passes"], "--pass-group", passes["group"]])]
    written = check.path("work", f"rows-{only}.json")
    command = Command("fairseq_feedback_cli.benchmark", [
        "--only", only, "--preset", sizes["preset"], "--dtype", "fp16", "--device", check.args.device, "--cuda-graphs",
        check.graphs, *options, "--json", written], f"rows-{only}.log")
    check.run(command)
    with open(written) as f:
        sweep = json.load(f)["rows"][only]
    fairseq, feedback, *in_passes = sweep["models"]
    columns = [c for c in SWEEP_COLUMNS if any(
        c in b["figures"][m] for b in sweep["batches"] if "figures" in b for m in sweep["models"])]
    lines = [f"| {sweep['unit']} | model | " + " | ".join(columns) + " |", "|---:|---|" + "---:|" * len(columns)]
    for batch in sweep["batches"]:
        if "figures" not in batch:
            lines.append(f"| {batch['rows']} | out of memory: {batch['out of memory']} |" + " |" * len(columns))
            continue
        for model in sweep["models"]:
            figures = batch["figures"][model]
            cells = [NOT_MEASURED if c == "peak MB" and figures[c] is None else figure(c, figures.get(c))
                     for c in columns]
            gave_up = f" (graphs gave up: {figures['graphs gave up']})" if figures["graphs gave up"] else ""
            lines.append(f"| {batch['rows']} | {model}{gave_up} | " + " | ".join(cells) + " |")
    best = sweep["best"]
    budget = sweep["memory budget MB"]
    fastest = ", ".join(f"{model} at {best[model]['rows']} rows ({best[model]['train tok/s']:,.0f} tok/s)"
                        for model in sweep["models"] if model in best)
    ratios = best_ratios(sweep)
    at_smallest = next((b["feedback / fairseq"] for b in sweep["batches"] if "figures" in b), None)
    summary = (f"each at its fastest batch, {ratios}" if ratios else "a model fits no batch") + \
        (f" ({fastest})" if fastest else "") + (f"; at {rows[0]} rows {at_smallest:.2f}" if at_smallest is not None
                                                else "")
    markdown = [f"On {check.machine['device']}, fp16, `feedback-benchmark --preset {sizes['preset']} "
                f"{' '.join(map(str, options))}`; rows: {sweep['unit']}"
                + "".join(f"; {model}: {feedback} trained in passes, {passes['passes']} over each group of "
                          f"{passes['group']} positions" for model in in_passes) + ".", "",
                "tok/s: target tokens per second of a training step, the median of steady calls; ms/step: a training "
                "step's milliseconds; peak MB: torch.cuda.max_memory_allocated as with the model alone on the GPU; MB "
                "read/step: what a training step must read at least, forward and backward (weights once; a feedback "
                "model's loop weights at every step, with the memory's keys and values over the span for each layer, "
                "at the graphs' padded rows; in passes, at every pass); feedback / fairseq: the row's tok/s over fairseq's model's; "
                "ms at the bandwidth: that read at the card's memory bandwidth"
                + (f" ({sweep['bandwidth GB/s']:,.0f} GB/s)" if sweep["bandwidth GB/s"] else "") + ".", "", *lines, "",
                "Each at its fastest batch "
                + (f"within {budget / 1024:,.1f} GB" if budget else "(peak memory not measured: every batch counts)")
                + f": {fastest or 'none'}" + (f"; {ratios}." if ratios else ".")]
    for n, table in sweep["profiles"].items():
        kind = table["kind"]
        markdown += ["", f"Where a training step of {feedback} at {n} rows goes, {kind} by {kind}: "
                     f"{table['step ms']:.1f} ms, {table['per step']:.1f} {kind}s per target step, "
                     f"{table['share']:.0%} of the step in them.", "",
                     f"| {kind} | per target step | us per target step | share | shapes |", "|---|---:|---:|---:|---|",
                     *[f"| `{row[kind][:80]}` | {row['per step']:.1f} | {row['us per step']:,.1f} | "
                       f"{row['share']:.1%} | {row['shapes']} |" for row in table["rows"]]]
        if table["others"]["count"]:
            others = table["others"]
            markdown.append(f"| {others['count']} others | {others['per step']:.1f} | {others['us per step']:,.1f} | "
                            f"{others['share']:.1%} | |")
    outcome = Outcome(summary, sweep, markdown)
    gave_up = [f"{batch['rows']} rows, {model}: {batch['figures'][model]['graphs gave up']}"
               for batch in sweep["batches"] if "figures" in batch for model in (feedback, *in_passes)
               if batch["figures"][model]["graphs gave up"]
               and "out of memory" not in batch["figures"][model]["graphs gave up"]]
    if gave_up:  # running out of memory at a large batch is a finding; any other failure, a defect
        raise StepFailed(f"the graphs gave up at {'; '.join(gave_up)}", outcome)
    return outcome
