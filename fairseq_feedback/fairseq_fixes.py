"""Fixes for fairseq bugs that would silently change results or lose work.

fairseq's batch_by_size (main since 2022, so fairseq-fixed) drops the last
batch when its size is not a multiple of --required-batch-size-multiple
(default 8): fairseq-generate then leaves test sentences out of its BLEU
without a word, and training skips them (fairseq issues 5036 and 5351).
Batches stay as fairseq makes them; the sentences of the dropped batch come
back as a last batch of their own.

fairseq copies checkpoints in place, so an interrupted save can leave a
truncated checkpoint_last.pt that the next run cannot resume from; see
checkpoints.py.

And fairseq stops on some mistakes only deep inside (with a traceback), or
after fairseq-train has created --save-dir: a command line is checked before
a tool's main runs, a checkpoint file before torch reads it, and a split
before numpy maps it (checks.py). All are applied when the plugin is imported.
"""

import functools

import numpy as np
from fairseq import checkpoint_utils
from fairseq.data import data_utils
from fairseq.distributed import utils as distributed_utils

from .checkpoints import AtomicCopyPathManager, check_complete, resume_from_a_complete_checkpoint
from .checks import check_command_line, check_not_empty


def _keep_every_sentence(batch_by_size):
    @functools.wraps(batch_by_size)
    def batches_of_all(indices, *args, **kwargs):
        batches = batch_by_size(indices, *args, **kwargs)
        kept = sum(len(batch) for batch in batches)
        if kept < len(indices):  # batches are consecutive runs of `indices`: the tail is what was dropped
            batches = list(batches) + [np.asarray(indices[kept:], dtype=np.int64)]
        return batches

    batches_of_all.keeps_every_sentence = True
    return batches_of_all


def _checked_first(function, check):
    """`function`, calling check(its first argument) before it runs."""
    if getattr(function, "checked_first", False):
        return function

    @functools.wraps(function)
    def checked(first, *args, **kwargs):
        check(first)
        return function(first, *args, **kwargs)

    checked.checked_first = True
    return checked


def apply_fairseq_fixes() -> None:
    if not getattr(data_utils.batch_by_size, "keeps_every_sentence", False):
        data_utils.batch_by_size = _keep_every_sentence(data_utils.batch_by_size)
    if checkpoint_utils.PathManager is not AtomicCopyPathManager:
        # save_checkpoint copies with the PathManager of its module: only checkpoints change
        checkpoint_utils.PathManager = AtomicCopyPathManager
        # fairseq-train resumes through this function; no hook precedes it
        checkpoint_utils.load_checkpoint = resume_from_a_complete_checkpoint(checkpoint_utils.load_checkpoint)
    # each looked up in its module when called, by fairseq's tools and by fairseq itself
    distributed_utils.call_main = _checked_first(distributed_utils.call_main, check_command_line)
    checkpoint_utils.load_checkpoint_to_cpu = _checked_first(checkpoint_utils.load_checkpoint_to_cpu, check_complete)
    data_utils.load_indexed_dataset = _checked_first(data_utils.load_indexed_dataset, check_not_empty)
