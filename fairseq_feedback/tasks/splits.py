"""Where fairseq-preprocess puts a language-modelling split and the labels' dictionary,
found or named in one line. (What a split holds is checked as fairseq loads it:
fairseq_fixes/binarized_files.py, check_binarized.)"""

import os

from fairseq import utils
from fairseq.data import indexed_dataset

from ..errors import FeedbackUsageError


def monolingual_split(data: str, split: str, impl=None) -> str:
    """DATA/SPLIT, the layout of fairseq-preprocess --only-source."""
    prefix = os.path.join(data, split)
    if not indexed_dataset.dataset_exists(prefix, impl=impl):
        raise FeedbackUsageError(f"split '{split}' not found in {data}: expected {split}.bin and {split}.idx "
                                 "from fairseq-preprocess --only-source")
    return prefix


def labels_dictionary(data: str, labels: str) -> str:
    """The path of the labels' dictionary (--labels), in the first data directory."""
    path = os.path.join(utils.split_paths(data)[0], labels, "dict.txt")
    if not os.path.exists(path):
        raise FeedbackUsageError(f"labels dictionary {path} not found: binarize the labels with "
                                 f"fairseq-preprocess --only-source --destdir {os.path.dirname(path)}")
    return path
