"""The figures of the demo and of the results page (fairseq_feedback_cli/curves.py): toy-task
accuracy against updates, a validation metric against updates and training hours, and a metric
against what a training step cost."""

import textwrap

from .outputs import atomic_file
from .toy.scoring import METRICS, best


def _pyplot():
    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq's import may leave the root at DEBUG
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def toy_accuracy(results, task, title=""):
    """The figure of token accuracy (solid) and episode accuracy (dashed) against updates, each model's
    best checkpoint (toy.scoring.best) starred on its token curve and labelled with its updates;
    results: {model: [feedback-evaluate-toy's results, by updates]}."""
    return toy_family({"": (results, task)}, title)


def toy_family(panels, title=""):
    """toy_accuracy's figure with a panel per task, one above the other (a family of Table 1's tasks, or of
    one task's settings, on one page); panels: {panel title: (results, task)}."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 4.5 if len(panels) == 1 else 3.4 * len(panels)),
                             squeeze=False)
    for ax, (name, (results, task)) in zip(axes[:, 0], panels.items()):
        _toy_panel(plt, ax, results, task)
        ax.set_title(name, fontsize=9)
    title = "\n".join(textwrap.fill(line, 95) for line in title.splitlines())
    if len(panels) == 1:
        axes[0, 0].set_title(title or next(iter(panels)), fontsize=9)
        fig.tight_layout()
    else:
        fig.suptitle(title, fontsize=10)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))  # room for the suptitle
    return fig


def _toy_panel(plt, ax, results, task):
    token_metric, line_metric = METRICS[task]
    models = []
    for (name, rs), color in zip(results.items(), colors(len(results))):
        updates = [r["updates"] for r in rs]
        models += ax.plot(updates, [100 * r[token_metric] for r in rs], "o-", color=color, label=name)
        ax.plot(updates, [100 * r[line_metric] for r in rs], "s--", color=color, alpha=0.6)
        top = best(task, rs)
        ax.plot([top["updates"]], [100 * top[token_metric]], "*", color=color, markersize=14, markeredgecolor="k")
        ax.annotate(str(top["updates"]), (top["updates"], 100 * top[token_metric]), textcoords="offset points",
                    xytext=(0, 9), ha="center", fontsize=8, color=color)
    # a legend entry per model, and one per line style: two entries per model hid the curves from 5 models on
    styles = [plt.Line2D([], [], color="gray", marker=marker, linestyle=style, label=metric)
              for marker, style, metric in (("o", "-", token_metric), ("s", "--", line_metric))]
    styles.append(plt.Line2D([], [], color="gray", marker="*", markersize=10, markeredgecolor="k", linestyle="",
                             label=f"best checkpoint ({token_metric}), its updates"))
    ax.set_xlabel("updates")
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(handles=models + styles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)


def colors(n):
    """n colours, the first four as the demo's figure has them, then tab10's others; from 11 on, tab20's
    lighter shades too (each n distinct up to 20, then cycled)."""
    first = ["tab:red", "tab:blue", "tab:green", "tab:gray"]
    others = ["tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]
    lighter = ["#ff9896", "#aec7e8", "#98df8a", "#c7c7c7", "#ffbb78", "#c5b0d5", "#c49c94", "#f7b6d2",
               "#dbdb8d", "#9edae5"]  # tab20's light shades, in the order above
    return [(first + others + lighter)[i % 20] for i in range(n)]


def validation_curves(runs, metric, title="", label=None, clock="wall"):
    """The figure of `metric` (named `label`) against updates and against training hours (of the wall
    clock, or of CPU time), one curve per run; runs: {name: [(updates, hours, value)]}. A perplexity goes
    on a log axis: on a linear one the first validations' hundreds flatten the late differences."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for name, points in runs.items():
        updates, hours, values = zip(*points)
        axes[0].plot(updates, values, "o-", markersize=3, label=name)
        axes[1].plot(hours, values, "o-", markersize=3, label=name)
    axes[0].set_xlabel("updates")
    axes[1].set_xlabel("training hours" + (" (CPU)" if clock == "cpu" else ""))
    axes[0].set_ylabel(label or metric)
    if metric.endswith("ppl"):
        axes[0].set_yscale("log")  # shared with the other axis
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def price(points, label, title=""):
    """The figure of a metric (named `label`) at the end of each run against
    what a training step cost: CPU seconds per update, and operators per
    position (feedback-benchmark's ops/step); points: {name: (seconds, operators, value)}."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), sharey=True)
    for (name, (seconds, operators, value)), color in zip(points.items(), colors(len(points))):
        for ax, x in zip(axes, (seconds, operators)):
            if x is not None:
                ax.plot([x], [value], "o", color=color, label=name)
                ax.annotate(name, (x, value), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axes[0].set_xlabel("CPU seconds per update")
    axes[1].set_xlabel("operators per position of a training step")
    axes[0].set_ylabel(label)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def save(fig, path, dpi=100):
    """Writes the figure as a PNG, complete or not at all, and frees it."""
    with atomic_file(path, "wb") as f:
        fig.savefig(f, dpi=dpi, format="png")
    _pyplot().close(fig)
