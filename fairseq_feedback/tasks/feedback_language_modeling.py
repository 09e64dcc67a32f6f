"""Language modelling over contiguous streams, delivered block by block.

A split is one token stream (fairseq-preprocess --only-source). It is cut
into blocks of --tokens-per-sample tokens by fairseq's TokenBlockDataset and
dealt, in order, into as many contiguous streams as there are batch rows over
all workers; each worker reads its own rows. Batch k holds block k of every
stream, and the model carries each stream's memory from block k-1 to block k
(FeedbackLanguageModel.forward), so every token of the split is a target
exactly once and sees the same context whatever the block length.

fairseq's truncated_bptt example works the same way but drops a token per
block and leftover blocks; this task scores every token and keeps the memory
of training and validation apart.

With --labels the model predicts an aligned target stream instead of the
next token: at each input position, the label at that position (the paper's
algorithmic tasks, where the input holds actions and the labels positions).
"""

import os
from dataclasses import dataclass, field
from typing import Optional

from fairseq import utils
from fairseq.data import Dictionary, data_utils
from fairseq.tasks import register_task
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

from ..errors import FeedbackUsageError
from ..models.feedback_lm import FeedbackLanguageModel
from .adaptive_span_loss import AdaptiveSpanLossMixin
from .splits import labels_dictionary, monolingual_split
from .streams import SplitStream, StreamBatchIterator


@dataclass
class FeedbackLanguageModelingConfig(LanguageModelingConfig):
    labels: Optional[str] = field(
        default=None,
        metadata={"help": "folder inside the data directory holding an aligned target stream "
                          "(fairseq-preprocess --only-source of the labels files): at each position "
                          "predict its label instead of the next token"},
    )
    ignore_label: str = field(default="_", metadata={"help": "the label of positions that carry no loss"})


@register_task("feedback_language_modeling", dataclass=FeedbackLanguageModelingConfig)
class FeedbackLanguageModelingTask(AdaptiveSpanLossMixin, LanguageModelingTask):
    """Its command line is checked by fairseq_fixes/command_line.py (blocks, batches of streams, labels)."""

    takes_model = FeedbackLanguageModel
    wrong_model = ("--task feedback_language_modeling carries each stream's memory from block to block, which only "
                   "--arch feedback_lm (and feedback_lm_*) does: use it (with --no-feedback for the transformer "
                   "baseline), or --task language_modeling")

    @classmethod
    def setup_dictionary(cls, args, **kwargs):
        dictionary, output_dictionary = super().setup_dictionary(args, **kwargs)
        if args.labels:
            output_dictionary = Dictionary.load(labels_dictionary(args.data, args.labels))
        return dictionary, output_dictionary

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        """Keeps the split's tokens (and labels); blocks are dealt into streams
        in get_batch_iterator, once the number of batch rows is known."""
        paths = utils.split_paths(self.args.data)
        path = paths[(epoch - 1) % len(paths)]
        tokens = self._load_tokens(path, split, self.dictionary)
        labels = None
        if self.args.labels:
            labels = self._load_tokens(os.path.join(path, self.args.labels), split, self.output_dictionary)
            self._check_aligned(tokens, labels, os.path.join(path, split), os.path.join(path, self.args.labels, split))
        self.datasets[split] = SplitStream(split, tokens, labels)

    def _load_tokens(self, path, split, dictionary):
        return data_utils.load_indexed_dataset(monolingual_split(path, split, self.args.dataset_impl), dictionary)

    @staticmethod
    def _check_aligned(tokens, labels, tokens_path, labels_path):
        mismatch = next((i for i, (a, b) in enumerate(zip(tokens.sizes, labels.sizes)) if a != b), None)
        if len(tokens.sizes) != len(labels.sizes) or mismatch is not None:
            where = f"line {mismatch + 1}" if mismatch is not None else "the line count"
            raise FeedbackUsageError(
                f"labels {labels_path} do not align with {tokens_path} ({where} differs): "
                "each labels line needs exactly one label per input token"
            )

    def get_batch_iterator(self, dataset, max_tokens=None, max_sentences=None, max_positions=None,
                           num_shards=1, shard_id=0, epoch=1, num_workers=0, **kwargs):
        if not isinstance(dataset, SplitStream):  # prompts for sampling and scoring
            return super().get_batch_iterator(
                dataset, max_tokens=max_tokens, max_sentences=max_sentences, max_positions=max_positions,
                num_shards=num_shards, shard_id=shard_id, epoch=epoch, num_workers=num_workers, **kwargs)
        block = self.args.tokens_per_sample
        check_block(block, max_positions)
        rows = max_sentences or max(1, (max_tokens or block) // block)
        streams = dataset.blocks(block, self.source_dictionary, self.output_dictionary, self.args.ignore_label,
                                 rows, num_shards, shard_id)
        return StreamBatchIterator(
            {"streams": rows * num_shards, "tokens_per_sample": block},
            dataset=streams,
            collate_fn=streams.collater,
            batch_sampler=[[k] for k in range(len(streams))],
            num_workers=num_workers,
            epoch=epoch,
            disable_shuffling=True,  # block k must follow block k-1
        )

    def eval_lm_dataloader(self, dataset, max_tokens=36000, batch_size=None, max_positions=None,
                           num_shards=1, shard_id=0, num_workers=1, data_buffer_size=10, context_window=0):
        if context_window > 0:
            raise FeedbackUsageError("--context-window is not needed: the memory carries the context "
                                     "across blocks; drop the flag")
        if self.args.labels:
            raise FeedbackUsageError("fairseq-eval-lm scores next-token prediction; drop --labels")
        return self.get_batch_iterator(dataset, max_tokens=max_tokens, max_sentences=batch_size,
                                       max_positions=max_positions, num_shards=num_shards, shard_id=shard_id,
                                       num_workers=num_workers).next_epoch_itr(shuffle=False)


def check_block(block, max_positions) -> None:
    """A block fits in the model's positions (absolute ones: relative ones set no limit)."""
    if max_positions is not None and block > max_positions:
        raise FeedbackUsageError(f"--tokens-per-sample {block} is longer than the model allows ({max_positions}): "
                                 "use shorter blocks")
