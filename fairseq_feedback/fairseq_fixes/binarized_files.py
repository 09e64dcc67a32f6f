"""The binarized files a tool reads, checked as fairseq loads them and, all of them, before the run:
directories, a translation task's language pair, dictionaries (read by fairseq's own loader), labels,
and splits (present, not empty, not cut short, no token beyond their dictionary). Late without them:
fairseq-train reads each data directory's training split as its epoch begins, and a split cut short or
a token beyond the dictionary fails at some batch."""

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
    """Silent: --ignore-label is a label of --labels (else no position is left out of the loss). Late:
    the labels of every training split."""
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
            check_binarized(monolingual_split(os.path.join(data, args.labels), split, cfg.dataset.dataset_impl),
                            (path, len(labels)))


def check_data(cfg, task, reads) -> None:
    """The data directories, a translation task's language pair, and the splits the tool reads."""
    paths = utils.split_paths(cfg.task.data)  # one missing: its dictionary, or a split, not found
    impl = cfg.dataset.dataset_impl
    if issubclass(task, LanguageModelingTask):
        dictionary = read_dictionary(os.path.join(paths[0], "dict.txt"))
        for path, split in reads:
            check_binarized(monolingual_split(path, split, impl), dictionary)
    elif issubclass(task, TranslationTask):
        src, tgt = language_pair(cfg.task)
        if src is None or tgt is None:
            raise FeedbackUsageError(f"no binarized data found in {paths[0]}: check the data directory, "
                                     "or pass --source-lang and --target-lang")
        dictionaries = {lang: read_dictionary(os.path.join(paths[0], f"dict.{lang}.txt")) for lang in (src, tgt)}
        for path, split in reads:
            _bilingual_split(path, split, src, tgt, impl, dictionaries)


def language_pair(task_cfg):
    """(-s, -t) of a translation task, or as fairseq infers them from the first data directory ((None,
    None) if it cannot)."""
    src, tgt = option(task_cfg, "source_lang", None), option(task_cfg, "target_lang", None)
    data = utils.split_paths(option(task_cfg, "data", None) or "")
    if (src is None or tgt is None) and data and os.path.isdir(data[0]):
        src, tgt = data_utils.infer_language_pair(data[0])
    return src, tgt


def check_binarized(prefix: str, dictionary=None) -> None:
    """A binarized split fairseq can read: with lines (numpy cannot map an empty .bin), not cut short,
    and, given its `dictionary` (path, number of symbols), of no token beyond it."""
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
    """(index bytes, data bytes, dtype) that an index of fairseq's mmap format counts; None for another."""
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


def _bilingual_split(data: str, split: str, src: str, tgt: str, impl, dictionaries) -> None:
    """DATA/SPLIT.SRC-TGT.{SRC,TGT} (or TGT-SRC), as fairseq's translation task reads it; `dictionaries`
    by language."""
    pair = next((p for p in (f"{src}-{tgt}", f"{tgt}-{src}")
                 if indexed_dataset.dataset_exists(os.path.join(data, f"{split}.{p}.{src}"), impl=impl)), None)
    for lang in (src, tgt):
        prefix = os.path.join(data, f"{split}.{pair or f'{src}-{tgt}'}.{lang}")
        if not indexed_dataset.dataset_exists(prefix, impl=impl):
            raise FeedbackUsageError(f"split '{split}' not found in {data}: expected {split}.{src}-{tgt}.{src}.bin/"
                                     f".idx and {split}.{src}-{tgt}.{tgt}.bin/.idx from fairseq-preprocess")
        check_binarized(prefix, dictionaries[lang])


def read_dictionary(path: str):
    """(path, number of symbols) of a dictionary the task will read, read by fairseq's Dictionary.load."""
    return path, len(Dictionary.load(path))


def scored_splits(cfg, tool: str):
    """(data directory, split) of what fairseq-eval-lm and fairseq-validate score."""
    splits = {"eval_lm": [cfg.dataset.gen_subset], "validate": cfg.dataset.valid_subset.split(",")}.get(tool, [])
    return [(utils.split_paths(cfg.task.data)[0], split) for split in splits]


def training_splits(cfg):
    """(data directory, split) of what fairseq-train reads: every directory's training split, and the
    validation splits of the first."""
    paths = utils.split_paths(cfg.task.data)
    valid = [] if cfg.dataset.disable_validation else cfg.dataset.valid_subset.split(",")
    return [(path, cfg.dataset.train_subset) for path in paths] + [(paths[0], split) for split in valid]
