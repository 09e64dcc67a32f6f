"""Step 2: fairseq-train with graphs and without, in fp32 and fp16; the losses each logs must agree
to the tolerance. What fairseq-train's logs say (the losses, the graphs captured), read here,
step 4 reads too."""

import json
import re
from typing import Dict, List, Optional, Tuple

from .check import NOT_JUDGED, PLUGIN, Check, Command, Outcome, StepFailed, read
from .corpora import parallel_corpus
from .sizes import LOSS_TOLERANCE


def logged(log: str, stat: str = "loss") -> Dict[str, float]:
    """A figure of fairseq-train's JSON log, in the log's order: the loss at each log interval and
    each validation, or another figure of the log intervals (such as fp16's loss_scale)."""
    figures = {}
    for kind, record in re.findall(r"\b(train_inner|valid)(?: \| |:)(\{.*\})", log):  # as formatted, or by default
        stats = json.loads(record)
        if kind == "train_inner" and stat in stats:
            figures[f"update {stats['num_updates']}"] = float(stats[stat])
        elif kind == "valid" and stat == "loss":
            figures[f"validation {stats['epoch']}"] = float(stats["valid_loss"])
    return figures


def largest_difference(graphed: Dict[str, float], eager: Dict[str, float]) -> Tuple[float, str]:
    """The largest difference between two runs' losses, and where."""
    if not graphed or graphed.keys() != eager.keys():
        raise StepFailed(f"the runs with and without graphs logged different losses: {sorted(graphed)} against "
                         f"{sorted(eager)}")
    return max((abs(graphed[point] - eager[point]), point) for point in graphed)


def graphs_in(log: str) -> Tuple[int, Optional[str]]:
    """The graphs a run captured, and the line saying why its graphs gave up (None: they did not)."""
    gave_up = re.findall(r".*: CUDA graph.*running eagerly from now on.*", log)
    return len(re.findall(r"captured graph \d+", log)), (gave_up[0].split(" | ")[-1] if gave_up else None)


def no_shape_repeated(log: str) -> bool:
    """Whether every block of a run with graphs was a shape of its own (by
    the graph cache's lines: calls since the previous line, keys since the
    start), so that no graph could be captured: a shape is captured at its
    second sighting."""
    lines = re.findall(r"graph cache \| keys (\d+) \| calls (\d+) \|", log)
    return bool(lines) and sum(int(calls) for _, calls in lines) <= int(lines[-1][0])


def compare_training(graphed: str, eager: str, tolerance: float) -> Tuple[dict, List[str]]:
    """The figures of two fairseq-train logs, with graphs and without, and what is wrong with them: graphs
    that did not run, or ran where they were off; losses further apart than `tolerance`. In fp16, once
    the loss scalers part (an update whose gradients overflowed in one run and not in the other, skipped
    there alone), the runs part by chance: the losses are compared up to there."""
    captured, gave_up = graphs_in(graphed)
    losses = {"graphs": logged(graphed), "eager": logged(eager)}
    scales = {"graphs": logged(graphed, "loss_scale"), "eager": logged(eager, "loss_scale")}
    difference, where = largest_difference(losses["graphs"], losses["eager"])  # and that both logged the same
    parted = next((point for point, scale in scales["graphs"].items() if scales["eager"].get(point) != scale), None)
    compared = list(losses["graphs"])
    if parted is not None:
        compared = compared[:compared.index(parted)]
        if not compared:
            raise StepFailed(f"the loss scalers parted at {parted}, before a loss could be compared")
        difference, where = max((abs(losses["graphs"][point] - losses["eager"][point]), point) for point in compared)
    failures = []
    if gave_up:
        failures.append(f"the graphs gave up, so both runs were eager: {gave_up}")
    elif not captured:
        failures.append("no graph was captured")
    if graphs_in(eager)[0]:
        failures.append("--cuda-graphs off captured graphs")
    if difference > tolerance:
        failures.append(f"the losses with and without graphs differ by {difference:.3f} at {where} (graphs "
                        f"{losses['graphs'][where]:.3f}, eager {losses['eager'][where]:.3f}), more than the tolerance "
                        f"{tolerance:g}")
    return {"graphs captured": captured, "largest loss difference (bits/token)": difference, "at": where,
            "tolerance (bits/token)": tolerance, "points compared": len(compared), "loss scalers parted at": parted,
            "losses (bits/token)": losses}, failures


def training_comparison(check: Check) -> Outcome:
    """fairseq-train with graphs and without, in fp32 and fp16, the four side by side."""
    sizes = check.sizes["translation"]
    data = parallel_corpus(check, "translation", sizes["corpus"])
    updates = check.args.updates or sizes["updates"]
    common = [data, "--user-dir", PLUGIN, "--task", "translation", *sizes["model"], *sizes["batch"], "--optimizer",
              "adam", "--lr", "1e-3", "--max-update", updates, "--log-format", "json", "--log-interval",
              max(1, updates // 10), "--seed", 1, "--no-save", "--num-workers", 0]

    def command(precision, graphs):
        # a --save-dir each, even with --no-save: side by side, they must not share one (check.fairseq_save_dir)
        save_dir = check.path("work", "train", precision, graphs)
        return Command("fairseq_cli.train", [*common, "--cuda-graphs", graphs, "--save-dir", save_dir,
                                             *check.device_flags(precision)], f"train-{precision}-graphs-{graphs}.log")

    runs = {(precision, graphs): command(precision, graphs)
            for precision in LOSS_TOLERANCE for graphs in (check.graphs, "off")}
    check.run(*runs.values())
    unjudged = [precision for precision in LOSS_TOLERANCE
                if no_shape_repeated(read(check.path("logs", runs[precision, check.graphs].log)))]
    if unjudged:  # the graph path did not fail: it never ran
        return Outcome(f"not judged: no batch shape came twice in {updates} updates ({', '.join(unjudged)}), so no "
                       "graph could be captured (a shape is captured at its second sighting): pass more --updates",
                       status=NOT_JUDGED)
    figures, failures, rows = {}, [], []
    for precision in LOSS_TOLERANCE:
        graphed, eager = (read(check.path("logs", runs[precision, graphs].log)) for graphs in (check.graphs, "off"))
        figures[precision], wrong = compare_training(graphed, eager, check.tolerance(precision))
        failures += [f"{precision}: {failure}" for failure in wrong]
        found = figures[precision]
        losses, parted = found["losses (bits/token)"], found["loss scalers parted at"]
        last = [[point for point in losses["graphs"] if point.startswith(kind)][-1]
                for kind in ("update", "validation")]
        rows.append(f"| {precision} | {found['graphs captured']} | {found['points compared']}"
                    + (f", up to {parted}, where the loss scalers parted" if parted else "")
                    + f" | {found['largest loss difference (bits/token)']:.3f} | {found['at']} | "
                    f"{check.tolerance(precision):g} | "
                    + " | ".join(f"{losses['graphs'][point]:.3f} / {losses['eager'][point]:.3f}" for point in last)
                    + " |")
    model = " ".join(sizes["model"])
    outcome = Outcome(
        "largest loss difference with and without graphs: " + ", ".join(
            f"{figures[p]['largest loss difference (bits/token)']:.3f} ({p})" for p in figures) + " bits/token",
        figures,
        [f"On {check.machine['device']}, {updates} updates of `{model}`, `--cuda-graphs {check.graphs}` against "
         "`off` (the four runs side by side). Losses in bits per token, as fairseq logs them (3 decimals), at "
         "each log interval and each validation; in fp16, up to where the loss scalers part (an update skipped "
         "in one run alone), after which the runs part by chance.", "",
         "| precision | graphs captured | points compared | largest difference | at | tolerance "
         "| last train loss, graphs / eager | last valid loss, graphs / eager |",
         "|---|---:|---|---:|---|---:|---:|---:|", *rows])
    if failures:
        raise StepFailed("; ".join(failures), outcome)
    return outcome
