"""The binarized files a tool reads, checked as fairseq loads them and, all of them, before the run:
the data directories, a translation task's language pair, the dictionaries (read by fairseq, whose
checks of their format so come first), the labels, and the splits (present, not empty, not cut
short, of no token beyond their dictionary), down to fairseq's index header.

Late, without them: fairseq-train reads the training split of each data directory as its epoch
begins (DATA1:DATA2:...), a split cut short is read past its end at some batch of some epoch, and a
token beyond the dictionary fails in the model's embedding at some batch (option_values.py says what
the labels mean)."""

import os
import struct

import numpy as np
from fairseq import utils
from fairseq.data import Dictionary, data_utils, indexed_dataset
from fairseq.tasks.language_modeling import LanguageModelingTask
from fairseq.tasks.translation import TranslationTask

from ..errors import FeedbackUsageError
from ..tasks.splits import labels_dictionary, monolingual_split
from .option_values import option


def check_labels(cfg, training: bool) -> None:
    """Silent: --ignore-label is a label of --labels (without them, or not among them, no position is
    left out of the loss). Late: the labels of every training split (check_data)."""
    args = cfg.task
    if not args.labels:
        if args.ignore_label != "_":
            raise FeedbackUsageError("--ignore-label is a label of --labels: add --labels, or drop --ignore-label")
        return
    path = labels_dictionary(args.data, args.labels)
    labels = Dictionary.load(path)
    if args.ignore_label != "_" and args.ignore_label not in labels:  # labels may need no `_`: all scored
        raise FeedbackUsageError(f"--ignore-label {args.ignore_label!r} is not a label of {args.labels} (its "
                                 "dict.txt): pass the label that marks positions without a target")
    if training:
        for data, split in training_splits(cfg):
            check_monolingual_split(os.path.join(data, args.labels), split, cfg.dataset.dataset_impl,
                                    (path, len(labels)))


def check_data(cfg, task, reads) -> None:
    """The data directories, a translation task's language pair, and the splits the tool reads."""
    paths = utils.split_paths(cfg.task.data)
    for path in paths:
        if not os.path.isdir(path):
            raise FeedbackUsageError(f"data directory {path} not found: pass the --destdir of fairseq-preprocess")
    impl = cfg.dataset.dataset_impl
    if issubclass(task, LanguageModelingTask):
        dictionary = read_dictionary(os.path.join(paths[0], "dict.txt"))
        for path, split in reads:
            check_monolingual_split(path, split, impl, dictionary)
    elif issubclass(task, TranslationTask):
        src, tgt = language_pair(cfg.task)
        if src is None or tgt is None:
            raise FeedbackUsageError(f"no binarized data found in {paths[0]}: check the data directory, "
                                     "or pass --source-lang and --target-lang")
        dictionaries = {lang: read_dictionary(os.path.join(paths[0], f"dict.{lang}.txt")) for lang in (src, tgt)}
        for path, split in reads:
            _bilingual_split(path, split, src, tgt, impl, dictionaries)


def language_pair(task_cfg):
    """(source, target) of a translation task's options: -s and -t, or as
    fairseq infers them from the first data directory's files ((None, None)
    if it cannot)."""
    src, tgt = option(task_cfg, "source_lang", None), option(task_cfg, "target_lang", None)
    data = utils.split_paths(option(task_cfg, "data", None) or "")
    if (src is None or tgt is None) and data and os.path.isdir(data[0]):
        src, tgt = data_utils.infer_language_pair(data[0])
    return src, tgt


def check_binarized(prefix: str, dictionary=None) -> None:
    """A binarized split fairseq can read: with lines (a split of none is an
    empty .bin, as every line holds at least its end-of-sentence token, and
    numpy cannot map an empty file), not cut short (fairseq would read past
    the end of a file, at some batch of some epoch) and, given its
    `dictionary` (its path and its number of symbols), of no token beyond it
    (binarized with another dictionary, or read with one cut short: the
    model's embedding would fail at some batch)."""
    data, index = indexed_dataset.data_file_path(prefix), indexed_dataset.index_file_path(prefix)
    if os.path.isfile(data) and os.path.getsize(data) == 0:
        raise FeedbackUsageError(f"{data} holds no lines (fairseq-preprocess was given an empty file): "
                                 "binarize the split again from a file with text")
    if not (os.path.isfile(data) and os.path.isfile(index)):
        return
    layout = _mmap_layout(index)
    if layout is None:  # another of fairseq's formats (--dataset-impl lazy or cached): fairseq checks it
        return
    *expected, dtype = layout
    again = "binarize the split again with fairseq-preprocess"
    for path, size in zip((index, data), expected):
        if os.path.getsize(path) != size:
            raise FeedbackUsageError(f"{path} holds {os.path.getsize(path)} bytes where {os.path.basename(index)} "
                                     f"counts {size}: it was cut short (or is of another binarization); {again}")
    if dictionary is not None and expected[1] > 0:
        path, symbols = dictionary
        largest = int(np.memmap(data, dtype=dtype, mode="r").max())  # one pass over the file, as numpy maps it
        if largest >= symbols:
            raise FeedbackUsageError(f"{data} holds token {largest}, and {path} has {symbols} symbols (with "
                                     "fairseq's 4 special ones): the split was binarized with another dictionary; "
                                     f"use the dictionary fairseq-preprocess wrote with it, or {again}")


# the index of fairseq's mmap format: a magic, version (<Q), dtype code (<B) and lines (<Q), then each
# line's size (int32), then each line's offset in bytes in the .bin (int64)
MMAP_HEADER = struct.Struct("<9sQBQ")


def _mmap_layout(index: str):
    """(index bytes, data bytes, dtype of the tokens) that an index in
    fairseq's mmap format counts, or None for an index in another format."""
    magic = indexed_dataset.MMapIndexedDataset.Index._HDR_MAGIC
    cut_short = FeedbackUsageError(f"{index} is cut short: binarize the split again with fairseq-preprocess")
    with open(index, "rb") as f:
        header = f.read(MMAP_HEADER.size)
        if not header.startswith(magic):
            if magic.startswith(header):
                raise cut_short
            return None
        if len(header) < MMAP_HEADER.size:
            raise cut_short
        _, _, code, lines = MMAP_HEADER.unpack(header)
        dtype = np.dtype(indexed_dataset._code_to_dtype[code])
        index_bytes = MMAP_HEADER.size + 12 * lines
        if lines == 0:
            return index_bytes, 0, dtype
        if os.path.getsize(index) < index_bytes:
            raise cut_short
        f.seek(MMAP_HEADER.size + 4 * (lines - 1))  # the last line's size, then its offset
        (size,) = struct.unpack("<i", f.read(4))
        f.seek(MMAP_HEADER.size + 4 * lines + 8 * (lines - 1))
        (offset,) = struct.unpack("<q", f.read(8))
    return index_bytes, offset + size * dtype.itemsize, dtype


def check_split(prefix: str, impl, missing: str, dictionary=None) -> None:
    """A split fairseq-preprocess wrote (PREFIX.bin and .idx), readable; `missing` says what to do without it."""
    if not indexed_dataset.dataset_exists(prefix, impl=impl):
        raise FeedbackUsageError(missing)
    check_binarized(prefix, dictionary)


def check_monolingual_split(data: str, split: str, impl=None, dictionary=None) -> None:
    """DATA/SPLIT (fairseq-preprocess --only-source), present and readable."""
    check_binarized(monolingual_split(data, split, impl), dictionary)


def _bilingual_split(data: str, split: str, src: str, tgt: str, impl, dictionaries) -> None:
    """DATA/SPLIT.SRC-TGT.{SRC,TGT} (or TGT-SRC), as fairseq's translation task reads it; `dictionaries`
    by language."""
    pair = next((p for p in (f"{src}-{tgt}", f"{tgt}-{src}")
                 if indexed_dataset.dataset_exists(os.path.join(data, f"{split}.{p}.{src}"), impl=impl)), None)
    expected = f"{split}.{src}-{tgt}.{src}.bin/.idx and {split}.{src}-{tgt}.{tgt}.bin/.idx"
    for lang in (src, tgt):
        check_split(os.path.join(data, f"{split}.{pair or f'{src}-{tgt}'}.{lang}"), impl,
                    f"split '{split}' not found in {data}: expected {expected} from fairseq-preprocess",
                    dictionaries[lang])


def read_dictionary(path: str):
    """(path, number of symbols) of a dictionary that the task will read, read by fairseq's
    Dictionary.load, whose checks of its format (a word twice, a line without its count) so fail
    before the tool creates anything."""
    return path, len(Dictionary.load(path))


def scored_splits(cfg, tool: str):
    """(data directory, split) of what fairseq-eval-lm and fairseq-validate score (no other tool without
    a model to train reads a split)."""
    splits = {"eval_lm": [cfg.dataset.gen_subset], "validate": cfg.dataset.valid_subset.split(",")}.get(tool, [])
    return [(utils.split_paths(cfg.task.data)[0], split) for split in splits]


def training_splits(cfg):
    """(data directory, split) of what fairseq-train reads: the training split
    of every data directory (one per epoch, in turn) and the validation
    splits of the first."""
    paths = utils.split_paths(cfg.task.data)
    valid = [] if cfg.dataset.disable_validation else cfg.dataset.valid_subset.split(",")
    return [(path, cfg.dataset.train_subset) for path in paths] + [(paths[0], split) for split in valid]
