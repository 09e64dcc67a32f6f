"""The streams of the feedback_language_modeling task: a split's lines dealt
into contiguous streams, cut into blocks, delivered block k of every
stream at a time, and the iterator that keeps their layout in checkpoints."""

import logging

import numpy as np
import torch
from fairseq.data import FairseqDataset, TokenBlockDataset, iterators

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

    def blocks(self, block_length, dictionary, output_dictionary, ignore_label, rows, num_shards, shard_id):
        """Deals the lines into rows * num_shards contiguous streams of about
        equal length (so a stream starts at a line, whatever the block length),
        cuts each stream into blocks, and keeps this worker's streams.

        A block longer than the longest stream is cut to it, and streams left
        empty (more streams than lines) are left out of the batches: either
        would only be padding, and without it the blocks hold the same tokens
        in the same rows' order (the same numbers, up to a hundred times
        faster)."""
        num_streams = rows * num_shards
        cumulative = np.cumsum(self.tokens.sizes)
        targets = np.linspace(0, cumulative[-1], num_streams + 1)[1:-1]
        bounds = [0, *np.searchsorted(cumulative, targets, side="right").tolist(), len(self.tokens)]
        lengths = [int(self.tokens.sizes[bounds[s]:bounds[s + 1]].sum()) for s in range(num_streams)]
        asked, block_length = block_length, min(block_length, max(lengths))
        empty = lengths.count(0)
        if empty:
            logger.warning(f"{self.name}: {len(self)} lines fill {num_streams - empty} of the {num_streams} streams "
                           "asked for (--batch-size x workers); the empty ones are left out of the batches")

        def cut(lines, lo, hi, include_targets):
            return TokenBlockDataset(_Lines(lines, lo, hi), lines.sizes[lo:hi], block_length, pad=dictionary.pad(),
                                     eos=dictionary.eos(), break_mode="none", include_targets=include_targets)

        def stream(s):
            lo, hi = bounds[s], bounds[s + 1]
            if lo == hi:  # more streams than lines
                return (), None
            labels = None if self.labels is None else cut(self.labels, lo, hi, False)
            return cut(self.tokens, lo, hi, labels is None), labels

        no_loss = None
        if self.labels is not None:
            no_loss = torch.tensor([output_dictionary.index(ignore_label), output_dictionary.eos()])
        mine = [s for s in range(shard_id * rows, (shard_id + 1) * rows) if lengths[s]] or [shard_id * rows]
        steps = max(-(-length // block_length) for length in lengths)  # ceil
        dataset = StreamBlockDataset(self.name, [stream(s) for s in mine], rows, steps, block_length, dictionary.pad(),
                                     no_loss)
        scored = "each scored once" if self.labels is None else f"each scored once unless labelled '{ignore_label}'"
        cut_to = f" (--tokens-per-sample {asked} cut to the longest stream)" if block_length < asked else ""
        dataset.summary = (f"{self.name}: {int(cumulative[-1])} tokens, {scored}, in {num_streams} streams of up to "
                           f"{steps} blocks of {block_length} tokens{cut_to} ({rows} streams on this worker)")
        return dataset


class StreamBlockDataset(FairseqDataset):
    """Item k is block k of each stream this worker reads, as one batch.

    `streams` holds this worker's streams, each a list of blocks (fairseq's
    TokenBlockDataset over its lines, and over its labels), of the `rows`
    it was dealt (those with lines). Every worker takes `steps` steps, the
    length of the longest stream of all workers, so that distributed workers
    stay in step; a stream that has ended is padding.
    """

    def __init__(self, name, streams, rows, steps, block_length, pad, no_loss=None):
        self.name, self.streams, self.rows, self.steps = name, streams, rows, steps
        self.block_length, self.pad, self.no_loss = block_length, pad, no_loss

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

    Its state (saved in checkpoints) also holds the layout of the streams and
    the updates done: block k of one layout is other tokens than block k of
    another, so an epoch resumed mid-way goes on in the layout it began in
    (one the schedule gives; any other would train some tokens twice and
    others never, and is refused), and an epoch resumed at its start is cut
    as the schedule says after the updates done."""

    def __init__(self, streams_in, streams, schedule, **kwargs):
        self.streams_in, self.schedule = streams_in, schedule  # streams_in(block_length): the StreamBlockDataset
        self.layout = {"streams": streams, "tokens_per_sample": schedule.block_length()}
        dataset = streams_in(self.layout["tokens_per_sample"])
        super().__init__(dataset=dataset, collate_fn=dataset.collater, batch_sampler=_each_block(dataset),
                         disable_shuffling=True, **kwargs)  # block k must follow block k-1

    def _cut(self, block_length):
        self.layout = {**self.layout, "tokens_per_sample": block_length}
        self.dataset = self.streams_in(block_length)
        self.collate_fn = self.dataset.collater
        self.batch_sampler = self._frozen_batches = _each_block(self.dataset)

    def next_epoch_itr(self, *args, **kwargs):
        epoch = super().next_epoch_itr(*args, **kwargs)
        logger.info(self.dataset.summary)
        return epoch

    def state_dict(self):
        return {**super().state_dict(), "layout": self.layout, "updates": self.schedule.updates}

    def load_state_dict(self, state_dict):
        saved, blocks = state_dict.get("layout"), state_dict.get("iterations_in_epoch", 0)
        self.schedule.updates = state_dict.get("updates", self.schedule.updates)
        if blocks > 0 and saved is not None and saved != self.layout:
            if saved["streams"] != self.layout["streams"] or saved["tokens_per_sample"] not in self.schedule.lengths():
                raise FeedbackUsageError(
                    f"the checkpoint stopped {blocks} blocks into epoch {state_dict['epoch']} with "
                    f"{_describe(saved)}; this run would continue in {_describe(self.layout)}, training some "
                    f"tokens twice: resume with --tokens-per-sample {saved['tokens_per_sample']} and "
                    f"{saved['streams']} streams (--batch-size x workers), or pass --reset-dataloader "
                    "to start the data over at epoch 1")
            self._cut(saved["tokens_per_sample"])
        elif blocks == 0 and self.schedule.block_length() != self.layout["tokens_per_sample"]:
            self._cut(self.schedule.block_length())
        super().load_state_dict(state_dict)


def _each_block(dataset):
    return tuple([k] for k in range(len(dataset)))


def _describe(layout):
    return f"{layout['streams']} streams of {layout['tokens_per_sample']}-token blocks"


class _Lines:
    """Lines lo..hi-1 of a dataset of lines."""

    def __init__(self, lines, lo, hi):
        self.lines, self.lo, self.hi = lines, lo, hi

    def __len__(self):
        return self.hi - self.lo

    def __getitem__(self, i):
        return self.lines[self.lo + i]
