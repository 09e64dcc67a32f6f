"""What the feedback decoder and its Transformer baseline share.

Both are fairseq's TransformerDecoderBase (embeddings, positions, LayerDrop
list, final norm, output projection or adaptive softmax) with layers that
attend to a memory of past states (MemoryDecoderLayer) instead of
self-attention over the sequence. This class embeds the new tokens, projects
the encoder output once per sentence, and hands the layers to the subclass's
`decode`, which is called three ways:

- training and teacher-forced scoring: the whole sequence at once;
- the streaming LM task (`stream_state`, a StreamState): block after
  block, the memory carried from one block to the next;
- fairseq's incremental decoding (`incremental_state`): after the first call,
  one new token per call, the memory's keys and values cached.
"""

import sys
from typing import Dict, List, Optional

import torch
from fairseq.models.transformer import TransformerDecoderBase
from fairseq.modules import FairseqDropout
from torch import Tensor, nn

from ..modules.feedback_attention import Alignment
from ..modules.memory_decoder_layer import MemoryDecoderLayer

IncrementalState = Dict[str, Dict[str, Optional[Tensor]]]


class StreamState:
    """What a stream of the streaming LM task carries from one block to the
    next, for either decoder: the vectors that the next block's attention
    reads before its own, the last `span` of them, detached (a block's
    backward stops at its start, as in Transformer-XL), projected again by
    the next block with the weights it runs with.

    Layout: [sources, slots, bsz, embed_dim]. A source is what one set of
    keys and values is projected from: the feedback memory m_t (one source,
    which every layer reads; the recurrent memory, a source per layer), or
    for the Transformer baseline each layer's own inputs (a source per layer). Kept by the model per stream, not in
    checkpoints: a resumed run starts its next block with fresh memory.
    """

    def __init__(self):
        self.vectors: Optional[Tensor] = None  # None: the stream's first block

    def carry(self, vectors: Tensor, span: int) -> None:
        """Keeps the last `span` slots of `vectors` [sources, slots, bsz, embed_dim] for the next block."""
        self.vectors = vectors[:, -span:].detach()


class MemoryDecoder(TransformerDecoderBase):
    """fairseq's TransformerDecoderBase with layers that attend to a memory.

    Args:
        cfg: fairseq's TransformerConfig with the FeedbackConfig fields on it.
        dictionary, embed_tokens, no_encoder_attn, output_projection: as for
            fairseq's TransformerDecoderBase.
    """

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn, output_projection)
        self.span = cfg.memory_span
        self.emb_dropout_module = FairseqDropout(cfg.emb_dropout, module_name="MemoryDecoder.emb_dropout")
        head_dim = cfg.head_dim or self.embed_dim // cfg.decoder.attention_heads
        self.span_loss_coefficient = cfg.adaptive_span_loss if cfg.adaptive_span else 0.0
        # key-side relative positions, shared by all layers and heads: entry
        # span - 1 embeds the nearest slot (modules/memory_view.py)
        self.key_positions = (
            nn.Parameter(torch.randn(self.span, head_dim) * head_dim**-0.5) if cfg.relative_positions else None
        )

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return MemoryDecoderLayer(cfg, no_encoder_attn)

    def decode(self, x: Tensor, layers: List[Optional[MemoryDecoderLayer]], encoder_kv: Optional[Tensor],
               encoder_bias: Optional[Tensor], incremental_state: Optional[IncrementalState] = None,
               stream_state: Optional[StreamState] = None, alignment: Optional[Alignment] = None) -> Tensor:
        """The layers on the embedded new tokens (the subclass's own).

        Args:
            x: x^0, the new tokens embedded, [tgt_len, bsz, embed_dim].
            layers: every layer, None where LayerDrop left one out of this pass.
            encoder_kv: every layer's encoder keys and values,
                [layers, 2, sentences, num_heads, src_len, head_dim], or None.
            encoder_bias: the encoder's padding mask as a bias, [sentences, 1, 1, src_len], or None.
            incremental_state: fairseq's, in incremental decoding (the memory's
                keys and values cached there).
            stream_state: a stream's StreamState, in the streaming LM task.
            alignment: where fairseq's alignment layer puts its encoder
                attention's weights (incremental decoding), or None.

        Returns:
            the top layer's outputs, [tgt_len, bsz, embed_dim].
        """
        raise NotImplementedError

    def embed(self, tokens: Tensor, positions: Optional[Tensor]) -> Tensor:
        """x^0: tokens [bsz, tgt_len] -> [tgt_len, bsz, embed_dim], as fairseq's decoder embeds them."""
        x = self.embed_scale * self.embed_tokens(tokens)
        if self.quant_noise is not None:
            x = self.quant_noise(x)
        if self.project_in_dim is not None:
            x = self.project_in_dim(x)
        if positions is not None:
            x = x + positions
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        return self.emb_dropout_module(self.dropout_module(x)).transpose(0, 1)

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, features_only=False,
                stream_state=None, alignment_layer=None, alignment_heads=None, **unused):
        x, extra = self.extract_features(prev_output_tokens, encoder_out, incremental_state, stream_state,
                                         alignment_layer, alignment_heads)
        return (x if features_only else self.output_layer(x)), extra

    def extract_features(
        self,
        prev_output_tokens: Tensor,
        encoder_out: Optional[Dict[str, List[Tensor]]] = None,
        incremental_state: Optional[IncrementalState] = None,
        stream_state: Optional[StreamState] = None,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
        **unused,
    ):
        """fairseq's decoder protocol, and the streaming LM task's.

        Args:
            prev_output_tokens: [bsz, tgt_len] (in incremental decoding, every
                token so far; the call feeds the last).
            encoder_out: fairseq's encoder output (its "encoder_out":
                [src_len, bsz, embed_dim]), or None for a language model.
            incremental_state: fairseq's decoding protocol: each call after the
                first feeds its last token.
            stream_state: a language model's stream, block after block (the
                decoder carries its memory there: StreamState).
            alignment_layer, alignment_heads: as fairseq's TransformerDecoder
                takes them: in incremental decoding, "attn" holds the
                encoder attention of this layer (None: the top one), averaged
                over its first `alignment_heads` heads (None: all), which
                fairseq-generate --print-alignment prints.

        Returns:
            the features [bsz, tgt_len, embed_dim], and fairseq's extra
            outputs: "attn", [bsz, tgt_len, src_len] in incremental decoding
            with an encoder ([None] otherwise), and "inner_states".
        """
        decoding = self.get_incremental_state(incremental_state, "decoding")
        tokens = prev_output_tokens if decoding is None else prev_output_tokens[:, -1:]
        positions = None
        if self.embed_positions is not None:
            positions = self.embed_positions(
                prev_output_tokens, incremental_state=None if decoding is None else incremental_state
            )[:, -tokens.size(1):]
        x = self.embed(tokens, positions)

        if decoding is None:
            hypotheses = self._count_hypotheses_per_sentence(incremental_state, encoder_out)
            encoder_kv = self._encoder_keys_values(encoder_out, hypotheses)
            self.set_incremental_state(incremental_state, "decoding", {  # the count on the CPU, read without waiting
                "encoder_keys_values": encoder_kv, "hypotheses_per_sentence": torch.tensor(hypotheses, device="cpu")})
        else:
            encoder_kv = decoding["encoder_keys_values"]
        encoder_bias = self._encoder_attention_mask(encoder_out, encoder_kv)
        alignment = None
        if incremental_state is not None and encoder_kv is not None:
            alignment = Alignment(self.num_layers - 1 if alignment_layer is None else alignment_layer, alignment_heads)
        x = self.decode(x, self._sampled_layers(), encoder_kv, encoder_bias, incremental_state, stream_state,
                        alignment)

        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = self.emb_dropout_module(x).transpose(0, 1)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        attn = None if alignment is None else alignment.weights().transpose(0, 1).to(x)
        return x, {"attn": [attn], "inner_states": [x]}

    def _sampled_layers(self) -> List[Optional[MemoryDecoderLayer]]:
        """Every layer, None where LayerDrop leaves it out of this pass: a
        left-out layer passes its input on."""
        kept = {id(layer) for layer in self.layers}  # in training, LayerDrop's list samples as it iterates
        return [layer if id(layer) in kept else None for layer in map(self.layers.__getitem__, range(self.num_layers))]

    # --- spans and relative positions -----------------------------------------------------------

    def _span_masks(self):
        return [self.layers[i].self_attn.span_mask for i in range(self.num_layers)
                if self.layers[i].self_attn.span_mask is not None]

    def current_span(self) -> int:
        """How many slots a step attends to: --memory-span, or with adaptive
        spans what the widest head reaches; the memory kept is trimmed to it."""
        masks = self._span_masks()
        return max(mask.current_span() for mask in masks) if masks else self.span

    def span_loss(self) -> Optional[Tensor]:
        """The adaptive-span loss, or None."""
        if not self.span_loss_coefficient:
            return None
        return self.span_loss_coefficient * sum(mask.loss() for mask in self._span_masks())

    def clamp_spans(self):
        for mask in self._span_masks():
            mask.clamp_()

    def max_positions(self):
        """Relative positions set no limit on the length; absolute ones do."""
        return super().max_positions() if self.embed_positions is not None else sys.maxsize

    # --- the encoder's keys and values ----------------------------------------------------------

    def set_beam_size(self, beam_size):
        super().set_beam_size(beam_size)
        self.beam_size = beam_size

    def _count_hypotheses_per_sentence(self, incremental_state, encoder_out) -> int:
        """Beam search lays out each sentence's hypotheses as consecutive rows
        with the same source: its encoder keys/values are needed once. The beam
        size outlives the search that set it, so the layout is checked."""
        beam = getattr(self, "beam_size", 1)
        if incremental_state is None or beam == 1 or encoder_out is None or not encoder_out["encoder_out"]:
            return 1
        enc = encoder_out["encoder_out"][0]
        src_len, bsz, dim = enc.shape
        grouped = bsz % beam == 0 and bool((enc.view(src_len, -1, beam, dim) == enc[:, ::beam, None]).all())
        return beam if grouped else 1

    def _encoder_keys_values(self, encoder_out, hypotheses_per_sentence: int) -> Optional[Tensor]:
        """Keys and values of the encoder output for every layer, projected once
        per sentence: [layers, 2, sentences, num_heads, src_len, head_dim]."""
        if encoder_out is None or len(encoder_out["encoder_out"]) == 0 or self.layers[0].encoder_attn is None:
            return None
        enc = encoder_out["encoder_out"][0][:, ::hypotheses_per_sentence]
        return torch.stack([self.layers[i].encoder_keys_values(enc) for i in range(self.num_layers)])

    @staticmethod
    def _encoder_attention_mask(encoder_out, encoder_kv) -> Optional[Tensor]:
        if encoder_kv is None or len(encoder_out.get("encoder_padding_mask", [])) == 0:
            return None
        padding = encoder_out["encoder_padding_mask"][0]
        padding = padding[:: padding.size(0) // encoder_kv.size(2)]  # one row per sentence
        bias = torch.zeros(padding.shape, dtype=encoder_kv.dtype, device=encoder_kv.device)
        return bias.masked_fill_(padding, float("-inf"))[:, None, None, :]  # [sentences, 1, 1, src_len]

    def hypotheses_per_sentence(self, incremental_state: IncrementalState) -> int:
        """Rows that share one sentence's encoder keys/values (beam search's hypotheses), or 1."""
        return int(self.get_incremental_state(incremental_state, "decoding")["hypotheses_per_sentence"])

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor):
        """The encoder's keys and values; the memory's are reordered by the
        modules that cache them (fairseq calls each module's reorder)."""
        decoding = self.get_incremental_state(incremental_state, "decoding")
        if decoding is None or decoding["encoder_keys_values"] is None:
            return
        encoder_kv, hypotheses = decoding["encoder_keys_values"], int(decoding["hypotheses_per_sentence"])
        if hypotheses == 1:
            encoder_kv = encoder_kv.index_select(2, new_order)
        elif len(new_order) != encoder_kv.size(2) * hypotheses:
            # stored per sentence: only a finished sentence changes it
            encoder_kv = encoder_kv.index_select(2, new_order.view(-1, hypotheses)[:, 0] // hypotheses)
        decoding["encoder_keys_values"] = encoder_kv
