"""Fixes for fairseq bugs that would silently change results or lose work.

fairseq's batch_by_size (main since 2022, so fairseq-fixed) drops the last
batch when its size is not a multiple of --required-batch-size-multiple
(default 8): fairseq-generate then leaves test sentences out of its BLEU
without a word, and training skips them (fairseq issues 5036 and 5351).
Batches stay as fairseq makes them; the sentences of the dropped batch come
back as a last batch of their own.

fairseq copies checkpoints in place, so an interrupted save can leave a
truncated checkpoint_last.pt that the next run cannot resume from; see
checkpoints.py. All are applied when the plugin is imported.
"""

import functools

import numpy as np
from fairseq import checkpoint_utils
from fairseq.data import data_utils

from .checkpoints import AtomicCopyPathManager, resume_from_a_complete_checkpoint


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


def apply_fairseq_fixes() -> None:
    if not getattr(data_utils.batch_by_size, "keeps_every_sentence", False):
        data_utils.batch_by_size = _keep_every_sentence(data_utils.batch_by_size)
    if checkpoint_utils.PathManager is not AtomicCopyPathManager:
        # save_checkpoint copies with the PathManager of its module: only checkpoints change
        checkpoint_utils.PathManager = AtomicCopyPathManager
        # fairseq-train resumes through this function; no hook precedes it
        checkpoint_utils.load_checkpoint = resume_from_a_complete_checkpoint(checkpoint_utils.load_checkpoint)
