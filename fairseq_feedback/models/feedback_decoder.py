"""The Feedback Transformer decoder (Fan et al. 2020, section 3.3).

Every layer attends to one shared memory of past steps instead of the past
states of its own input. Step t reads m_{t-span} .. m_{t-1}; its own states
reach the layers above through the residual stream. The memory begins with
one zero vector, m_{-1}, so that step 0 has something to attend to (no empty
softmax): the same at every position, in training and in decoding.

Training, teacher-forced decoding and incremental decoding all run the loop in
`extract_features_scriptable`; the incremental state is that loop's memory
(one key/value buffer for all layers) carried from one call to the next.
"""

from typing import Dict, List, Optional

import torch
from fairseq.models.transformer import TransformerDecoderBase
from torch import Tensor, nn

from ..modules.feedback_decoder_layer import FeedbackDecoderLayer
from ..modules.feedback_memory import FeedbackMemory
from ..modules.key_value_buffer import KeyValueBuffer

IncrementalState = Dict[str, Dict[str, Optional[Tensor]]]


class FeedbackDecoder(TransformerDecoderBase):
    """`cfg` is fairseq's TransformerConfig with the FeedbackConfig fields on it."""

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn, output_projection)
        self.span = cfg.memory_span
        heads = cfg.decoder.attention_heads
        head_dim = cfg.head_dim or self.embed_dim // heads
        self.memory = FeedbackMemory(
            self.embed_dim, self.num_layers, heads, head_dim,
            shared_kv=not cfg.per_layer_kv, normalize_before=cfg.decoder.normalize_before,
        )
        # row span - d embeds distance d, so a window's last rows line up with it
        self.key_positions = (
            nn.Parameter(torch.randn(self.span, head_dim) * head_dim**-0.5)
            if cfg.relative_positions else None
        )

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return FeedbackDecoderLayer(cfg, no_encoder_attn, memory_head_dim=cfg.head_dim)

    def embed(self, tokens: Tensor, positions: Optional[Tensor]) -> Tensor:
        """x^0: tokens [batch, time] -> [time, batch, embed], as fairseq's decoder embeds them."""
        x = self.embed_scale * self.embed_tokens(tokens)
        if self.quant_noise is not None:
            x = self.quant_noise(x)
        if self.project_in_dim is not None:
            x = self.project_in_dim(x)
        if positions is not None:
            x = x + positions
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        return self.dropout_module(x).transpose(0, 1)

    def extract_features_scriptable(
        self,
        prev_output_tokens: Tensor,
        encoder_out: Optional[Dict[str, List[Tensor]]] = None,
        incremental_state: Optional[IncrementalState] = None,
        full_context_alignment: bool = False,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
    ):
        state = self.get_incremental_state(incremental_state, "memory")
        # like fairseq's decoders, a call that continues a state feeds only its last token
        new_tokens = prev_output_tokens if state is None else prev_output_tokens[:, -1:]
        positions = None
        if self.embed_positions is not None:
            positions = self.embed_positions(
                prev_output_tokens, incremental_state=None if state is None else incremental_state
            )[:, -new_tokens.size(1):]
        x = self.embed(new_tokens, positions)
        steps, batch, _ = x.shape

        if state is None:
            # the buffer holds m_{-1} and one slot per step: never grown while
            # autograd holds views of it; decoding gets room to append to
            room = 0 if incremental_state is None else 16
            kv = self.memory.project(x.new_zeros(1, batch, self.embed_dim))
            memory = KeyValueBuffer.empty(1 + steps + room, like=kv)
            window = memory.append(kv, self.span)
            encoder_kv = self._encoder_keys_values(encoder_out, self._sentence_rows(incremental_state, encoder_out))
        else:
            memory = KeyValueBuffer(state["memory"], int(state["length"]))
            window = memory.window(self.span)
            encoder_kv = state["encoder_kv"]
        encoder_bias = self._encoder_attention_mask(encoder_out, encoder_kv)

        layers = list(self.layers)  # in training, LayerDrop leaves some out here
        active = [i for i in range(self.num_layers) if self.layers[i] in layers]
        mix = self.memory.mixing_weights(active).unbind()
        layer_encoder_kv = [None if encoder_kv is None else encoder_kv[i] for i in active]
        keep_last_memory = incremental_state is not None

        outputs = []
        for t in range(steps):
            h = x[t]
            m = h * mix[0]
            layer_kv = self.memory.keys_values(window)
            positions = None if self.key_positions is None else self.key_positions[-window.size(0):]
            for j, (index, layer) in enumerate(zip(active, layers)):
                keys, values = layer_kv[index]
                h = layer.step(h, keys, values, positions, layer_encoder_kv[j], encoder_bias)
                m = torch.addcmul(m, h, mix[j + 1])  # eq. 1, accumulated layer by layer
            outputs.append(h)
            if t < steps - 1 or keep_last_memory:
                window = memory.append(self.memory.project(m.unsqueeze(0)), self.span)

        if incremental_state is not None:
            self.set_incremental_state(incremental_state, "memory", {
                "memory": memory.slots,
                "length": torch.tensor(memory.length),  # on the CPU: reading it never syncs a GPU
                "encoder_kv": encoder_kv,
            })

        x = torch.stack(outputs)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return x, {"attn": [None], "inner_states": [x]}

    def set_beam_size(self, beam_size):
        super().set_beam_size(beam_size)
        self.beam_size = beam_size

    def _sentence_rows(self, incremental_state, encoder_out) -> slice:
        """Beam search lays out each sentence's hypotheses as consecutive rows
        with the same source: its encoder keys/values are needed once. The beam
        size outlives the search that set it, so the layout is checked."""
        beam = getattr(self, "beam_size", 1)
        if incremental_state is None or beam == 1 or encoder_out is None or not encoder_out["encoder_out"]:
            return slice(None)
        enc = encoder_out["encoder_out"][0]
        src_len, rows, dim = enc.shape
        grouped = rows % beam == 0 and bool((enc.view(src_len, -1, beam, dim) == enc[:, ::beam, None]).all())
        return slice(None, None, beam) if grouped else slice(None)

    def _encoder_keys_values(self, encoder_out, sentence_rows: slice) -> Optional[Tensor]:
        """Keys and values of the encoder output for every layer, projected once
        per sentence: [layers, 2, batch, heads, src_len, head_dim]."""
        if encoder_out is None or len(encoder_out["encoder_out"]) == 0 or self.layers[0].encoder_attn is None:
            return None
        enc = encoder_out["encoder_out"][0][:, sentence_rows]
        return torch.stack([self.layers[i].encoder_keys_values(enc) for i in range(self.num_layers)])

    @staticmethod
    def _encoder_attention_mask(encoder_out, encoder_kv) -> Optional[Tensor]:
        if encoder_kv is None or len(encoder_out.get("encoder_padding_mask", [])) == 0:
            return None
        padding = encoder_out["encoder_padding_mask"][0]
        padding = padding[:: padding.size(0) // encoder_kv.size(2)]  # one row per sentence
        bias = torch.zeros(padding.shape, dtype=encoder_kv.dtype, device=encoder_kv.device)
        return bias.masked_fill_(padding, float("-inf"))[:, None, None, :]  # [batch, 1, 1, src_len]

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor):
        state = self.get_incremental_state(incremental_state, "memory")
        if state is None:
            return
        rows = state["memory"].size(2)
        memory = KeyValueBuffer(state["memory"], int(state["length"])).reorder(new_order, self.span)
        state["memory"], state["length"] = memory.slots, torch.tensor(memory.length)
        encoder_kv = state["encoder_kv"]
        if encoder_kv is not None and encoder_kv.size(2) == rows:
            state["encoder_kv"] = encoder_kv.index_select(2, new_order)
        elif encoder_kv is not None and len(new_order) != rows:
            # stored per sentence: only a finished sentence changes it
            beam = rows // encoder_kv.size(2)
            state["encoder_kv"] = encoder_kv.index_select(2, new_order.view(-1, beam)[:, 0] // beam)
        self.set_incremental_state(incremental_state, "memory", state)
