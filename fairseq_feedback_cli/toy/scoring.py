"""Table 1's metrics of the toy tasks (Fan et al. 2020), as the generator writes the labels
(fairseq_feedback_cli/data_prep/toy_tasks.py) and feedback-evaluate-toy, the demo and the
learning curves score them. Imports nothing else of this project: the tools and the data script
share it."""

NO_LOSS = "_"  # the label of a position the model is not asked about

# Table 1 reports char / seq accuracy for the first three, plain accuracy for the others
METRICS = {
    "copy": ("char_acc", "seq_acc"),
    "reverse": ("char_acc", "seq_acc"),
    "counting": ("char_acc", "seq_acc"),
    "random_walk": ("acc", "episode_acc"),
    "algorithmic": ("acc", "episode_acc"),
}


def score(task, labels_lines, predicted_lines):
    """Table-1 metrics from aligned label and prediction lines (strings or token lists).

    Token accuracy counts every labelled position; a line counts as solved when all
    its labelled positions are right. Positions labelled `_` are skipped, and so
    are lines without any labelled position.
    """
    if task not in METRICS:
        raise ValueError(f"unknown task {task!r}")
    labels_lines, predicted_lines = list(labels_lines), list(predicted_lines)
    if len(labels_lines) != len(predicted_lines):
        raise ValueError(f"{len(labels_lines)} label lines but {len(predicted_lines)} predicted")
    hits = total = solved = lines = 0
    for n, (labels, predicted) in enumerate(zip(labels_lines, predicted_lines), 1):
        labels = labels.split() if isinstance(labels, str) else labels
        predicted = predicted.split() if isinstance(predicted, str) else predicted
        if len(labels) != len(predicted):
            raise ValueError(f"line {n}: {len(labels)} labels but {len(predicted)} predictions")
        checked = [l == p for l, p in zip(labels, predicted) if l != NO_LOSS]
        if checked:
            hits += sum(checked)
            total += len(checked)
            solved += all(checked)
            lines += 1
    if not total:
        raise ValueError("no labelled positions to score")
    token_key, line_key = METRICS[task]
    return {token_key: hits / total, line_key: solved / lines}


def best(task, results):
    """The best of one model's evaluations (dicts of score's metrics and "updates"): the most tokens
    right, then the most lines, then the earliest. Tokens first: they are Table 1's number for the
    last two tasks, and they tell apart the checkpoints of a model that solves a line by chance (the
    demo's transformer: 2 or 3 episodes of 500)."""
    token_key, line_key = METRICS[task]
    return max(results, key=lambda r: (r[token_key], r[line_key], -r["updates"]))
