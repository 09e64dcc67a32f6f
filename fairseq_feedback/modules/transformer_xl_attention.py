"""Self-attention of the paper's Transformer baseline, over its own layer's past.

Each layer of the baseline attends to the last `span` inputs of its own layer,
itself included, as Transformer-XL does, rather than to the feedback memory.
So, unlike FeedbackAttention, it projects keys and values itself, and in
decoding it keeps them between calls (CachedKeyValues): one buffer per layer.
"""

from torch import nn

from .feedback_attention import FeedbackAttention
from .key_value_buffer import CachedKeyValues


class TransformerXLAttention(CachedKeyValues, FeedbackAttention):
    def __init__(self, embed_dim, num_heads, head_dim, **kwargs):
        super().__init__(embed_dim, num_heads, head_dim, **kwargs)
        self.kv_proj = nn.Linear(embed_dim, 2 * num_heads * head_dim)
        nn.init.xavier_uniform_(self.kv_proj.weight, gain=2**-0.5)  # as fairseq's MultiheadAttention
