"""A tiny parallel corpus that a small model learns in minutes on a CPU.

Source sentences are random words; the target "translates" every word by a
fixed dictionary and reverses the word order, so a decoder has to attend over
the whole source and keep track of where it is. Deterministic for a seed.

    python -m fairseq_feedback_cli.data_prep.synthetic_translation --out DIR [--train 4000 ...]

writes DIR/{train,valid,test}.{src,tgt}, ready for fairseq-preprocess.
"""

import argparse
import os
import random

from fairseq_feedback_cli.command_line import ArgumentParser, check_at_least, command
from fairseq_feedback_cli.outputs import atomic_folder, check_destination


def sentence_pair(rng: random.Random, vocab: int, min_len: int, max_len: int):
    words = [rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))]
    return " ".join(f"s{w}" for w in words), " ".join(f"t{w}" for w in reversed(words))


def write_corpus(out: str, sizes: dict, vocab=24, min_len=3, max_len=12, seed=1) -> None:
    """Writes all splits; `out` appears complete or not at all."""
    with atomic_folder(out) as tmp:
        for split, count in sizes.items():
            rng = random.Random(f"{seed}/{split}")
            pairs = [sentence_pair(rng, vocab, min_len, max_len) for _ in range(count)]
            for side, index in (("src", 0), ("tgt", 1)):
                with open(tmp / f"{split}.{side}", "w") as f:
                    f.writelines(pair[index] + "\n" for pair in pairs)


@command
def main(argv=None):
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--valid", type=int, default=200)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=24)
    parser.add_argument("--max-len", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    check_destination(args.out, "--out", folder=True)  # a file there was kept, as a corpus
    if os.path.exists(args.out):
        parser.exit(0, f"{args.out} exists; keeping it\n")
    check_at_least(args, train=1, valid=1, test=1, vocab=1, max_len=3)
    write_corpus(args.out, {"train": args.train, "valid": args.valid, "test": args.test},
                 vocab=args.vocab, max_len=args.max_len, seed=args.seed)


if __name__ == "__main__":
    main()
