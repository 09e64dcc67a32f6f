"""The block length of each epoch: the paper's BPTT warm-up (appendix, enwik8:
"the BPTT length is decreased to 64 for the first half of the training").

The length changes only where an epoch begins, when every stream starts
again from its first block with a fresh memory: within an epoch the blocks
are cut one way, so every token of the split is scored once per epoch, and
the memory a block starts from is always the end of the block before it in
the same stream."""

from typing import Optional


class BlockSchedule:
    """--bptt-warmup-tokens-per-sample for the epochs that begin before
    --bptt-warmup-updates updates, then --tokens-per-sample; without a
    warm-up, --tokens-per-sample throughout (read from the task's options
    when asked). `updates` is what fairseq-train has done (the task counts
    them as it trains; a checkpoint's epoch iterator keeps the count)."""

    def __init__(self, args):
        self.args, self.updates = args, 0

    def block_length(self) -> int:
        """The block length of an epoch that begins now, after the updates done."""
        warmup = self._warmup()
        if warmup is not None and self.updates < getattr(self.args, "bptt_warmup_updates", 0):
            return warmup
        return self.args.tokens_per_sample

    def lengths(self) -> set:
        """Every block length the schedule gives."""
        return {self.args.tokens_per_sample, self._warmup()} - {None}

    def _warmup(self) -> Optional[int]:
        return getattr(self.args, "bptt_warmup_tokens_per_sample", None)  # None: options of an older version
