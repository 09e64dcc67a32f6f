"""A graph's replays checked against the eager computation.

A replay is compared with the eager computation on the same inputs and
dropout draws (outputs, and in training gradients), at a tolerance by
precision: at its first replay, and, for a cache's first FULLY_CHECKED
graphs, at their first replay of inputs copied in afresh and their first
replay after another graph replayed (which may have overwritten what it
left in the pool). Those two catch defects of the code around the graphs
(a tensor captured from outside the inputs, a result read from the pool
after another replay), which every graph of a cache shares, so a few
graphs show them. A step with non-finite values in both results (an fp16
overflow, which the loss scaler skips) is not judged: the next replay is
checked instead; non-finite values in the graph's result alone are a
failure. GraphedFunction runs the eager computation and acts on the
verdict; a mismatch is a GraphFailure.
"""

from typing import FrozenSet, Optional

import torch
from torch import Tensor

from .failure import GraphFailure

# the largest difference allowed, relative to the largest value, by precision
TOLERANCE_FP32, TOLERANCE_HALF = 1e-4, 2e-2
# checks in a row left unjudged (non-finite values) after which a graph is given up
MAX_UNJUDGED = 8
FIRST_REPLAY, NEW_INPUTS, AFTER_ANOTHER_GRAPH = "first replay", "new inputs", "after another graph"
# a cache's graphs checked at new inputs and after another graph's replay, too
FULLY_CHECKED = 4


def largest_difference(got: Tensor, expected: Tensor) -> Optional[float]:
    """max |got - expected| / max |expected|; None where the eager result
    holds a non-finite value (a step that cannot be judged), infinity where
    only the graph's does."""
    got, expected = got.detach().float(), expected.detach().float()
    if not torch.isfinite(expected).all():
        return None
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-6))


class EagerChecks:
    """One graph's checks: those still to pass (`pending`), those due at a
    call, and the verdict on a replay. `fully_checked`: at new inputs and
    after another graph's replay too; `precise`: float32 or float64 throughout."""

    def __init__(self, fully_checked: bool, precise: bool):
        self.pending = {FIRST_REPLAY} | ({NEW_INPUTS, AFTER_ANOTHER_GRAPH} if fully_checked else set())
        self.unjudged = {"outputs": 0, "gradients": 0}  # checks in a row that could not be judged
        self.tolerance = TOLERANCE_FP32 if precise else TOLERANCE_HALF

    def due(self, replays_seen: Optional[int], pool_replays: int) -> FrozenSet[str]:
        """The checks due at a replay, after the pool's `pool_replays`
        replays; `replays_seen`: the pool's count after this graph's last
        replay (None: it has not replayed)."""
        met = {FIRST_REPLAY}  # until one is judged
        if replays_seen is not None:
            met.add(NEW_INPUTS)
            if pool_replays != replays_seen:
                met.add(AFTER_ANOTHER_GRAPH)
        return frozenset(met & self.pending)

    def passed(self, due: FrozenSet[str]) -> None:
        self.pending -= due

    def judge(self, what: str, got, expected) -> bool:
        """Whether the graph's `got` passed against eager's `expected`: False
        if the step cannot be judged (eager's not finite); raises GraphFailure
        if they differ (the graph's alone not finite, too), or after
        MAX_UNJUDGED steps in a row that could not be judged."""
        differences = [largest_difference(g, e) for g, e in zip(got, expected) if g is not None and e is not None]
        if None in differences:
            self.unjudged[what] += 1
            if self.unjudged[what] >= MAX_UNJUDGED:
                raise GraphFailure(f"its {what} were not finite at {MAX_UNJUDGED} checks in a row")
            return False
        self.unjudged[what] = 0
        worst = max(differences, default=0.0)
        if worst == float("inf"):
            raise GraphFailure(f"its {what} are not finite where eager's are")
        if worst > self.tolerance:
            raise GraphFailure(f"its {what} differ from eager by {worst:.3g} (at most {self.tolerance:g})")
        return True
