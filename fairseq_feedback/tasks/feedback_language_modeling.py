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

With --bptt-warmup-tokens-per-sample the blocks are shorter for the epochs
that begin in the first --bptt-warmup-updates updates (block_schedule.py);
with --random-epoch-offset each training epoch starts its streams at a
random token under one block (streams.py).
On character-level data (--token-unit, or the unit the data_prep scripts
record in DATA/data_prep.json) fairseq-train also logs the loss as bits per
byte or character (bpb, bpc) and fairseq-eval-lm says so in its result, with
the convention of the newlines where the data records one (prepare_enwik8:
enwik8's published numbers leave them out).
"""

import json
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Optional

from fairseq import metrics, utils
from fairseq.data import Dictionary, data_utils
from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

from ..errors import FeedbackUsageError
from ..models.feedback_lm import FeedbackLanguageModel
from ..option_ranges import check_ranges, flag
from .adaptive_span_loss import AdaptiveSpanLossMixin
from .block_schedule import BlockSchedule
from .splits import labels_dictionary, monolingual_split
from .streams import SplitStream, StreamBatchIterator

BITS_PER = {"byte": "bpb", "character": "bpc"}  # the names the field reports them by
TOKEN_UNIT = ChoiceEnum(BITS_PER)
# data_prep.json's "newlines" (prepare_enwik8): which bytes the bits are over, said beside every printed number,
# since enwik8's published numbers leave the newlines out and the two do not compare
NEWLINES = {True: "each newline a scored token", False: "the newlines not scored"}


@dataclass
class FeedbackLanguageModelingConfig(LanguageModelingConfig):
    """What is known of an option is said in its field's metadata, beside its help (as the feedback
    options', models/feedback_config.py): "at_least", the values it can take (option_ranges.py);
    "unused", the value of an option of fairseq's that the streams take for "not used". fairseq's
    options are said so in INHERITED. They are checked before the run (check_stream_options)."""

    labels: Optional[str] = field(
        default=None,
        metadata={"help": "folder inside the data directory holding an aligned target stream "
                          "(fairseq-preprocess --only-source of the labels files): at each position "
                          "predict its label instead of the next token"},
    )
    ignore_label: str = field(default="_", metadata={"help": "the label of positions that carry no loss"})
    bptt_warmup_tokens_per_sample: Optional[int] = field(
        default=None,
        metadata={"help": "the paper's BPTT warm-up: blocks of this many tokens in the epochs that begin before "
                          "--bptt-warmup-updates updates, then --tokens-per-sample (changed only where an epoch "
                          "begins, so every token is still scored once per epoch)", "at_least": 1},
    )
    bptt_warmup_updates: int = field(default=0, metadata={"help": "see --bptt-warmup-tokens-per-sample"})
    random_epoch_offset: bool = field(
        default=False,
        metadata={"help": "read the streams of each training epoch from a random token under one block on (drawn "
                          "from --seed and the epoch, the memory empty there), as the paper's authors train: the "
                          "blocks differ from epoch to epoch, and up to a block of each stream is left out of an "
                          "epoch; validation and fairseq-eval-lm still score every token once"},
    )
    token_unit: Optional[TOKEN_UNIT] = field(
        default=None,
        metadata={"help": "what a token of the data is, 'byte' or 'character': the loss is then also reported in "
                          "bits per byte or character (default: the unit the data_prep scripts record in "
                          "DATA/data_prep.json, if any)"},
    )


# fairseq's language-modelling options, in the terms of the config's own fields: the block length, and the
# options that streams, which run across lines block after block, have no use for
INHERITED = {
    "tokens_per_sample": {"at_least": 1},
    **{name: {"unused": off} for name, off in (
        ("sample_break_mode", "none"), ("shorten_method", "none"), ("add_bos_token", False), ("self_target", False),
        ("future_target", False), ("past_target", False), ("pad_to_fixed_length", False), ("pad_to_fixed_bsz", False))},
}


def check_stream_options(cfg) -> None:
    """Silent: the task's options (its fields' metadata, and INHERITED's) and the batches of streams of
    training (and eval-lm) and validation, from a tool's whole configuration before the run
    (fairseq_fixes/command_line.py): fairseq would take these mistakes without a word, or the streams
    would fail on them inside."""
    options = {**{f.name: f.metadata for f in fields(FeedbackLanguageModelingConfig)}, **INHERITED}
    check_ranges(cfg.task, options)
    for name, facts in options.items():
        if "unused" in facts and cfg.task.get(name, facts["unused"]) != facts["unused"]:
            raise FeedbackUsageError(f"--task feedback_language_modeling does not use {flag(name)}: its streams run "
                                     "across lines, block after block; drop the option, or use --task language_modeling")
    block_length, warmup = cfg.task.tokens_per_sample, cfg.task.get("bptt_warmup_tokens_per_sample")
    if (warmup is None) != (cfg.task.get("bptt_warmup_updates", 0) <= 0):
        raise FeedbackUsageError("a BPTT warm-up needs both --bptt-warmup-tokens-per-sample (its block length) and "
                                 "--bptt-warmup-updates (above 0: how long it lasts); give both or neither")
    for rows_name, tokens_name in (("batch_size", "max_tokens"), ("batch_size_valid", "max_tokens_valid")):
        rows, tokens = cfg.dataset.get(rows_name), cfg.dataset.get(tokens_name)
        if rows is not None and rows < 1:
            raise FeedbackUsageError(f"{flag(rows_name)} must be at least 1, got {rows}: it counts the streams "
                                     "of a batch")
        if tokens is not None and tokens < block_length:
            raise FeedbackUsageError(f"{flag(tokens_name)} {tokens} holds no block of --tokens-per-sample "
                                     f"{block_length}: raise it, or give the streams per batch with {flag(rows_name)}")


@register_task("feedback_language_modeling", dataclass=FeedbackLanguageModelingConfig)
class FeedbackLanguageModelingTask(AdaptiveSpanLossMixin, LanguageModelingTask):
    """Its options are checked before the run by check_stream_options, its labels with the data
    (fairseq_fixes/binarized_files.py)."""

    takes_model = FeedbackLanguageModel
    wrong_model = ("--task feedback_language_modeling carries each stream's memory from block to block, which only "
                   "--arch feedback_lm (and feedback_lm_*) does: use it (with --no-feedback for the transformer "
                   "baseline), or --task language_modeling")

    def __init__(self, args, dictionary, output_dictionary=None, targets=None):
        super().__init__(args, dictionary, output_dictionary, targets)
        self.block_schedule = BlockSchedule(args)
        recorded = recorded_settings(args.data)
        self.token_unit = getattr(args, "token_unit", None) or recorded.get("unit")
        self.newlines = recorded.get("newlines")

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
        for block_length in self.block_schedule.lengths():
            check_block(block_length, max_positions)
        rows = max_sentences or max(1, (max_tokens or self.args.tokens_per_sample) // self.args.tokens_per_sample)
        if max_sentences is not None:
            check_streams(dataset, rows * num_shards, num_shards)
        else:  # a budget of tokens (--max-tokens) asks for no more streams than the split has tokens
            rows = min(rows, max(1, int(dataset.sizes.sum()) // num_shards))

        def streams_in(block_length, offset):
            return dataset.blocks(block_length, self.source_dictionary, self.output_dictionary, self.args.ignore_label,
                                  rows, num_shards, shard_id, offset)

        return StreamBatchIterator(streams_in, rows * num_shards, self.block_schedule,
                                   random_offsets=getattr(self.args, "random_epoch_offset", False),
                                   seed=self.args.seed, num_workers=num_workers, epoch=epoch)

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        self.block_schedule.updates = update_num + 1  # done once this step is, when the next epoch is cut
        return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)

    def reduce_metrics(self, logging_outputs, criterion):
        super().reduce_metrics(logging_outputs, criterion)
        if self.token_unit:
            # fairseq's language-model criteria log the loss per token in base 2
            metrics.log_derived(BITS_PER[self.token_unit], lambda meters: round(float(meters["loss"].avg), 4))

    def eval_lm_dataloader(self, dataset, max_tokens=36000, batch_size=None, max_positions=None,
                           num_shards=1, shard_id=0, num_workers=1, data_buffer_size=10, context_window=0):
        if context_window > 0:
            raise FeedbackUsageError("--context-window is not needed: the memory carries the context "
                                     "across blocks; drop the flag")
        if self.args.labels:
            raise FeedbackUsageError("fairseq-eval-lm scores next-token prediction; drop --labels")
        if self.token_unit:
            _say_bits_per(f"{self.token_unit}" + (f" ({NEWLINES[self.newlines]})" if self.newlines is not None else ""))
        return self.get_batch_iterator(dataset, max_tokens=max_tokens, max_sentences=batch_size,
                                       max_positions=max_positions, num_shards=num_shards, shard_id=shard_id,
                                       num_workers=num_workers).next_epoch_itr(shuffle=False)


def check_block(block_length, max_positions) -> None:
    """A block fits in the model's positions (absolute ones: relative ones set no limit)."""
    if max_positions is not None and block_length > max_positions:
        raise FeedbackUsageError(f"--tokens-per-sample {block_length} is longer than the model allows ({max_positions}): "
                                 "use shorter blocks")


def check_streams(dataset, streams, num_shards) -> None:
    """More streams asked for (--batch-size) than the split has tokens, refused before their layout,
    which is as large as the streams asked for (10**9 took 8 GB before anything refused them)."""
    tokens = int(dataset.sizes.sum())
    if streams > tokens:
        raise FeedbackUsageError(
            f"{dataset.name} holds {tokens:,} tokens, too few for the {streams:,} streams asked for (--batch-size x "
            f"workers), and its {len(dataset):,} lines fill {len(dataset):,} at most (a stream starts at a line): "
            f"pass a --batch-size (--batch-size-valid for validation) of {max(1, len(dataset) // num_shards):,} or less")


def recorded_settings(data: str) -> dict:
    """What a data_prep script recorded with the data (its unit of a token, its newlines; empty: nothing)."""
    settings = os.path.join(utils.split_paths(data)[0], "data_prep.json")
    if not os.path.isfile(settings):
        return {}
    with open(settings) as f:
        return json.load(f)


class _BitsPer(logging.Filter):
    """fairseq-eval-lm prints its result itself, with no hook: its line gets the unit."""

    def __init__(self, unit):
        super().__init__()
        self.unit = unit

    def filter(self, record):
        message = record.getMessage()
        if message.startswith("Loss (base 2): "):
            loss, rest = message[len("Loss (base 2): "):].split(",", 1)
            record.msg, record.args = f"Loss (base 2): {loss} bits per {self.unit},{rest}", ()
        return True


def _say_bits_per(unit):
    """The unit (and convention) of this evaluation (an earlier one in the same process may have had another)."""
    log = logging.getLogger("fairseq_cli.eval_lm")
    for earlier in [f for f in log.filters if isinstance(f, _BitsPer)]:
        log.removeFilter(earlier)
    log.addFilter(_BitsPer(unit))
