"""A decoder layer whose self-attention reads a memory of past states.

For the Feedback Transformer, one step at a time, over the shared memory:

    z_t^l = Attn(x_t^l, {m_{t-span}, ..., m_{t-1}})             (paper, 3.3)

for its Transformer baseline (--no-feedback), a whole block at once, over the
layer's own past inputs (TransformerXLAttention). Then encoder-decoder
attention and the feed-forward block, exactly as in fairseq's
TransformerDecoderLayer, whose norms, feed-forward, encoder attention and
dropouts this layer inherits; only self-attention is replaced. With
--no-feed-forward (and persistent vectors) it is an all-attention layer.
"""

from typing import List, Optional, Tuple

import torch
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase
from torch import Tensor

from .feedback_attention import Alignment, FeedbackAttention, attend
from .memory_view import MemoryView
from .transformer_xl_attention import TransformerXLAttention


class MemoryDecoderLayer(TransformerDecoderLayerBase):
    """fairseq's decoder layer with self-attention over a memory.

    Args:
        cfg: fairseq's TransformerConfig with the FeedbackConfig fields on it.
        no_encoder_attn: no attention over the encoder (a language model).
    """

    def __init__(self, cfg, no_encoder_attn=False):
        super().__init__(cfg, no_encoder_attn)
        if cfg.no_feed_forward:
            self.fc1 = self.fc2 = self.final_layer_norm = None

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        # the Transformer baseline attends to its own layer's inputs, so its
        # attention projects their keys and values itself
        attention = TransformerXLAttention if cfg.no_feedback else FeedbackAttention
        num_heads = cfg.decoder.attention_heads
        adaptive_span = (cfg.memory_span, cfg.adaptive_span_ramp, cfg.adaptive_span_init) if cfg.adaptive_span else None
        return attention(
            embed_dim, num_heads, cfg.head_dim or embed_dim // num_heads, dropout=cfg.attention_dropout,
            q_noise=self.quant_noise, qn_block_size=self.quant_noise_block_size,
            persistent_vectors=cfg.persistent_vectors, adaptive_span=adaptive_span,
        )

    def project_own_memory(self, x: Tensor) -> Tensor:
        """The transformer baseline's keys and values of this layer's inputs:
        [slots, bsz, embed_dim] -> [slots, 2, bsz, num_heads, head_dim]."""
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        attn, (slots, bsz, _) = self.self_attn, x.shape
        return attn.kv_proj(x).view(slots, bsz, 2, attn.num_heads, attn.head_dim).transpose(1, 2)

    def encoder_keys_values(self, encoder_out: Tensor) -> Tensor:
        """Projects the encoder output once per sentence: [src_len, sentences,
        embed_dim] -> keys and values [2, sentences, num_heads, src_len, head_dim]."""
        attn = self.encoder_attn
        src_len, sentences, _ = encoder_out.shape
        kv = [proj(encoder_out).view(src_len, sentences, attn.num_heads, attn.head_dim)
              for proj in (attn.k_proj, attn.v_proj)]
        return torch.stack(kv).permute(0, 2, 3, 1, 4).contiguous()

    def _sublayer(self, x: Tensor, norm, fn) -> Tensor:
        residual = x
        if self.normalize_before:
            x = norm(x)
        x = self.dropout_module(fn(x)) + residual
        return x if self.normalize_before else norm(x)

    def _feed_forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.activation_dropout_module(self.activation_fn(self.fc1(x))))

    def forward_memory(self, x: Tensor, memory: MemoryView, encoder_kv=None, encoder_bias=None,
                       alignment: Optional[Alignment] = None) -> Tensor:
        """The layer: self-attention over `memory`, attention over the encoder, feed-forward.

        Args:
            x: one step, [bsz, embed_dim], or for the transformer baseline a
                whole block, [tgt_len, bsz, embed_dim].
            memory: what self-attention reads (MemoryView).
            encoder_kv: this layer's encoder (keys, values), [sentences,
                num_heads, src_len, head_dim] each (per_layer), or None.
            encoder_bias: the encoder's padding mask as a bias, [sentences, 1, 1, src_len], or None.
            alignment: where the encoder attention's weights go (this layer is
                fairseq's alignment layer), or None.

        Returns:
            the layer's output, shaped as `x`.
        """
        x = self._sublayer(x, self.self_attn_layer_norm, lambda h: self.self_attn(h, memory))
        if self.encoder_attn is not None:
            # fairseq's MultiheadAttention drops its weights with its dropout_module
            # (fairseq-fixed 0.12.3.1 / fairseq main early 2024)
            attn = self.encoder_attn
            x = self._sublayer(
                x, self.encoder_attn_layer_norm,
                lambda h: attend(h, attn.q_proj, attn.out_proj, encoder_kv[0], encoder_kv[1], encoder_bias,
                                 dropout=attn.dropout_module, alignment=alignment),
            )
        if self.fc1 is None:
            return x
        return self._sublayer(x, self.final_layer_norm, self._feed_forward)


def per_layer(encoder_kv: Optional[Tensor], layers: int) -> List[Optional[Tuple[Tensor, Tensor]]]:
    """Each layer's encoder (keys, values), split once per block: indexing
    them at every step would cost a full-size gradient per step.

    Args:
        encoder_kv: every layer's encoder_keys_values stacked,
            [layers, 2, sentences, num_heads, src_len, head_dim], or None.
        layers: how many layers (all None without encoder_kv).
    """
    return [None] * layers if encoder_kv is None else [tuple(kv.unbind()) for kv in encoder_kv.unbind()]
