"""The feedback memory: one vector per step, shared by all layers.

    m_t = sum_{l=0..L} softmax(w)_l x_t^l                      (paper, eq. 1)
    k_t = W_k m_t,  v_t = W_v m_t                              (section 3.3)

x_t^0 is the embedded token and x_t^l the output of layer l, taken before the
final layer norm. With shared keys and values (the paper's fast variant) one
projection serves every layer; with per-layer keys and values each layer has
its own, but all are still computed once per memory vector, in one matmul.
The paper's other compositions (Figures 5 and 8) replace softmax(w) by fixed
weights: the average of all layers, or one layer (the top one) alone.

Figure 5's recurrent memory (section 4.3.2: "all previous layers plus the
same layer", as a multi-layer RNN's layer reads its own past output and the
layers below, never those above) is a memory per layer: layer l, numbered
from 1 as its output x^l is, reads

    m_t^l = sum_{j=0..l} softmax(w^l)_j x_t^j                  (eq. 1 over layers 0..l)
    k_t^l = W_k^l m_t^l,  v_t^l = W_v^l m_t^l

with weights w^l of its own (a row of `layer_weights`, those of the layers
above it masked out); the top layer's is the feedback memory. Its keys and
values are one plane pair per layer, from a shared projection (W_k^l = W_k)
or a projection per layer (one batched product over the layers).

In decoding, the memory's keys and values are cached between calls
(CachedKeyValues): one buffer for the whole decoder.
"""

from typing import Callable, List, Tuple

import torch
import torch.nn.functional as F
from fairseq.modules import LayerNorm
from torch import Tensor, nn

from ..errors import FeedbackUsageError
from .key_value_buffer import CachedKeyValues


class FeedbackMemory(CachedKeyValues, nn.Module):
    """Eq. 1 and the key/value projection of the memory.

    Args:
        embed_dim: the model's width.
        num_layers: the decoder's layers (eq. 1 mixes num_layers + 1 states).
        num_heads, head_dim: the attention heads that read the memory.
        shared_kv: one key/value projection for every layer (else one per layer).
        normalize_before: pre-norm layers: the memory gets a norm of its own.
        composition: --memory-composition: weighted, average, top, layer:K or recurrent.
    """

    def __init__(self, embed_dim, num_layers, num_heads, head_dim, shared_kv=True, normalize_before=False,
                 composition="weighted"):
        super().__init__()
        self.num_layers, self.num_heads, self.head_dim = num_layers, num_heads, head_dim
        self.shared_kv, self.recurrent = shared_kv, composition == "recurrent"
        self.memories = num_layers if self.recurrent else 1  # memory vectors per step
        if composition == "weighted":
            # w of eq. 1; zeros start from the uniform average, as the official code does
            self.layer_weights = nn.Parameter(torch.zeros(num_layers + 1))
        elif self.recurrent:  # layer l's w^l, from the uniform average of layers 0..l
            self.layer_weights = nn.Parameter(torch.zeros(num_layers, num_layers + 1))
            layers = torch.arange(num_layers + 1)
            self.register_buffer("above", layers[None] > layers[1:, None], persistent=False)
        else:
            self.layer_weights = None
            layer = composition_layer(composition, num_layers)
            fixed = torch.full((num_layers + 1,), 1 / (num_layers + 1)) if layer is None else F.one_hot(
                torch.tensor(layer), num_layers + 1).float()
            self.register_buffer("fixed_weights", fixed[None], persistent=False)
        # pre-norm layers normalise what they attend to; the memory is a mix of
        # un-normalised residual streams, so it gets a norm of its own
        self.layer_norm = LayerNorm(embed_dim) if normalize_before else None
        # a key and a value per layer, or one pair that every layer reads
        self.planes = 2 if shared_kv and self.memories == 1 else 2 * num_layers
        # each layer's memory through its own layer's projection: one product per layer
        self.grouped = self.recurrent and not shared_kv
        self.kv_proj = nn.Linear(embed_dim, (2 if shared_kv else self.planes) * num_heads * head_dim)
        nn.init.xavier_uniform_(self.kv_proj.weight, gain=2**-0.5)

    def mixing_weights(self) -> Tensor:
        """softmax(w) of eq. 1 (or the fixed weights), a row per memory,
        [memories, num_layers + 1]: once per block, not per step."""
        if self.layer_weights is None:
            return self.fixed_weights
        if self.recurrent:
            return F.softmax(self.layer_weights.masked_fill(self.above, float("-inf")), dim=-1)
        return F.softmax(self.layer_weights, dim=0)[None]

    def forward(self, layer_states: List[Tensor], weights: Tensor) -> Tensor:
        """Eq. 1 for one step, m_t = sum_l weights_l x_t^l for each memory, as one matrix product.

        Args:
            layer_states: x_t^0 (the embedding) .. x_t^L, [bsz, embed_dim] each.
            weights: mixing_weights(), [memories, num_layers + 1].

        Returns:
            m_t, [memories, bsz, embed_dim].
        """
        return torch.matmul(weights, torch.stack(layer_states).flatten(1)).view(len(weights), *layer_states[0].shape)

    def project(self, memory: Tensor) -> Tensor:
        """Memory vectors [slots, memories, bsz, embed_dim] -> keys and values
        [slots, planes, bsz, num_heads, head_dim] (a memory's planes one after another)."""
        if self.layer_norm is not None:
            memory = self.layer_norm(memory)
        slots, memories, bsz, embed_dim = memory.shape
        if self.grouped:  # memory l through layer l's rows of the projection
            kv = torch.baddbmm(self.kv_proj.bias.view(memories, 1, -1),
                               memory.transpose(0, 1).reshape(memories, slots * bsz, embed_dim),
                               self.kv_proj.weight.view(memories, -1, embed_dim).transpose(1, 2))
            kv = kv.view(memories, slots, bsz, kv.size(-1)).transpose(0, 1)  # no -1: a group may hold no slots
        else:
            kv = self.kv_proj(memory)
        kv = kv.view(slots, memories, bsz, self.planes // memories, self.num_heads, self.head_dim)
        return kv.transpose(2, 3).flatten(1, 2)

    def plane(self, layer: int) -> int:
        """The plane of the keys that `layer` reads (its values': the next)."""
        return 0 if self.planes == 2 else 2 * layer

    def layer_keys_values(self, window, transform_keys: Callable[[Tensor], Tensor]) -> List[Tuple[Tensor, Tensor]]:
        """Each layer's (keys, values) in a window of slots.

        Args:
            window: one [bsz, num_heads, slots, head_dim] view per plane.
            transform_keys: applied to each projection's keys (relative
                positions): when all layers share one, once in all.
        """
        pairs = [(transform_keys(window[p]), window[p + 1]) for p in range(0, self.planes, 2)]
        return pairs * self.num_layers if len(pairs) == 1 else pairs


def composition_layer(composition: str, num_layers: int):
    """The one layer a --memory-composition reads (None: a mix of several)."""
    if composition in ("weighted", "average", "recurrent"):
        return None
    if composition == "top":
        return num_layers
    if composition.startswith("layer:") and composition[6:].isdigit() and int(composition[6:]) <= num_layers:
        return int(composition[6:])
    raise FeedbackUsageError(
        f"--memory-composition {composition!r}: use weighted, average, top, recurrent, or layer:K with K from 0 "
        f"(the embeddings) to {num_layers}"
    )
