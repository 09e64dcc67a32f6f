"""How far a language model's numbers in passes are from its exact ones (docs/passes.md).

    python -m fairseq_feedback_cli.passes_gap --data DATA --path CKPT --passes 16x4,16x8,64x4 \\
        [--gen-subset valid] [--batch-size 16] [--tokens-per-sample 128] [--max-blocks 6]

A model trained in passes is evaluated exactly, and only that number counts
(fairseq-eval-lm, the validation of fairseq-train). This measures something
else: for the same weights, the loss of the split computed in passes (each
setting GxK: groups of G positions, K passes) beside the exact loss, so that
one sees how far a model fits its passes, or how many passes an exactly
trained model needs. The split is streamed as fairseq-eval-lm streams it
(--batch-size streams, blocks of --tokens-per-sample, the memory carried),
its first --max-blocks blocks (0: all); losses in bits per token, as
fairseq's base-2 loss.
"""

import json

import torch
import torch.nn.functional as F

from fairseq_feedback import checkpoint_files
from fairseq_feedback.loop.passes import Passes
from fairseq_feedback.safe_checkpoints import allow_fairseq_checkpoints

from .command_line import ArgumentParser, check_at_least, command, fail, quiet


def settings(text: str):
    """--passes 16x4,64x4: (G, K) pairs, 1 <= K <= G."""
    pairs = []
    for setting in text.split(","):
        group, _, passes = setting.partition("x")
        if not (group.isdigit() and passes.isdigit() and 1 <= int(passes) <= int(group)):
            fail(f"--passes {text}: each setting is GxK, G positions a group and K passes, 1 <= K <= G, as in 16x4")
        pairs.append((int(group), int(passes)))
    return pairs


def load(path, data, overrides):
    """(model, task) of a feedback_lm checkpoint, its dictionaries read from `data`."""
    from fairseq import checkpoint_utils

    allow_fairseq_checkpoints()  # the classes fairseq stores in checkpoints, and no other
    checkpoint_files.read(path)  # a file that is no checkpoint, in one line
    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides={"data": data, **overrides})
    if not hasattr(model.decoder, "train_in_passes"):
        fail(f"{path} is not a feedback model (--no-feedback computes its blocks at once): nothing runs in passes")
    return model, task


def bits_per_token(model, task, split: str, streams: int, max_blocks: int, passes=None) -> float:
    """The split's loss in bits per token, streamed block by block, exactly
    (passes None) or in `passes`."""
    model.decoder.train_in_passes(passes, in_evaluation=True)
    itr = task.get_batch_iterator(task.dataset(split), max_sentences=streams).next_epoch_itr(shuffle=False)
    loss, tokens = 0.0, 0
    model.eval()
    with torch.no_grad():
        for block, sample in enumerate(itr):
            if max_blocks and block == max_blocks:
                break
            lprobs = model.get_normalized_probs(model(**sample["net_input"]), log_probs=True)
            target = sample["target"]
            loss += F.nll_loss(lprobs.flatten(0, 1).float(), target.flatten(), ignore_index=task.dictionary.pad(),
                               reduction="sum").item()
            tokens += int(target.ne(task.dictionary.pad()).sum())
    model.decoder.train_in_passes(None)
    return loss / tokens / torch.log(torch.tensor(2.0)).item()


@command
def main(argv=None):
    parser = ArgumentParser(prog="python -m fairseq_feedback_cli.passes_gap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="the binarized data directory the model was trained on")
    parser.add_argument("--path", required=True, help="a feedback_lm checkpoint")
    parser.add_argument("--passes", required=True, help="settings GxK, comma-separated, as in 16x4,64x4")
    parser.add_argument("--gen-subset", default="valid", help="the split (default: valid)")
    parser.add_argument("--batch-size", type=int, default=16, help="streams (default: 16)")
    parser.add_argument("--tokens-per-sample", type=int, help="block length (default: the checkpoint's)")
    parser.add_argument("--max-blocks", type=int, default=0, help="the first N blocks of the streams (0: all)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    check_at_least(args, batch_size=1, tokens_per_sample=1, max_blocks=0)
    pairs = settings(args.passes)
    quiet()  # the result is the table
    torch.manual_seed(1)  # a model's dropout, were any on in evaluation, draws the same masks each run
    model, task = load(args.path, args.data, {} if args.tokens_per_sample is None
                       else {"tokens_per_sample": args.tokens_per_sample})
    task.load_dataset(args.gen_subset)
    exact = bits_per_token(model, task, args.gen_subset, args.batch_size, args.max_blocks)
    rows = {f"{g}x{k}": bits_per_token(model, task, args.gen_subset, args.batch_size, args.max_blocks, Passes(k, g))
            for g, k in pairs}
    if args.json:
        print(json.dumps({"path": args.path, "split": args.gen_subset, "exact": exact, "passes": rows}))
        return
    print(f"{args.path}, {args.gen_subset}: bits per token, exactly and in passes (GxK)")
    print(f"| setting | bits per token | minus exact |\n| --- | ---: | ---: |\n| exact | {exact:.4f} | |")
    for name, value in rows.items():
        print(f"| {name} | {value:.4f} | {value - exact:+.4f} |")


if __name__ == "__main__":
    main()
