"""One decoder layer of the Feedback Transformer, run one step at a time.

    z_t^l = Attn(x_t^l, {m_{t-span}, ..., m_{t-1}})             (paper, 3.3)

then encoder-decoder attention and the feed-forward block, exactly as in
fairseq's TransformerDecoderLayer, whose norms, feed-forward, encoder
attention and dropouts this layer inherits; only self-attention is replaced.
"""

import torch
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase
from torch import Tensor

from .feedback_attention import FeedbackAttention, attend_one_step


class FeedbackDecoderLayer(TransformerDecoderLayerBase):
    def __init__(self, cfg, no_encoder_attn=False, memory_head_dim=None, own_memory=False):
        # read by build_self_attention, which the base constructor calls
        self.memory_head_dim = memory_head_dim or cfg.decoder.embed_dim // cfg.decoder.attention_heads
        self.own_memory = own_memory
        super().__init__(cfg, no_encoder_attn)

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        return FeedbackAttention(
            embed_dim, cfg.decoder.attention_heads, self.memory_head_dim,
            cfg.attention_dropout, self.quant_noise, self.quant_noise_block_size, own_memory=self.own_memory,
        )

    def project_own_memory(self, x: Tensor) -> Tensor:
        """The transformer baseline's keys and values of this layer's inputs:
        [slots, batch, embed] -> [slots, 2, batch, heads, head_dim]."""
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        attn, (slots, batch, _) = self.self_attn, x.shape
        return attn.kv_proj(x).view(slots, batch, 2, attn.num_heads, attn.head_dim).transpose(1, 2)

    def encoder_keys_values(self, encoder_out: Tensor) -> Tensor:
        """Projects the encoder output ([src_len, batch, embed]) once per
        sentence, as keys and values [2, batch, heads, src_len, head_dim]."""
        attn = self.encoder_attn
        src_len, batch, _ = encoder_out.shape
        kv = [proj(encoder_out).view(src_len, batch, attn.num_heads, attn.head_dim) for proj in (attn.k_proj, attn.v_proj)]
        return torch.stack(kv).permute(0, 2, 3, 1, 4).contiguous()

    def _sublayer(self, x: Tensor, norm, fn) -> Tensor:
        residual = x
        if self.normalize_before:
            x = norm(x)
        x = self.dropout_module(fn(x)) + residual
        return x if self.normalize_before else norm(x)

    def _feed_forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.activation_dropout_module(self.activation_fn(self.fc1(x))))

    def step(self, x, memory_keys, memory_values, encoder_kv=None, encoder_bias=None):
        """x: [batch, embed] at one step; memory keys/values: [batch, heads, slots, head_dim]."""
        x = self._sublayer(
            x, self.self_attn_layer_norm, lambda h: self.self_attn(h, memory_keys, memory_values)
        )
        if self.encoder_attn is not None:
            attn = self.encoder_attn
            dropout_p = attn.dropout_module.p if self.training else 0.0
            x = self._sublayer(
                x, self.encoder_attn_layer_norm,
                lambda h: attend_one_step(h, attn.q_proj, attn.out_proj, encoder_kv[0], encoder_kv[1], encoder_bias, dropout_p=dropout_p),
            )
        return self._sublayer(x, self.final_layer_norm, self._feed_forward)
