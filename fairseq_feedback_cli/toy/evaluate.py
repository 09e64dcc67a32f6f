"""Table-1 accuracy of a toy-task checkpoint (Fan et al. 2020, Table 1).

    feedback-evaluate-toy --task random_walk --data DATA --path CKPT \\
        [--split test] [--raw RAW/test.labels] [--output PRED] [--batch-size N] [--json]
    feedback-evaluate-toy --task random_walk --predictions PRED --raw RAW/test.labels

(or `python -m fairseq_feedback_cli.toy.evaluate`, without installing the package).

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

The metrics are scoring.score's: token accuracy over the labelled
positions (`_` carries no label) and the share of episodes whose labelled
positions are all right: char/seq accuracy for copy, reverse and counting,
acc/episode_acc for random_walk and algorithmic. They are scored against the
raw labels file when --raw is given (what the generator wrote), else against
the binarized labels of the split. With --predictions instead of a
checkpoint, an existing predictions file is scored against --raw.
"""

import json
import os

from fairseq_feedback.fairseq_fixes.one_line import one_line

from ..command_line import ArgumentParser, check_at_least, command, fail, quiet
from ..machine import check_within, in_memory
from ..outputs import check_destination
from .predictions import default_output, evaluate, score_files
from .scoring import METRICS


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


def describe(result):
    names = METRICS[result["task"]]
    metrics = "  ".join(f"{name} {100 * result[name]:.2f}" for name in names)
    counts = f"[{result['lines']} lines, {result['scored']} scored positions]"
    if "checkpoint" not in result:
        return f"{result['task']} {result['predictions']}: {metrics}  {counts}"
    updates = "" if result["updates"] is None else f", {result['updates']} updates"
    return (f"{result['task']} {result['split']} ({os.path.basename(result['checkpoint'])}{updates}): {metrics}"
            f"  {counts} -> {result['predictions']}")


@command
def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.predictions:
        if args.path or not args.raw:
            parser.error("--predictions scores a file against --raw: pass --raw, and no --path")
    elif not (args.data and args.path):
        parser.error("pass --data and --path (a checkpoint), or --predictions and --raw")
    check_at_least(args, batch_size=1, tokens_per_sample=1)
    # each stream takes at least 100 bytes as the task lays the split out (its bounds, length, list of blocks)
    check_within(args, batch_size=in_memory(100, "the streams that fit"))
    if not args.predictions:
        check_destination(args.output or default_output(args.path, args.split), "--output",
                          reads={"--path": args.path, "--raw": args.raw, "--data": args.data})
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
