"""IWSLT'14 German-English (TED talks) as fairseq's examples/translation/prepare-iwslt14.sh.

The talks' metadata lines dropped from train (the text of <title> and
<description> kept), Moses tokenization, clean-corpus-n (ratio 1.5, 1-175
tokens), lowercase; valid = every 23rd pair of the cleaned train, test =
dev2010 + TEDX dev2012 + tst2010-2012; joint BPE (10000 merges) learnt on
train de+en.
"""

import contextlib
import re
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the data_prep package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fairseq_feedback_cli.data_prep.arguments import resolve_dirs, run_cli
from fairseq_feedback_cli.data_prep.downloads import Archive, describe_sources, gather_inputs
from fairseq_feedback_cli.data_prep.text import clean_corpus, parallel_segments, read_lines, tokenize, write_lines
from fairseq_feedback_cli.data_prep.translation import Corpus, JointBPE, prepare_translation, translation_parser

NAME = "iwslt14_de_en"
LANGS = ("de", "en")
TEST_SETS = ("IWSLT14.TED.dev2010", "IWSLT14.TEDX.dev2012", "IWSLT14.TED.tst2010",
             "IWSLT14.TED.tst2011", "IWSLT14.TED.tst2012")
TRAIN = {lang: f"de-en/train.tags.de-en.{lang}" for lang in LANGS}
# The train files interleave each talk's metadata with its transcript. Lines
# holding one of these tags are dropped, as fairseq's IWSLT'17 script does;
# its IWSLT'14 script drops only the first three and so keeps the <speaker>,
# <reviewer> and <translator> lines as sentence pairs. <title> and
# <description> lines lose their tags and keep their text, as in both.
METADATA = ("<url>", "<talkid>", "<keywords>", "<speaker>", "<reviewer", "<translator", "<doc", "</doc>")
TITLE_TAGS = re.compile(r"</?(title|description)>")
TEST = {lang: [f"de-en/{s}.de-en.{lang}.xml" for s in TEST_SETS] for lang in LANGS}

ARCHIVES = {
    "de-en.tgz": Archive(
        "de-en.tgz",
        # the WIT3 original is gone; fairseq's recipe now points at its own copy
        ("http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz",
         "https://wit3.fbk.eu/archive/2014-01/texts/de/en/de-en.tgz"),
        "md5:10936dfdf616504ddbd844e91b94ef4a",
        tuple(TRAIN.values()) + tuple(TEST["de"]) + tuple(TEST["en"]),
    ),
}


def transcript(lines):
    for line in lines:
        if not any(tag in line for tag in METADATA):
            yield TITLE_TAGS.sub("", line)


def make_text(out: Path, inputs: dict, workers: int) -> None:
    tests = parallel_segments({lang: [inputs[f] for f in TEST[lang]] for lang in LANGS})
    for lang in LANGS:
        lines = transcript(read_lines(inputs[TRAIN[lang]]))
        write_lines(out / f"train.tags.{lang}", tokenize(lines, workers, f"train.{lang}", lang=lang))
        write_lines(out / f"test.{lang}", tokenize(tests[lang], workers, f"test.{lang}", lang=lang, quote=True,
                                                   lower=True))

    pairs = clean_corpus(out / "train.tags.de", out / "train.tags.en", 1, 175, 1.5)
    with contextlib.ExitStack() as files_open:
        outs = {(split, lang): files_open.enter_context(open(out / f"{split}.{lang}", "w", encoding="utf-8"))
                for split in ("train", "valid") for lang in LANGS}
        for i, pair in enumerate(pairs, 1):
            split = "valid" if i % 23 == 0 else "train"
            for lang, line in zip(LANGS, pair):
                outs[split, lang].write(line.lower() + "\n")
    for lang in LANGS:
        (out / f"train.tags.{lang}").unlink()


def main(argv=None) -> None:
    args = translation_parser(NAME, __doc__, default_merges=10000).parse_args(argv)
    resolve_dirs(args)
    archives = list(ARCHIVES.values())
    prepare_translation(args, Corpus(
        NAME, LANGS, {"dataset": NAME, "sources": describe_sources(archives, args.raw)},
        inputs=lambda: gather_inputs(archives, args.raw, args.work), make_text=make_text,
        subwords=JointBPE(args.bpe_merges)))


if __name__ == "__main__":
    run_cli(main)
