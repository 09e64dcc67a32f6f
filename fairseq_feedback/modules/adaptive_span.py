"""Adaptive attention span (Sukhbaatar et al. 2019), per head.

Head h learns z_h in [0, 1]; its attention weight on a key d slots before the
newest one is scaled by the soft ramp

    m(d) = clamp((z_h S - d) / R + 1, 0, 1)          (S: --memory-span, R: ramp)

and renormalised. That equals softmax(scores + log m), which is how it is
applied here (one bias per block, so the fused attention kernel still runs).
The loss adds  coefficient * S * mean(z)  per layer. Only the window the
largest span reaches, ceil(S max z) + R slots, is kept and attended to.
"""

import math

import torch
from torch import Tensor, nn


class AdaptiveSpanMask(nn.Module):
    """Each head's learned span.

    Args:
        max_span: S, --memory-span.
        ramp: R, the soft ramp's length (--adaptive-span-ramp).
        num_heads: the heads, each with its z.
        init: z's initial value, a fraction of S (--adaptive-span-init).
    """

    def __init__(self, max_span: int, ramp: int, num_heads: int, init: float = 0.0):
        super().__init__()
        self.max_span, self.ramp = max_span, ramp
        self.span_fraction = nn.Parameter(torch.full((num_heads,), float(init)))  # z

    def mask(self, slots: int) -> Tensor:
        """m(d) for the last `slots` slots, oldest first: [num_heads, 1, slots]."""
        distance = torch.arange(slots - 1, -1, -1, device=self.span_fraction.device, dtype=self.span_fraction.dtype)
        return ((self.span_fraction[:, None] * self.max_span - distance) / self.ramp + 1).clamp(0, 1)[:, None, :]

    def bias(self, slots: int) -> Tensor:
        """log m(d), -inf where m = 0 (without a NaN gradient there)."""
        mask = self.mask(slots)
        off = mask == 0
        return mask.masked_fill(off, 1).log().masked_fill(off, float("-inf"))

    def current_span(self) -> int:
        """Slots the widest head reaches: the memory kept and attended to."""
        reach = math.ceil(self.span_fraction.detach().max().item() * self.max_span) + self.ramp
        return max(1, min(self.max_span, reach))

    def loss(self) -> Tensor:
        """S mean(z), a scalar (the decoder weighs it by --adaptive-span-loss)."""
        return self.max_span * self.span_fraction.mean()

    @torch.no_grad()
    def clamp_(self):
        self.span_fraction.clamp_(0, 1)
