"""The Feedback Transformer decoder (Fan et al. 2020, section 3.3).

Every layer attends to one shared memory of past steps instead of the past
states of its own input. Step t reads m_{t-span} .. m_{t-1}; its own states
reach the layers above through the residual stream. The memory begins with
one zero vector, m_{-1}, so that step 0 has something to attend to (no empty
softmax): the same at every position, in training and in decoding.

Training, teacher-forced decoding and incremental decoding all run the same
per-token loop (`_step_by_step`); the incremental state is that loop's memory
(one key/value buffer for all layers) carried from one call to the next. The
transformer baseline (--no-feedback) needs no loop outside decoding and
computes a block at once (`_transformer_block`), with the same numbers.
"""

import sys
from typing import Dict, List, Optional

import torch
from fairseq.models.transformer import TransformerDecoderBase
from torch import Tensor, nn

from ..modules.feedback_attention import MemoryView
from ..modules.feedback_decoder_layer import FeedbackDecoderLayer
from ..modules.feedback_memory import FeedbackMemory
from ..modules.key_value_buffer import KeyValueBuffer

IncrementalState = Dict[str, Dict[str, Optional[Tensor]]]


class FeedbackDecoder(TransformerDecoderBase):
    """`cfg` is fairseq's TransformerConfig with the FeedbackConfig fields on it."""

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn, output_projection)
        self.span = cfg.memory_span
        self.feedback = not cfg.no_feedback
        heads = cfg.decoder.attention_heads
        head_dim = cfg.head_dim or self.embed_dim // heads
        self.memory = FeedbackMemory(
            self.embed_dim, self.num_layers, heads, head_dim, shared_kv=not cfg.per_layer_kv,
            normalize_before=cfg.decoder.normalize_before, composition=cfg.memory_composition,
        ) if self.feedback else None
        self.span_loss_coefficient = cfg.adaptive_span_loss if cfg.adaptive_span else 0.0
        # the last row embeds the nearest key (distance 1 for the feedback memory,
        # 0 for the baseline, which attends to itself): a window's last rows line up
        self.key_positions = (
            nn.Parameter(torch.randn(self.span, head_dim) * head_dim**-0.5)
            if cfg.relative_positions else None
        )

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return FeedbackDecoderLayer(cfg, no_encoder_attn)

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

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, features_only=False,
                stream_state=None, **unused):
        x, extra = self.extract_features(prev_output_tokens, encoder_out, incremental_state, stream_state)
        return (x if features_only else self.output_layer(x)), extra

    def extract_features(
        self,
        prev_output_tokens: Tensor,
        encoder_out: Optional[Dict[str, List[Tensor]]] = None,
        incremental_state: Optional[IncrementalState] = None,
        stream_state: Optional[Dict[str, Tensor]] = None,
        **unused,
    ):
        """`incremental_state`: fairseq's decoding protocol; the memory's keys
        and values carry over and each call after the first feeds its last token.
        `stream_state`: a language model's stream, block after block; the memory
        vectors carry over (detached) and are projected again with the current
        weights, as in the official code and Transformer-XL."""
        state = self.get_incremental_state(incremental_state, "memory")
        new_tokens = prev_output_tokens if state is None else prev_output_tokens[:, -1:]
        positions = None
        if self.embed_positions is not None:
            positions = self.embed_positions(
                prev_output_tokens, incremental_state=None if state is None else incremental_state
            )[:, -new_tokens.size(1):]
        x = self.embed(new_tokens, positions)
        steps, batch, _ = x.shape

        span = self.current_span()
        carried = None if stream_state is None else stream_state.get("memory")
        if state is None:
            encoder_kv = self._encoder_keys_values(encoder_out, self._sentence_rows(incremental_state, encoder_out))
        else:
            encoder_kv = state["encoder_kv"]
        encoder_bias = self._encoder_attention_mask(encoder_out, encoder_kv)
        layers = list(self.layers)  # in training, LayerDrop leaves some out here
        active = [self.layers[i] in layers for i in range(self.num_layers)]
        layer_encoder_kv = [None] * self.num_layers if encoder_kv is None else encoder_kv.unbind()

        if not self.feedback and incremental_state is None:
            x, block_memory = self._transformer_block(x, carried, span, active, layer_encoder_kv, encoder_bias)
        else:
            if state is None:
                room = 0 if incremental_state is None else 16  # decoding appends later
                memories, window = self._start_memories(carried, batch, steps + room, span)
            else:
                memories = self._memories_in(state)
                window = memories[0].window(span)
            x, block_memory = self._step_by_step(x, memories, window, span, active, layer_encoder_kv, encoder_bias,
                                                 keep_last_memory=incremental_state is not None,
                                                 keep_block_memory=stream_state is not None)
            if incremental_state is not None:
                self.set_incremental_state(
                    incremental_state, "memory", {**self._memory_state(memories), "encoder_kv": encoder_kv}
                )
        if stream_state is not None:
            stream_state["memory"] = self._next_stream_memory(carried, block_memory, batch)

        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return x, {"attn": [None], "inner_states": [x]}

    def _step_by_step(self, x, memories, window, span, active, layer_encoder_kv, encoder_bias, keep_last_memory,
                      keep_block_memory):
        """The per-token loop: the feedback model in training and decoding, and
        the baseline in decoding. Returns the top layer's outputs [time, batch,
        embed] and what the next block's memory is made of."""
        steps = x.size(0)
        mix = self.memory.mixing_weights().unbind() if self.feedback else None
        add_positions = self._position_table()
        all_layers = [self.layers[i] for i in range(self.num_layers)]
        span_biases = [layer.self_attn.span_mask.bias(span) if layer.self_attn.span_mask else None for layer in all_layers]
        persistent = [layer.self_attn.persistent() for layer in all_layers]
        outputs, block_memory = [], []
        for t, h in enumerate(x.unbind(0)):  # not x[t]: each index's backward fills a gradient of all of x
            if self.feedback:
                m = h * mix[0]
                # positions join the keys once per projection, not once per layer
                layer_kv = [(add_positions(k), v) for k, v in self.memory.keys_values(window)]
            for i, layer in enumerate(all_layers):
                if not active[i]:
                    if self.feedback:
                        m = torch.addcmul(m, h, mix[i + 1])  # eq. 1; a dropped layer passes its input on
                    continue
                if self.feedback:
                    keys, values = layer_kv[0 if self.memory.shared_kv else i]
                else:  # the baseline: a layer attends to its own input's past, itself included
                    keys, values = memories[i].append(layer.project_own_memory(h.unsqueeze(0)), span)
                    keys = add_positions(keys)
                bias = span_biases[i]
                if bias is not None and bias.size(-1) != keys.size(2):
                    bias = bias[..., -keys.size(2):]
                h = layer.forward_memory(h, MemoryView(keys, values, bias, persistent[i]), layer_encoder_kv[i],
                                         encoder_bias)
                if self.feedback:
                    m = torch.addcmul(m, h, mix[i + 1])  # eq. 1
            outputs.append(h)
            if self.feedback:
                if keep_block_memory:
                    block_memory.append(m)
                if t < steps - 1 or keep_last_memory:
                    window = memories[0].append(self.memory.project(m.unsqueeze(0)), span)
        return torch.stack(outputs), (torch.stack(block_memory) if block_memory else None)

    def _transformer_block(self, x, carried, span, active, layer_encoder_kv, encoder_bias):
        """The transformer baseline over a whole block at once, as Transformer-XL
        computes it: each layer's queries attend to that layer's inputs at the
        last `span` positions, themselves included, the previous block's carried
        over. The same numbers as the per-token loop (tests); no loop.
        Returns the top layer's outputs and every layer's inputs [layers, time,
        batch, embed] (the next block's memory)."""
        steps = x.size(0)
        layer_inputs = []
        for i in range(self.num_layers):
            layer, attn = self.layers[i], self.layers[i].self_attn
            layer_inputs.append(x)
            if not active[i]:
                continue
            previous = carried[i, max(0, carried.size(1) - (span - 1)):] if carried is not None else x[:0]
            context = torch.cat([previous, x])  # once per block and layer
            keys, values = layer.project_own_memory(context).permute(1, 2, 3, 0, 4).unbind(0)
            distance = (torch.arange(steps, device=x.device)[:, None] + len(previous)
                        - torch.arange(len(context), device=x.device)[None, :])
            bias = x.new_zeros(distance.shape).masked_fill((distance < 0) | (distance >= span), float("-inf"))
            row = (self.span - 1 - distance).clamp(0, self.span - 1)  # the table row of each distance
            if attn.span_mask is not None:
                bias = bias + attn.span_mask.bias(self.span)[:, 0][:, row]
            positions = None if self.key_positions is None else (self.key_positions, row)
            memory = MemoryView(keys, values, bias, attn.persistent(), positions)
            x = layer.forward_memory(x, memory, layer_encoder_kv[i], encoder_bias)
        return x, torch.stack(layer_inputs)

    @staticmethod
    def _memory_state(memories: List[KeyValueBuffer]) -> Dict[str, Tensor]:
        state = {f"memory{i}": memory.slots for i, memory in enumerate(memories)}
        state["length"] = torch.tensor(memories[0].length)  # on the CPU: reading it never syncs a GPU
        return state

    @staticmethod
    def _memories_in(state) -> List[KeyValueBuffer]:
        length = int(state["length"])
        return [KeyValueBuffer(state[key], length) for key in sorted(state) if key.startswith("memory")]

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

    def _position_table(self):
        """k_j + p_{t-j}: relative positions are key-side embeddings shared by
        all layers and heads, so q.(k + p) = q.k + q.p adds them to the keys.
        The table is sliced only while the memory is shorter than the span
        (each slice costs a gradient of the whole table)."""
        table = self.key_positions
        if table is None:
            return lambda keys: keys
        return lambda keys: keys + (table if keys.size(2) == self.span else table[-keys.size(2):])

    def _start_memories(self, carried: Optional[Tensor], batch: int, steps: int, span: int):
        """Key/value buffers, and the window step 0 reads. Feedback: one buffer,
        starting with the carried memory vectors or m_{-1} = 0. Baseline: one
        buffer per layer, starting with the layer's carried inputs; each step
        appends its own input before reading, so there is no window yet."""
        if self.feedback:
            initial = carried[-span:] if carried is not None else self._zero_memory(batch)
            kv = self.memory.project(initial)
            memory = KeyValueBuffer.empty(kv.size(0) + steps, like=kv)
            return [memory], memory.append(kv, span)
        memories = []
        for i in range(self.num_layers):
            initial = carried[i, -span:] if carried is not None else self._zero_memory(batch)[:0]
            kv = self.layers[i].project_own_memory(initial)
            memories.append(KeyValueBuffer.empty(kv.size(0) + steps, like=kv))
            memories[-1].append(kv, span)
        return memories, None

    def _next_stream_memory(self, carried: Optional[Tensor], block: Tensor, batch: int) -> Tensor:
        """The last `span` memory vectors (feedback: [slots, batch, embed]) or
        layer inputs (baseline: [layers, slots, batch, embed]), detached."""
        if self.feedback:
            previous = carried if carried is not None else self._zero_memory(batch)
            return torch.cat([previous, block])[-self.span :].detach()
        memory = block if carried is None else torch.cat([carried, block], dim=1)
        return memory[:, -self.span :].detach()

    def _zero_memory(self, batch: int) -> Tensor:
        """m_{-1}, in the model's dtype and device."""
        return next(self.parameters()).new_zeros(1, batch, self.embed_dim)

    def max_positions(self):
        """Relative positions set no limit on the length; absolute ones do."""
        return super().max_positions() if self.embed_positions is not None else sys.maxsize

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
        rows = state["memory0"].size(2)
        memories = [memory.reorder(new_order, self.current_span()) for memory in self._memories_in(state)]
        state.update(self._memory_state(memories))
        encoder_kv = state["encoder_kv"]
        if encoder_kv is not None and encoder_kv.size(2) == rows:
            state["encoder_kv"] = encoder_kv.index_select(2, new_order)
        elif encoder_kv is not None and len(new_order) != rows:
            # stored per sentence: only a finished sentence changes it
            beam = rows // encoder_kv.size(2)
            state["encoder_kv"] = encoder_kv.index_select(2, new_order.view(-1, beam)[:, 0] // beam)
        self.set_incremental_state(incremental_state, "memory", state)
