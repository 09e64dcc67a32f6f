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

import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from fairseq import utils
from fairseq.data import Dictionary, FairseqDataset, TokenBlockDataset, data_utils, iterators
from fairseq.models import MODEL_REGISTRY
from fairseq.tasks import register_task
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

from ..checks import monolingual_split, training_splits
from ..errors import FeedbackUsageError
from .adaptive_span_loss import AdaptiveSpanLossMixin

logger = logging.getLogger(__name__)


@dataclass
class FeedbackLanguageModelingConfig(LanguageModelingConfig):
    labels: Optional[str] = field(
        default=None,
        metadata={"help": "folder inside the data directory holding an aligned target stream "
                          "(fairseq-preprocess --only-source of the labels files): at each position "
                          "predict its label instead of the next token"},
    )
    ignore_label: str = field(default="_", metadata={"help": "the label of positions that carry no loss"})


# fairseq's language-modelling options that streams have no use for, and their values that mean "off"
UNUSED = {"sample_break_mode": "none", "shorten_method": "none", "add_bos_token": False, "self_target": False,
          "future_target": False, "past_target": False, "pad_to_fixed_length": False, "pad_to_fixed_bsz": False}


class StreamBlockDataset(FairseqDataset):
    """Item k is block k of each stream this worker reads, as one batch.

    `streams` holds this worker's streams, each a list of blocks (fairseq's
    TokenBlockDataset over its lines, and over its labels). Every worker takes
    `steps` steps, the length of the longest stream of all workers, so that
    distributed workers stay in step; a stream that has ended is padding.
    """

    def __init__(self, name, streams, steps, block, pad, no_loss=None):
        self.name, self.streams, self.steps, self.block, self.pad, self.no_loss = name, streams, steps, block, pad, no_loss

    def source_and_target(self, stream, k):
        tokens, labels = stream
        if labels is None:  # the input is the stream shifted right by one token
            source, target, _ = tokens[k]
            return source, target
        target = labels[k].clone()
        target[torch.isin(target, self.no_loss)] = self.pad
        return tokens[k], target

    def __len__(self):
        return self.steps

    def __getitem__(self, k):
        sources = torch.full((len(self.streams), self.block), self.pad, dtype=torch.long)
        targets = torch.full_like(sources, self.pad)
        for row, stream in enumerate(self.streams):
            if k < len(stream[0]):
                source, target = self.source_and_target(stream, k)
                sources[row, : len(source)] = source
                targets[row, : len(target)] = target
        return {"id": k, "source": sources, "target": targets}

    def collater(self, samples):
        (item,) = samples
        k, source, target = item["id"], item["source"], item["target"]
        return {
            "id": torch.arange(len(source)) + k * len(source),
            "nsentences": len(source),
            "ntokens": int(target.ne(self.pad).sum()),  # what is scored, not what is read
            "net_input": {
                "src_tokens": source,
                "src_lengths": source.ne(self.pad).sum(1),
                "stream": self.name,
                "block": k,
            },
            "target": target,
        }

    def num_tokens(self, index):
        return len(self.streams) * self.block

    def size(self, index):
        return self.block

    @property
    def sizes(self):
        return [self.block] * self.steps


@register_task("feedback_language_modeling", dataclass=FeedbackLanguageModelingConfig)
class FeedbackLanguageModelingTask(AdaptiveSpanLossMixin, LanguageModelingTask):
    @classmethod
    def check_model(cls, model):
        """`model`, a class: the memory carried from block to block is feedback_lm's."""
        if not issubclass(model, MODEL_REGISTRY["feedback_lm"]):
            raise FeedbackUsageError("--task feedback_language_modeling carries each stream's memory from block to "
                                     "block, which only --arch feedback_lm (and feedback_lm_*) does: use it (with "
                                     "--no-feedback for the transformer baseline), or --task language_modeling")

    @classmethod
    def check_command_line(cls, cfg, model, task):
        """The command line of any fairseq tool, before it starts (checks.py);
        `model` is None unless it trains one."""
        super().check_command_line(cfg, model, task)
        cls.check_streams(cfg)
        if cfg.task.labels:
            cls.check_labels(cfg, training=model is not None)
        elif cfg.task.ignore_label != "_":
            raise FeedbackUsageError("--ignore-label is a label of --labels: add --labels, or drop --ignore-label")

    @staticmethod
    def check_streams(cfg):
        """The blocks, and the batches of streams of training (and eval-lm) and validation."""
        block = cfg.task.tokens_per_sample
        if block < 1:
            raise FeedbackUsageError(f"--tokens-per-sample must be at least 1, got {block}")
        for name, off in UNUSED.items():
            if cfg.task.get(name, off) != off:
                raise FeedbackUsageError(f"--task feedback_language_modeling does not use {_flag(name)}: "
                                         "its streams run across lines, block after block; drop the option, or use "
                                         "--task language_modeling")
        for rows_name, tokens_name in (("batch_size", "max_tokens"), ("batch_size_valid", "max_tokens_valid")):
            rows, tokens = cfg.dataset.get(rows_name), cfg.dataset.get(tokens_name)
            if rows is not None and rows < 1:
                raise FeedbackUsageError(f"{_flag(rows_name)} must be at least 1, got {rows}: it counts the streams "
                                         "of a batch")
            if tokens is not None and tokens < block:
                raise FeedbackUsageError(f"{_flag(tokens_name)} {tokens} holds no block of --tokens-per-sample "
                                         f"{block}: raise it, or give the streams per batch with {_flag(rows_name)}")

    @staticmethod
    def check_labels(cfg, training):
        args = cfg.task
        labels = Dictionary.load(labels_dictionary(args.data, args.labels))
        if args.ignore_label != "_" and args.ignore_label not in labels:  # labels may need no `_`: all scored
            raise FeedbackUsageError(f"--ignore-label {args.ignore_label!r} is not a label of {args.labels} (its "
                                     "dict.txt): pass the label that marks positions without a target")
        if training:
            for path, split in training_splits(cfg):
                monolingual_split(os.path.join(path, args.labels), split, cfg.dataset.dataset_impl)

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


class StreamBatchIterator(iterators.EpochBatchIterator):
    """fairseq's epoch iterator, whose state (saved in checkpoints) also holds
    the layout of the streams: block k of one layout is other tokens than
    block k of another, so a run resumed mid-epoch in another layout would
    train some tokens twice and others never."""

    def __init__(self, layout, **kwargs):
        super().__init__(**kwargs)
        self.layout = layout

    def state_dict(self):
        return {**super().state_dict(), "layout": self.layout}

    def load_state_dict(self, state_dict):
        saved, blocks = state_dict.get("layout"), state_dict.get("iterations_in_epoch", 0)
        if blocks > 0 and saved is not None and saved != self.layout:
            raise FeedbackUsageError(
                f"the checkpoint stopped {blocks} blocks into epoch {state_dict['epoch']} with "
                f"{_describe(saved)}; this run would continue in {_describe(self.layout)}, training some "
                f"tokens twice: resume with --tokens-per-sample {saved['tokens_per_sample']} and "
                f"{saved['streams']} streams (--batch-size x workers), or pass --reset-dataloader "
                "to start the data over at epoch 1")
        super().load_state_dict(state_dict)


def _describe(layout):
    return f"{layout['streams']} streams of {layout['tokens_per_sample']}-token blocks"


class SplitStream(FairseqDataset):
    """A loaded split: its lines of tokens (and of labels), before streaming."""

    def __init__(self, name, tokens, labels=None):
        self.name, self.tokens, self.labels = name, tokens, labels

    def __len__(self):
        return len(self.tokens)

    @property
    def sizes(self):
        return self.tokens.sizes

    def blocks(self, block, dictionary, output_dictionary, ignore_label, rows, num_shards, shard_id):
        """Deals the lines into rows * num_shards contiguous streams of about
        equal length (so a stream starts at a line, whatever the block length),
        cuts each stream into blocks, and keeps this worker's streams."""
        num_streams = rows * num_shards
        cumulative = np.cumsum(self.tokens.sizes)
        targets = np.linspace(0, cumulative[-1], num_streams + 1)[1:-1]
        bounds = [0, *np.searchsorted(cumulative, targets, side="right").tolist(), len(self.tokens)]

        def cut(lines, lo, hi, include_targets):
            return TokenBlockDataset(_Lines(lines, lo, hi), lines.sizes[lo:hi], block, pad=dictionary.pad(),
                                     eos=dictionary.eos(), break_mode="none", include_targets=include_targets)

        def stream(s):
            lo, hi = bounds[s], bounds[s + 1]
            if lo == hi:  # more streams than lines
                return (), None
            labels = None if self.labels is None else cut(self.labels, lo, hi, False)
            return cut(self.tokens, lo, hi, labels is None), labels

        blocks_per_stream = [-(-int(self.tokens.sizes[bounds[s]:bounds[s + 1]].sum()) // block)  # ceil
                             for s in range(num_streams)]
        no_loss = None
        if self.labels is not None:
            no_loss = torch.tensor([output_dictionary.index(ignore_label), output_dictionary.eos()])
        mine = [stream(s) for s in range(shard_id * rows, (shard_id + 1) * rows)]
        steps = max(blocks_per_stream)
        dataset = StreamBlockDataset(self.name, mine, steps, block, dictionary.pad(), no_loss)
        scored = "each scored once" if self.labels is None else f"each scored once unless labelled '{ignore_label}'"
        logger.info(f"{self.name}: {int(cumulative[-1])} tokens, {scored}, in {num_streams} streams of up to "
                    f"{steps} blocks of {block} tokens ({rows} streams on this worker)")
        return dataset


def check_block(block, max_positions):
    if max_positions is not None and block > max_positions:
        raise FeedbackUsageError(f"--tokens-per-sample {block} is longer than the model allows ({max_positions}): "
                                 "use shorter blocks")


def _flag(name):
    return "--" + name.replace("_", "-")


def labels_dictionary(data, labels):
    """The path of the labels' dictionary, checked."""
    path = os.path.join(utils.split_paths(data)[0], labels, "dict.txt")
    if not os.path.exists(path):
        raise FeedbackUsageError(f"labels dictionary {path} not found: binarize the labels with "
                                 f"fairseq-preprocess --only-source --destdir {os.path.dirname(path)}")
    return path


class _Lines:
    """Lines lo..hi-1 of a dataset of lines."""

    def __init__(self, lines, lo, hi):
        self.lines, self.lo, self.hi = lines, lo, hi

    def __len__(self):
        return self.hi - self.lo

    def __getitem__(self, i):
        return self.lines[self.lo + i]
