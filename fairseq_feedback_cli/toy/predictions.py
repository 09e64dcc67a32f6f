"""A toy-task checkpoint's predictions, as feedback-evaluate-toy describes them (evaluate.py): the
split streamed through the task's batch iterator, the argmax label at every position, Table 1's
metrics (scoring.py). For feedback-evaluate-toy and the demo."""

import itertools
import os

import torch

from fairseq_feedback import checkpoint_files
from fairseq_feedback.safe_checkpoints import allow_fairseq_checkpoints

from ..command_line import fail
from ..outputs import atomic_file
from .scoring import METRICS, NO_LOSS, score

TASK = "feedback_language_modeling"


def load(path, data, tokens_per_sample=None):
    """(model, fairseq task, cfg, progress) of a checkpoint trained with --labels,
    its dictionaries read from `data`; progress: its updates and training seconds."""
    from fairseq import checkpoint_utils

    allow_fairseq_checkpoints()  # the classes fairseq stores in checkpoints, and no other
    if not os.path.exists(path):
        fail(f"checkpoint {path} not found: pass the .pt file fairseq-train wrote")
    if not os.path.isdir(data):
        fail(f"data directory {data} not found: pass the --destdir of fairseq-preprocess")
    overrides = {"data": data}
    if tokens_per_sample is not None:
        overrides["tokens_per_sample"] = tokens_per_sample
    checkpoint_files.read(path)  # a file that is no checkpoint, in one line; its tensors left on disk
    state = checkpoint_utils.load_checkpoint_to_cpu(path, arg_overrides=overrides)
    cfg = state.get("cfg")
    if cfg is None or cfg.get("task") is None:
        fail(f"{path} holds no fairseq training configuration")
    if cfg.task.get("_name") != TASK or not cfg.task.get("labels"):
        fail(f"{path} was not trained with --task {TASK} --labels: it does not predict "
                                 "toy-task labels")
    history = state.get("optimizer_history") or [{}]
    progress = {"updates": history[-1].get("num_updates"),
                # fairseq's cumulative wall time of training, over resumed runs too
                "train_seconds": (state.get("extra_state") or {}).get("previous_training_time")}
    (model,), cfg, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides=overrides,
                                                                         state=state)
    return model, task, cfg, progress


def predict(model, task, split, batch_size):
    """The argmax label at every position of `split`, one list per line (the
    end-of-line position left out), streamed block by block as in training."""
    from fairseq import utils

    if split not in task.datasets:
        task.load_dataset(split)
    dataset = task.dataset(split)
    itr = task.get_batch_iterator(dataset, max_sentences=batch_size,
                                  max_positions=utils.resolve_max_positions(task.max_positions(),
                                                                            model.max_positions()))
    device = next(model.parameters()).device
    streams = [[] for _ in range(batch_size)]  # row r: stream r's (source, prediction) blocks
    model.eval()
    with torch.no_grad():
        for sample in itr.next_epoch_itr(shuffle=False):
            net_input = utils.move_to_cuda(sample["net_input"]) if device.type == "cuda" else sample["net_input"]
            logits, _ = model(**net_input)
            best = logits.argmax(-1).cpu()
            source = sample["net_input"]["src_tokens"]
            for r, n in enumerate(sample["net_input"]["src_lengths"].tolist()):
                if n:
                    streams[r].append((source[r, :n], best[r, :n]))
    sources = torch.cat([s for stream in streams for s, _ in stream])
    predictions = torch.cat([p for stream in streams for _, p in stream]).tolist()
    # the streams hold the split's lines in order, each exactly once
    if not torch.equal(sources, torch.cat([dataset.tokens[i] for i in range(len(dataset))])):
        raise RuntimeError(f"the batches of split '{split}' do not hold its tokens in order")
    symbols = task.target_dictionary.symbols
    lines, start = [], 0
    for size in dataset.sizes.tolist():
        lines.append([symbols[i] for i in predictions[start: start + size - 1]])  # the last is eos
        start += size
    return lines


def binarized_labels(task, split):
    """The split's labels as the model was trained on them, `_` for no loss."""
    dataset, symbols = task.dataset(split), task.target_dictionary.symbols
    ignore = task.args.ignore_label
    return [[NO_LOSS if symbols[i] == ignore else symbols[i] for i in dataset.labels[n][:-1].tolist()]
            for n in range(len(dataset))]


def check_labels_of_split(labels, task, split, raw, data):
    """The lines of a raw labels file are those of the split's binarized
    labels (where those know the label): a labels file of another split of
    the same shape would score the predictions against the wrong answers."""
    binarized = binarized_labels(task, split)
    unknown, ignore = task.target_dictionary.unk_word, task.args.ignore_label

    def same(raw_label, label):
        return label in (raw_label, unknown) or (label == NO_LOSS and raw_label == ignore)

    for n, (line, known) in enumerate(itertools.zip_longest(labels, binarized), start=1):
        if line is None or known is None:
            where = f"it has {len(labels)} lines, the split {len(binarized)}"
        elif len(line) != len(known) or not all(map(same, line, known)):
            where = f"line {n} differs"
        else:
            continue
        fail(f"{raw} does not match the {split} split of {data} ({where}): pass the {split} split's labels file "
             f"(the generator's {split}.labels)")


def read_labels(path, what="labels file"):
    try:
        with open(path) as f:
            return [line.split() for line in f]
    except OSError as e:
        fail(f"{what} {path} cannot be read: {e.strerror}")


def write_lines(path, lines):
    """Writes token lines to `path`; the file appears complete or not at all."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        fail(f"folder {folder} for the predictions does not exist")
    with atomic_file(path) as f:
        for line in lines:
            f.write(" ".join(line) + "\n")


def default_output(path, split):
    return f"{path[:-3] if path.endswith('.pt') else path}.{split}.predictions"


def score_files(task, labels_path, predictions_path):
    """Table-1 metrics of a predictions file against a labels file, with the
    lines and scored positions counted."""
    if task not in METRICS:
        fail(f"unknown task {task!r}: one of {', '.join(sorted(METRICS))}")
    labels, predicted = read_labels(labels_path), read_labels(predictions_path, "predictions file")
    try:
        metrics = score(task, labels, predicted)
    except ValueError as e:
        fail(f"{predictions_path} does not match {labels_path}: {e}")
    scored = sum(l != NO_LOSS for line in labels for l in line)
    return {**metrics, "task": task, "lines": len(predicted), "scored": scored, "predictions": predictions_path}


def evaluate(task, data, path, split="test", raw=None, output=None, batch_size=None, tokens_per_sample=None,
             cpu=False):
    """Evaluates a checkpoint on a split; writes its predictions and returns the
    metrics, with the checkpoint's update count and training time, lines,
    scored positions and the predictions path."""
    if task not in METRICS:
        fail(f"unknown task {task!r}: one of {', '.join(sorted(METRICS))}")
    labels = read_labels(raw) if raw else None  # before the model: a bad path fails fast
    model, fs_task, cfg, progress = load(path, data, tokens_per_sample)
    if torch.cuda.is_available() and not cpu:
        model.cuda()
    fs_task.load_dataset(split)
    # a stream starts at an episode: more streams than episodes would only add empty ones
    rows = min(batch_size or cfg.dataset.batch_size_valid or cfg.dataset.batch_size or 1, len(fs_task.dataset(split)))
    if labels is not None:
        check_labels_of_split(labels, fs_task, split, raw, data)
    predicted = predict(model, fs_task, split, int(rows))
    if labels is None:
        labels = binarized_labels(fs_task, split)
        against = f"{split} labels in {data}"
    else:
        against = raw
    try:
        metrics = score(task, labels, predicted)
    except ValueError as e:
        fail(f"{against} does not match the {split} split of {data}: {e}")
    output = output or default_output(path, split)
    write_lines(output, predicted)
    scored = sum(l != NO_LOSS for line in labels for l in line)
    return {**metrics, "task": task, "split": split, "checkpoint": path, **progress,
            "lines": len(predicted), "scored": scored, "predictions": output}
