"""WikiText-103 for language modeling, as fairseq's examples/language_model.

Word level: the files are already tokenized with <unk> in place, so they go
to fairseq-preprocess --only-source as they are (one dictionary, from train).
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the data_prep package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fairseq_feedback_cli.data_prep.arguments import make_parser, resolve_dirs, run_cli
from fairseq_feedback_cli.data_prep.downloads import Archive, describe_sources, gather_inputs
from fairseq_feedback_cli.data_prep.steps import binarize, dest_is_done
from fairseq_feedback_cli.data_prep.text import count_lines, log_counts, read_lines

NAME = "wikitext103"
FILES = {split: f"wikitext-103/wiki.{split}.tokens" for split in ("train", "valid", "test")}
ARCHIVES = {
    "wikitext-103-v1.zip": Archive(
        "wikitext-103-v1.zip",
        # the original S3 bucket went away; its author now serves the same file
        ("https://wikitext.smerity.com/wikitext-103-v1.zip",
         "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip"),
        "md5:9ddaacaf6af0710eda8c456decff7832",
        tuple(FILES.values()),
    ),
}


def main(argv=None) -> None:
    args = make_parser(NAME, __doc__).parse_args(argv)
    resolve_dirs(args)
    archives = list(ARCHIVES.values())
    settings = {"dataset": NAME, "sources": describe_sources(archives, args.raw)}
    if dest_is_done(args.dest, settings):
        return
    files = gather_inputs(archives, args.raw, args.work)
    binarize(args.dest, settings,
             ["--only-source", "--trainpref", str(files[FILES["train"]]),
              "--validpref", str(files[FILES["valid"]]), "--testpref", str(files[FILES["test"]])],
             args.workers, work=args.work)
    log_counts(NAME, "lines", {split: count_lines(files[f]) for split, f in FILES.items()})
    # fairseq's count: every word and one end of line per line, as fairseq-eval-lm reports it
    log_counts(NAME, "tokens", {split: sum(len(line.split()) + 1 for line in read_lines(files[f]))
                                for split, f in FILES.items()})


if __name__ == "__main__":
    run_cli(main)
