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
    warm-up, --tokens-per-sample throughout. `updates` is what fairseq-train
    has done (the task counts them as it trains; a checkpoint's epoch
    iterator keeps the count)."""

    def __init__(self, tokens_per_sample: int, warmup_tokens_per_sample: Optional[int] = None,
                 warmup_updates: int = 0):
        self.tokens_per_sample, self.warmup_updates = tokens_per_sample, warmup_updates
        self.warmup_tokens_per_sample = warmup_tokens_per_sample if warmup_updates > 0 else None
        self.updates = 0

    def block(self, updates: Optional[int] = None) -> int:
        """The block length of an epoch that begins after `updates` updates (default: those done)."""
        updates = self.updates if updates is None else updates
        if self.warmup_tokens_per_sample is not None and updates < self.warmup_updates:
            return self.warmup_tokens_per_sample
        return self.tokens_per_sample

    def lengths(self) -> set:
        """Every block length the schedule gives."""
        return {self.tokens_per_sample, self.warmup_tokens_per_sample} - {None}
