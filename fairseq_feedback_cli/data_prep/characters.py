"""Character-level data as the field prepares it, for fairseq-preprocess.

Bytes are written as Transformer-XL's prep_enwik8.py writes them: each byte
as its number, a space between, and a newline byte as the end of a line,
which fairseq turns into its end-of-line token, so a split's tokens are its
bytes and a base-2 loss per token is bits per byte. (A split whose last byte
is no newline gets one end-of-line token more: fairseq ends every line with
one.) Or, without newlines, as Transformer-XL's loader reads that file
(add_eos=False): the lines' bytes one after another, a newline no token at
all, binarized by fairseq's own binarizer with no end-of-line token (which
fairseq-preprocess always appends). Text already written one character per token (char-PTB) is binarized
as it is. Either way with a dictionary of every symbol (every byte), given
to fairseq-preprocess as --srcdict, so that no valid or test symbol becomes
<unk>; the dest records its unit ("byte" or "character") in data_prep.json,
from which the feedback_language_modeling task reports bits per byte or per
character.
"""

import collections
from pathlib import Path
from typing import Dict, Iterable

import numpy as np
from fairseq.binarizer import FileBinarizer, VocabularyDatasetBinarizer
from fairseq.data import Dictionary, data_utils

from fairseq_feedback_cli.command_line import fail

from .arguments import log
from .steps import binarize
from .text import read_lines

NEWLINE = ord("\n")
BYTE = [str(b) for b in range(256)]


def write_bytes(data: bytes, path: Path, newlines: bool = True) -> None:
    """`data` as prep_enwik8.py writes it: one number per byte, one line per newline (without
    `newlines`, the lines that hold a byte: binarized without ends of line, they are one stream)."""
    lines = data.split(b"\n")[:-1] if data.endswith(b"\n") else data.split(b"\n")
    with open(path, "w", encoding="ascii", newline="\n") as f:
        for line in lines if newlines else filter(None, lines):
            f.write(" ".join(map(BYTE.__getitem__, line)) + "\n")


def byte_tokens(data: bytes, newlines: bool = True) -> int:
    """The tokens write_bytes makes of `data` for fairseq: a byte each, and an end of line after a last line
    (without `newlines`: the bytes that are no newline)."""
    if not newlines:
        return len(data) - data.count(b"\n")
    return len(data) + (bool(data) and not data.endswith(b"\n"))


def byte_dictionary(train: bytes) -> Dict[str, int]:
    """Every byte but the newline (the end-of-line token), with its count in train."""
    counts = np.bincount(np.frombuffer(train, dtype=np.uint8), minlength=256)
    return {BYTE[b]: int(counts[b]) for b in range(256) if b != NEWLINE}


def symbol_dictionary(texts: Dict[str, Path]) -> Dict[str, int]:
    """Every symbol of the splits' files, with its count in train (0: only in valid or test)."""
    counts = {split: collections.Counter() for split in texts}
    for split, path in texts.items():
        for line in read_lines(path):  # as every script reads text: UTF-8, without a byte-order mark
            counts[split].update(line.split())
    symbols = counts["train"].most_common()
    seen = set(counts["train"])
    symbols += sorted((s, 0) for split in texts for s in counts[split] if s not in seen and not seen.add(s))
    return dict(symbols)


def write_dictionary(symbols: Dict[str, int], path: Path) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(f"{symbol} {count}\n" for symbol, count in symbols.items())


def token_counts(folder: Path, splits: Iterable[str]) -> Dict[str, int]:
    """The tokens of each binarized split, as fairseq-train and fairseq-eval-lm count them."""
    dictionary = Dictionary.load(str(folder / "dict.txt"))
    counts = {}
    for split in splits:
        dataset = data_utils.load_indexed_dataset(str(folder / split), dictionary)
        counts[split] = int(dataset.sizes.sum())  # while the dataset holds the file its sizes are read from
    return counts


def binarize_characters(dest: Path, settings: dict, texts: Dict[str, Path], dictionary: Path, workers: int,
                        expected: Dict[str, int], extra_files=(), newlines: bool = True) -> None:
    """fairseq-preprocess --only-source of `texts` with the dictionary `dictionary`,
    into dest only if each split holds the `expected` tokens (without `newlines`:
    fairseq's binarizer with no end-of-line token after a line)."""
    def check(folder: Path) -> None:
        counts = token_counts(folder, texts)
        if counts != expected:
            fail("the binarized splits hold " + ", ".join(f"{s} {n:,}" for s, n in counts.items())
                 + " tokens, expected " + ", ".join(f"{s} {n:,}" for s, n in expected.items()))
        log("tokens: " + ", ".join(f"{split} {n:,}" for split, n in counts.items()))

    def without_ends_of_line(folder: Path) -> None:
        vocab = Dictionary.load(str(dictionary))
        log("binarizing without ends of line ...")
        for split, path in texts.items():
            FileBinarizer.multiprocess_dataset(str(path), "mmap", VocabularyDatasetBinarizer(vocab, append_eos=False),
                                               str(folder / split), vocab_size=len(vocab), num_workers=workers)
        vocab.save(str(folder / "dict.txt"))

    binarize(dest, settings, ["--only-source", "--srcdict", str(dictionary),
                              *(arg for split, path in texts.items() for arg in (f"--{split}pref", str(path)))],
             workers, extra_files, check=check, binarizer=None if newlines else without_ends_of_line)
