"""The streams of the feedback_language_modeling task: a split's lines dealt
into contiguous streams, cut into blocks, delivered block k of every
stream at a time, and the iterator that keeps their layout in checkpoints
(and, with --random-epoch-offset, starts each training epoch elsewhere)."""

import logging

import numpy as np
import torch
from fairseq.data import FairseqDataset, TokenBlockDataset, data_utils, iterators

from ..errors import FeedbackUsageError

logger = logging.getLogger(__name__)


class SplitStream(FairseqDataset):
    """A loaded split: its lines of tokens (and of labels), before streaming."""

    def __init__(self, name, tokens, labels=None):
        self.name, self.tokens, self.labels = name, tokens, labels

    def __len__(self):
        return len(self.tokens)

    @property
    def sizes(self):
        return self.tokens.sizes

    def blocks(self, block_length, dictionary, output_dictionary, ignore_label, rows, num_shards, shard_id, offset=0):
        """Deals the lines into rows * num_shards contiguous streams of about
        equal length (so a stream starts at a line, whatever the block length),
        cuts each stream into blocks from its token `offset` on, and keeps
        this worker's streams.

        A block longer than the longest stream is cut to it, and streams left
        empty (more streams than lines) are left out of the batches: either
        would only be padding, and without it the blocks hold the same tokens
        in the same rows' order (the same numbers, up to a hundred times
        faster). An offset is under one block (as cut): the first `offset`
        tokens of every stream are not read this epoch."""
        num_streams = rows * num_shards
        cumulative = np.cumsum(self.tokens.sizes)
        targets = np.linspace(0, cumulative[-1], num_streams + 1)[1:-1]
        bounds = [0, *np.searchsorted(cumulative, targets, side="right").tolist(), len(self.tokens)]
        lengths = [int(self.tokens.sizes[bounds[s]:bounds[s + 1]].sum()) for s in range(num_streams)]
        asked, block_length = block_length, min(block_length, max(lengths))
        offset = min(offset, block_length - 1)
        lengths = [max(0, length - offset) for length in lengths]
        empty = lengths.count(0)
        if empty:
            logger.warning(f"{self.name}: {len(self)} lines fill {num_streams - empty} of the {num_streams} streams "
                           "asked for (--batch-size x workers); the empty ones are left out of the batches")

        def cut(lines):
            return TokenBlockDataset(lines, lines.sizes, block_length, pad=dictionary.pad(), eos=dictionary.eos(),
                                     break_mode="none", include_targets=False)

        def stream(s):
            if not lengths[s]:  # more streams than lines, or than the offset leaves
                return (), None, None
            tokens = _Lines(self.tokens, bounds[s], bounds[s + 1], offset)
            if self.labels is not None:
                return cut(tokens), cut(_Lines(self.labels, bounds[s], bounds[s + 1], offset)), None
            first_input = tokens.previous if tokens.previous is not None else torch.tensor([dictionary.eos()])
            return cut(tokens), None, first_input

        no_loss = None
        if self.labels is not None:
            no_loss = torch.tensor([output_dictionary.index(ignore_label), output_dictionary.eos()])
        mine = [s for s in range(shard_id * rows, (shard_id + 1) * rows) if lengths[s]] or [shard_id * rows]
        steps = max(-(-length // block_length) for length in lengths)  # ceil
        dataset = StreamBlockDataset(self.name, [stream(s) for s in mine], rows, steps, block_length, dictionary.pad(),
                                     no_loss)
        scored = "each scored once" if self.labels is None else f"each scored once unless labelled '{ignore_label}'"
        cut_to = f" (--tokens-per-sample {asked} cut to the longest stream)" if block_length < asked else ""
        read = f"{int(cumulative[-1])} tokens, {scored}"
        if offset:
            read = f"{sum(lengths)} of its {int(cumulative[-1])} tokens (each stream from its token {offset} on)"
        dataset.summary = (f"{self.name}: {read}, in {num_streams} streams of up to {steps} blocks of {block_length} "
                           f"tokens{cut_to} ({rows} streams on this worker)")
        return dataset


class StreamBlockDataset(FairseqDataset):
    """Item k is block k of each stream this worker reads, as one batch.

    `streams` holds this worker's streams, each a list of blocks (fairseq's
    TokenBlockDataset over its lines, and over its labels), of the `rows`
    it was dealt (those with lines), and the input before its first token:
    the end-of-line token where a stream starts, or the token before the
    offset it is read from. Every worker takes `steps` steps, the length of
    the longest stream of all workers, so that distributed workers stay in
    step; a stream that has ended is padding.
    """

    def __init__(self, name, streams, rows, steps, block_length, pad, no_loss=None):
        self.name, self.streams, self.rows, self.steps = name, streams, rows, steps
        self.block_length, self.pad, self.no_loss = block_length, pad, no_loss

    def source_and_target(self, stream, k):
        tokens, labels, first_input = stream
        if labels is None:
            # the input is the stream shifted right by one token: what TokenBlockDataset's include_targets
            # gives where every line ends with an end of line, and right too where none does (enwik8 as
            # published, prepare_enwik8 --no-newlines), where that would start each line with one
            target = tokens[k]
            return torch.cat([first_input if k == 0 else tokens[k - 1][-1:], target[:-1]]), target
        target = labels[k].clone()
        target[torch.isin(target, self.no_loss)] = self.pad
        return tokens[k], target

    def __len__(self):
        return self.steps

    def __getitem__(self, k):
        sources = torch.full((len(self.streams), self.block_length), self.pad, dtype=torch.long)
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
            "nsentences": self.rows,  # as asked for (--sentence-avg divides by it)
            "ntokens": int(target.ne(self.pad).sum()),  # what is scored, not what is read
            "net_input": {
                "src_tokens": source,
                "src_lengths": source.ne(self.pad).sum(1),
                "stream": self.name,
                "block_index": k,
            },
            "target": target,
        }

    def num_tokens(self, index):
        return len(self.streams) * self.block_length

    def size(self, index):
        return self.block_length

    @property
    def sizes(self):
        return [self.block_length] * self.steps


class StreamBatchIterator(iterators.EpochBatchIterator):
    """fairseq's epoch iterator over the blocks of a split's streams, block k
    of every stream at step k, cut as the BlockSchedule says for the epoch.

    With `random_offsets`, a training epoch (the iterator fairseq-train asks
    to shuffle; validation and fairseq-eval-lm do not) reads every stream
    from a random token under one block on, the same for every stream and
    worker, drawn from the seed and the epoch: the authors' trainer does so
    "to reduce overfitting" (trainer.py: random.randrange(mem_sz), the
    memory reset there). Block boundaries, and so where gradients are cut
    and where a memory starts empty, then move from epoch to epoch.

    Its state (saved in checkpoints) also holds the layout of the streams and
    the updates done: block k of one layout is other tokens than block k of
    another, so an epoch resumed mid-way goes on in the layout it began in
    (one the schedule gives; any other would train some tokens twice and
    others never, and is refused), and an epoch resumed at its start is cut
    as the schedule says after the updates done, from the offset the epoch
    draws."""

    def __init__(self, streams_in, streams, schedule, random_offsets=False, **kwargs):
        # streams_in(block_length, offset): the StreamBlockDataset
        self.streams_in, self.schedule, self.random_offsets = streams_in, schedule, random_offsets
        self.layout = {"streams": streams, "tokens_per_sample": schedule.block_length(), "offset": 0}
        dataset = streams_in(self.layout["tokens_per_sample"], 0)
        super().__init__(dataset=dataset, collate_fn=dataset.collater, batch_sampler=_each_block(dataset),
                         disable_shuffling=True, **kwargs)  # block_length k must follow block_length k-1

    def _cut(self, block_length, offset):
        self.layout = {**self.layout, "tokens_per_sample": block_length, "offset": offset}
        self.dataset = self.streams_in(block_length, offset)
        self.collate_fn = self.dataset.collater
        self.batch_sampler = self._frozen_batches = _each_block(self.dataset)

    def next_epoch_itr(self, shuffle=True, fix_batches_to_gpus=False, set_dataset_epoch=True):
        if self._next_epoch_itr is None:  # not an epoch resumed mid-way, which keeps its layout
            offset = 0
            if shuffle and self.random_offsets:
                with data_utils.numpy_seed(self.seed, self.next_epoch_idx):
                    offset = int(np.random.randint(self.layout["tokens_per_sample"]))
            if offset != self.layout["offset"]:
                self._cut(self.layout["tokens_per_sample"], offset)
        epoch = super().next_epoch_itr(shuffle, fix_batches_to_gpus, set_dataset_epoch)
        logger.info(self.dataset.summary)
        return epoch

    def state_dict(self):
        return {**super().state_dict(), "layout": self.layout, "updates": self.schedule.updates}

    def load_state_dict(self, state_dict):
        saved, blocks = state_dict.get("layout"), state_dict.get("iterations_in_epoch", 0)
        saved = None if saved is None else {"offset": 0, **saved}  # a checkpoint of an earlier version: none
        self.schedule.updates = state_dict.get("updates", self.schedule.updates)
        if blocks > 0 and saved is not None and saved != self.layout:
            if saved["streams"] != self.layout["streams"] or saved["tokens_per_sample"] not in self.schedule.lengths():
                raise FeedbackUsageError(
                    f"the checkpoint stopped {blocks} blocks into epoch {state_dict['epoch']} with "
                    f"{_describe(saved)}; this run would continue in {_describe(self.layout)}, training some "
                    f"tokens twice: resume with --tokens-per-sample {saved['tokens_per_sample']} and "
                    f"{saved['streams']} streams (--batch-size x workers), or pass --reset-dataloader "
                    "to start the data over at epoch 1")
            self._cut(saved["tokens_per_sample"], saved["offset"])
        elif blocks == 0 and self.schedule.block_length() != self.layout["tokens_per_sample"]:
            self._cut(self.schedule.block_length(), 0)
        super().load_state_dict(state_dict)


def _each_block(dataset):
    return tuple([k] for k in range(len(dataset)))


def _describe(layout):
    return f"{layout['streams']} streams of {layout['tokens_per_sample']}-token blocks"


class _Lines:
    """Lines lo..hi-1 of a dataset of lines, less their first `skip` tokens
    (there must be more); `previous` is the token before those left, as a
    tensor of one (None where skip is 0)."""

    def __init__(self, lines, lo, hi, skip=0):
        sizes = lines.sizes[lo:hi]
        ends = np.cumsum(sizes)
        first = int(np.searchsorted(ends, skip, side="right"))  # the line of token `skip`
        self.lines, self.lo, self.hi = lines, lo + first, hi
        self.cut = skip - int(ends[first - 1] if first else 0)  # tokens of that line left out
        self.sizes = sizes[first:].copy()
        self.sizes[0] -= self.cut
        self.previous = None
        if skip:
            line = int(np.searchsorted(ends, skip - 1, side="right"))
            self.previous = lines[lo + line][skip - 1 - int(ends[line - 1] if line else 0)].view(1)

    def __len__(self):
        return self.hi - self.lo

    def __getitem__(self, i):
        line = self.lines[self.lo + i]
        return line[self.cut:] if i == 0 else line
