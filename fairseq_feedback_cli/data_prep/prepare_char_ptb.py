"""Character-level Penn Treebank (char-PTB), as the field uses it.

The ptb.char.{train,valid,test}.txt files of Mikolov's simple-examples.tgz:
the word-level PTB text rewritten one character per token, `_` between
words, a sentence per line (AWD-LSTM's and Transformer-XL's pennchar data).
Binarized as they are (fairseq-preprocess --only-source, the end of a line
a token, as those recipes count it), with a dictionary of every symbol of
the three files (data_prep/characters.py). The split sizes are checked
against the published ones: the lines exactly, the characters to the
precision they were published with.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the data_prep package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fairseq_feedback_cli.command_line import fail
from fairseq_feedback_cli.data_prep.arguments import make_parser, resolve_dirs, run_cli
from fairseq_feedback_cli.data_prep.characters import binarize_characters, symbol_dictionary, write_dictionary
from fairseq_feedback_cli.data_prep.downloads import Archive, describe_sources, gather_inputs
from fairseq_feedback_cli.data_prep.steps import dest_is_done, step
from fairseq_feedback_cli.data_prep.text import count_lines, log_counts, read_lines

NAME = "char_ptb"
FILES = {split: f"simple-examples/data/ptb.char.{split}.txt" for split in ("train", "valid", "test")}
ARCHIVES = {
    "simple-examples.tgz": Archive(
        "simple-examples.tgz",
        ("http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz",),
        "md5:30177ea32e27c525793142b6bf2c8e2d",
        tuple(FILES.values()),
    ),
}
# Lines: the sentences of the word-level files. Tokens (characters and ends of line): Merity et al.
# (2018), "An Analysis of Neural Language Modeling at Multiple Scales", Table 1: 5.01M, 393k, 442k.
PUBLISHED = {"lines": {"train": 42_068, "valid": 3_370, "test": 3_761},
             "tokens": {"train": (5_010_000, 10_000), "valid": (393_000, 1_000), "test": (442_000, 1_000)}}


def check_published(lines: dict, tokens: dict) -> None:
    """The splits' sizes, against the published ones (a count given to N digits: within one of the last)."""
    for split, n in lines.items():
        if n != PUBLISHED["lines"][split]:
            fail(f"{FILES[split]} has {n:,} lines, not the published {PUBLISHED['lines'][split]:,}: "
                 "is it the file of simple-examples.tgz?")
    for split, n in tokens.items():
        published, last_digit = PUBLISHED["tokens"][split]
        if abs(n - published) > last_digit:
            fail(f"{FILES[split]} has {n:,} characters and ends of line, not about the published {published:,}: "
                 "is it the file of simple-examples.tgz?")


def main(argv=None) -> None:
    args = make_parser(NAME, __doc__).parse_args(argv)
    resolve_dirs(args)
    archives = list(ARCHIVES.values())
    settings = {"dataset": NAME, "unit": "character", "sources": describe_sources(archives, args.raw)}
    if dest_is_done(args.dest, settings):
        return
    files = gather_inputs(archives, args.raw, args.work)
    texts = {split: files[f] for split, f in FILES.items()}
    lines = {split: count_lines(path) for split, path in texts.items()}
    tokens = {split: sum(len(line.split()) + 1 for line in read_lines(path)) for split, path in texts.items()}
    check_published(lines, tokens)
    dictionary = step(args.work / "dictionary", lambda out: write_dictionary(symbol_dictionary(texts), out / "dict.txt"),
                      settings)
    binarize_characters(args.dest, settings, texts, dictionary / "dict.txt", args.workers, tokens)
    log_counts(NAME, "lines", lines)
    log_counts(NAME, "characters and ends of line", tokens)


if __name__ == "__main__":
    run_cli(main)
