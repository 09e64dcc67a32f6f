"""Table-1 accuracy of a toy-task checkpoint (Fan et al. 2020, Table 1).

    feedback-evaluate-toy --task random_walk --data DATA --path CKPT \\
        [--split test] [--raw RAW/test.labels] [--output PRED] [--batch-size N] [--json]
    feedback-evaluate-toy --task random_walk --predictions PRED --raw RAW/test.labels

(or `python -m fairseq_feedback_cli.evaluate_toy`, without installing the package).

DATA is the data directory the model was trained on (fairseq-preprocess
--only-source of the inputs, with the labels binarized into DATA/labels, or the
folder the checkpoint's --labels names). The split is streamed through the
feedback_language_modeling task's batch iterator exactly as training and
validation stream it (lines dealt into --batch-size contiguous streams, cut
into blocks of --tokens-per-sample, the memory carried from block to block),
the model's argmax label is taken at every input position, and the
predictions are written one line per episode, aligned token for token with the
split's labels (the end-of-line position carries no label and gets none).
The predictions file (by default CKPT without .pt, then .SPLIT.predictions)
appears complete or not at all.

The metrics are data_prep.toy_tasks.score's: token accuracy over the labelled
positions (`_` carries no label) and the share of episodes whose labelled
positions are all right: char/seq accuracy for copy, reverse and counting,
acc/episode_acc for random_walk and algorithmic. They are scored against the
raw labels file when --raw is given (what the generator wrote), else against
the binarized labels of the split. With --predictions instead of a
checkpoint, an existing predictions file is scored against --raw.
"""

import json
import os

import torch

from data_prep.toy_tasks import METRICS, NO_LOSS, score
from fairseq_feedback.errors import one_line
from fairseq_feedback.safe_checkpoints import allow_fairseq_checkpoints

from .command_line import ArgumentParser, check_at_least, fail
from .outputs import atomic_file

TASK = "feedback_language_modeling"


def build_parser():
    parser = ArgumentParser(prog="feedback-evaluate-toy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", required=True, choices=sorted(METRICS), help="the toy task (picks the metrics)")
    parser.add_argument("--data", help="the binarized data directory the model was trained on")
    parser.add_argument("--path", help="the checkpoint")
    parser.add_argument("--predictions", help="score this predictions file against --raw (no checkpoint)")
    parser.add_argument("--split", default="test", help="the split to evaluate (default: test)")
    parser.add_argument("--raw", help="the split's raw labels file, to score against (e.g. RAW/test.labels)")
    parser.add_argument("--output", help="where to write the predictions (default: CKPT without .pt, "
                                         "then .SPLIT.predictions)")
    parser.add_argument("--batch-size", type=int, help="streams per batch (default: the checkpoint's "
                                                       "validation batch size)")
    parser.add_argument("--tokens-per-sample", type=int, help="block length (default: the checkpoint's)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is available")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return parser


def load(path, data, tokens_per_sample=None):
    """(model, fairseq task, cfg, progress) of a checkpoint trained with --labels,
    its dictionaries read from `data`; progress: its updates and training seconds."""
    from fairseq import checkpoint_utils

    allow_fairseq_checkpoints()  # the classes fairseq stores in checkpoints, and no other
    if not os.path.isfile(path):
        fail(f"checkpoint {path} not found: pass the .pt file fairseq-train wrote")
    if not os.path.isdir(data):
        fail(f"data directory {data} not found: pass the --destdir of fairseq-preprocess")
    overrides = {"data": data}
    if tokens_per_sample is not None:
        overrides["tokens_per_sample"] = tokens_per_sample
    try:
        state = checkpoint_utils.load_checkpoint_to_cpu(path, arg_overrides=overrides)
    except Exception as e:  # not a checkpoint at all (pickle, zip or torch's weights-only refusal)
        first = str(e).split(". ")[0].splitlines()[0] if str(e).strip() else ""
        fail(f"{path} is not a readable fairseq checkpoint ({type(e).__name__}: {first})")
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
    rows = batch_size or cfg.dataset.batch_size_valid or cfg.dataset.batch_size or 1
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


def describe(result):
    names = METRICS[result["task"]]
    metrics = "  ".join(f"{name} {100 * result[name]:.2f}" for name in names)
    counts = f"[{result['lines']} lines, {result['scored']} scored positions]"
    if "checkpoint" not in result:
        return f"{result['task']} {result['predictions']}: {metrics}  {counts}"
    updates = "" if result["updates"] is None else f", {result['updates']} updates"
    return (f"{result['task']} {result['split']} ({os.path.basename(result['checkpoint'])}{updates}): {metrics}"
            f"  {counts} -> {result['predictions']}")


def quiet():
    """Only warnings and errors from fairseq's loggers and Python's warnings: the result is one line."""
    import logging
    import warnings

    logging.getLogger().setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.predictions:
        if args.path or not args.raw:
            parser.error("--predictions scores a file against --raw: pass --raw, and no --path")
    elif not (args.data and args.path):
        parser.error("pass --data and --path (a checkpoint), or --predictions and --raw")
    check_at_least(args, batch_size=1, tokens_per_sample=1)
    quiet()
    try:
        if args.predictions:
            result = score_files(args.task, args.raw, args.predictions)
        else:
            result = evaluate(args.task, args.data, args.path, split=args.split, raw=args.raw, output=args.output,
                              batch_size=args.batch_size, tokens_per_sample=args.tokens_per_sample, cpu=args.cpu)
    except Exception as e:  # a mistake the plugin names is one line; anything else keeps its traceback
        line = one_line(e)
        if line is None:
            raise
        fail(line)
    print(json.dumps(result) if args.json else describe(result))
    return result


def cli():
    """feedback-evaluate-toy: main() without its result, which a console script would take for the exit status."""
    main()


if __name__ == "__main__":
    main()
