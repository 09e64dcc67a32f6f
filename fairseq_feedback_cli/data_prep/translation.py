"""The one pipeline of the parallel corpora (translation, and summarization as translation):
raw files -> text -> subwords -> fairseq-preprocess with one joined dictionary.

A script describes its corpus (a Corpus: what it is made from, how its text is made, which
subwords) and prepare_translation does the rest: each step once, into the work folder, with a
done marker naming what it was made from (steps.py), and the dest stamped with the settings.
"""

import argparse
import functools
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

from ..command_line import fail
from .arguments import log, make_parser
from .steps import binarize, dest_is_done, step
from .text import apply_bpe, check_text, clean_corpus, count_lines, learn_bpe, log_counts, read_lines

SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class JointBPE:
    """subword-nmt BPE learnt on the training text of both sides, applied to every split, as
    fairseq's recipes; `clean` = (min, max, ratio): clean-corpus-n on the training pairs after BPE,
    so that the length limits count subwords (fairseq's WMT'14 recipe)."""

    merges: int
    clean: Optional[Tuple[int, int, float]] = None
    folder = "bpe"
    model = "code"

    def settings(self) -> dict:
        return {"bpe_merges": self.merges}

    def make(self, out: Path, text: Path, langs: Sequence[str], workers: int) -> None:
        learn_bpe([text / f"train.{lang}" for lang in langs], out / self.model, self.merges, workers)
        for split in SPLITS:
            for lang in langs:
                name = f"bpe.{split}.{lang}" if split == "train" and self.clean else f"{split}.{lang}"
                apply_bpe(out / self.model, text / f"{split}.{lang}", out / name, workers)
        if self.clean:
            src, tgt = langs
            with open(out / f"train.{src}", "w", encoding="utf-8") as fs, \
                    open(out / f"train.{tgt}", "w", encoding="utf-8") as ft:
                for s, t in clean_corpus(out / f"bpe.train.{src}", out / f"bpe.train.{tgt}", *self.clean):
                    fs.write(s + "\n")
                    ft.write(t + "\n")
            for lang in langs:
                (out / f"bpe.train.{lang}").unlink()


@dataclass(frozen=True)
class SentencePiece:
    """A joint sentencepiece BPE model of `vocab_size` pieces learnt on the training text of both
    sides, applied to every split."""

    vocab_size: int
    folder = "spm"
    model = "sentencepiece.bpe.model"

    def settings(self) -> dict:
        return {"vocab_size": self.vocab_size}

    def make(self, out: Path, text: Path, langs: Sequence[str], workers: int) -> None:
        import sentencepiece as spm

        log(f"training a {self.vocab_size} piece sentencepiece BPE model ...")
        with open(out / "spm_train.log", "w") as logfile:
            try:
                spm.SentencePieceTrainer.train(
                    input=",".join(str(text / f"train.{lang}") for lang in langs),
                    model_prefix=str(out / self.model.rsplit(".", 1)[0]), model_type="bpe",
                    vocab_size=self.vocab_size, num_threads=workers, input_sentence_size=1_000_000,
                    shuffle_input_sentence=True, max_sentence_length=1 << 16,
                    hard_vocab_limit=False,  # a soft limit, so small corpora (tests) work too
                    logstream=logfile)
            except RuntimeError as e:  # e.g. fewer pieces than the text has characters; its words follow a "] "
                fail(f"sentencepiece cannot learn {self.vocab_size} pieces of {text}/train.*: "
                     f"{str(e).rpartition('] ')[2].strip()} (--vocab-size)")
        sp = spm.SentencePieceProcessor(model_file=str(out / self.model))
        for split in SPLITS:
            for lang in langs:
                lines = read_lines(text / f"{split}.{lang}")
                with open(out / f"{split}.{lang}", "w", encoding="utf-8") as f:
                    while batch := list(itertools.islice(lines, 10000)):
                        for pieces in sp.encode(batch, out_type=str, num_threads=workers):
                            f.write(" ".join(pieces) + "\n")


@dataclass
class Corpus:
    """A parallel corpus, as its script describes it."""

    name: str
    langs: Tuple[str, str]  # the source side, then the target side
    made_from: dict  # the options that shape the text, and what it is made from (the done markers' record)
    inputs: Callable[[], object]  # the raw files, found (downloaded, extracted) once the dest is known to be old
    make_text: Callable[..., None]  # make_text(out, inputs, workers) writes {train,valid,test}.{lang} into out
    subwords: object  # JointBPE or SentencePiece
    keep: Sequence[str] = ()  # files the text step writes that go beside the binarized data
    after_text: Callable[[Path], None] = lambda text: None  # checks or reports the text made
    report: Optional[Callable[[Path], None]] = None  # what was made; default: the pairs of each split, logged
    what: str = "sentence pairs"


def translation_parser(name: str, description: str, default_merges: int) -> argparse.ArgumentParser:
    parser = make_parser(name, description)
    parser.add_argument("--bpe-merges", type=int, default=default_merges,
                        help="joint BPE merges (default: %(default)s)")
    return parser


def prepare_translation(args: argparse.Namespace, corpus: Corpus) -> None:
    """`args` resolved (arguments.resolve_dirs)."""
    settings = {**corpus.made_from, **corpus.subwords.settings()}
    if dest_is_done(args.dest, settings):
        return
    inputs = corpus.inputs()
    text = step(args.work / "text", functools.partial(corpus.make_text, inputs=inputs, workers=args.workers),
                corpus.made_from)
    corpus.after_text(text)
    for split in SPLITS:  # before the subwords: subword-nmt fails on an empty train split with a traceback
        for lang in corpus.langs:
            check_text(text / f"{split}.{lang}", f"check the raw files it is made from ({corpus.name})")
    subwords = step(args.work / corpus.subwords.folder,
                    functools.partial(corpus.subwords.make, text=text, langs=corpus.langs, workers=args.workers),
                    settings)
    source, target = corpus.langs
    binarize(args.dest, settings,
             ["--source-lang", source, "--target-lang", target, "--joined-dictionary",
              *(arg for split in SPLITS for arg in (f"--{split}pref", str(subwords / split)))],
             args.workers, extra_files=[subwords / corpus.subwords.model, *(text / name for name in corpus.keep)],
             work=args.work)
    if corpus.report is not None:
        corpus.report(text)
    else:
        log_counts(corpus.name, corpus.what, {split: count_lines(subwords / f"{split}.{source}") for split in SPLITS})
