"""The feedback language model: a Feedback Transformer decoder on its own.

Built like fairseq's transformer_lm (plain, adaptive or character input
embeddings, adaptive softmax), with the paper's language-model choices by
default: pre-norm layers and learned relative positions over the span.
With --no-feedback the same model is the paper's transformer baseline.
"""

import argparse
from dataclasses import dataclass, field
from typing import Dict
from unittest import mock

from fairseq.models import register_model, register_model_architecture
from omegaconf import II
from fairseq.models import transformer_lm
from fairseq.models.transformer_lm import (
    TransformerLanguageModel,
    TransformerLanguageModelConfig,
    base_lm_architecture,
)
from torch import Tensor

from .feedback_config import FeedbackConfig, check_dictionary_sizes, check_feedback_args, decoder_config
from .feedback_decoder import FeedbackDecoder
from .feedback_transformer import feedback_defaults


def _boolean(value: str) -> bool:
    if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected True or False, got {value!r}")
    return value.lower() in ("true", "1", "yes")


def _default(name, value):
    """The field `name` of the parent configs, with another default."""
    parent = {**TransformerLanguageModelConfig.__dataclass_fields__, **FeedbackConfig.__dataclass_fields__}[name]
    return field(default=value, metadata=parent.metadata)


@dataclass
class FeedbackLanguageModelConfig(FeedbackConfig, TransformerLanguageModelConfig):
    """Architecture `feedback_lm`: a small model with the paper's language-model
    choices, pre-norm layers and relative positions (Table 9)."""

    decoder_layers: int = _default("decoder_layers", 4)
    decoder_embed_dim: int = _default("decoder_embed_dim", 256)
    decoder_input_dim: int = _default("decoder_input_dim", II("model.decoder_embed_dim"))
    decoder_output_dim: int = _default("decoder_output_dim", II("model.decoder_embed_dim"))
    decoder_ffn_embed_dim: int = _default("decoder_ffn_embed_dim", 1024)
    decoder_attention_heads: int = _default("decoder_attention_heads", 4)
    decoder_normalize_before: bool = _default("decoder_normalize_before", True)
    no_token_positional_embeddings: bool = _default("no_token_positional_embeddings", True)
    relative_positions: bool = _default("relative_positions", True)
    memory_span: int = _default("memory_span", 256)


@register_model("feedback_lm", dataclass=FeedbackLanguageModelConfig)
class FeedbackLanguageModel(TransformerLanguageModel):
    def __init__(self, decoder):
        super().__init__(decoder)
        # stream name -> the memory carried from its previous block; not saved
        # in checkpoints (a resumed run starts its next block with fresh memory)
        self.streams: Dict[str, Dict[str, Tensor]] = {}

    @classmethod
    def hub_models(cls):
        return {}

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        # fairseq makes a boolean option whose default is True a flag that turns
        # it off; for the paper's defaults here the flag keeps its name's meaning
        # and an explicit value turns it off: --decoder-normalize-before False
        handler, parser.conflict_handler = parser.conflict_handler, "resolve"
        for name in ("decoder_normalize_before", "relative_positions", "no_token_positional_embeddings"):
            parser.add_argument("--" + name.replace("_", "-"), type=_boolean, nargs="?", const=True,
                                metavar="BOOL", help=_default(name, None).metadata["help"] + " (default: True)")
        parser.conflict_handler = handler

    @classmethod
    def build_model(cls, args, task):
        feedback_defaults(args)
        check_feedback_args(args)
        # fairseq's transformer_lm builds the embeddings (plain, adaptive or
        # character) and checks the adaptive options with no hook for another
        # decoder; let it, with the feedback decoder in place of its own
        def feedback_decoder(args, dictionary, embed_tokens, no_encoder_attn):
            return FeedbackDecoder(decoder_config(args), dictionary, embed_tokens, no_encoder_attn)

        with mock.patch.object(transformer_lm, "TransformerDecoder", feedback_decoder):
            return super().build_model(args, task)

    def forward(self, src_tokens, src_lengths=None, stream=None, block=None, **kwargs):
        """`stream` names a stream the feedback_language_modeling task delivers
        block by block; `block` is the block's number in it. The memory left by
        block k-1 of the same stream is carried into block k; block 0 starts
        fresh. Without them the call is self-contained (hub scoring, tests)."""
        state = None
        if stream is not None:
            if block == 0 or stream not in self.streams:
                self.streams[stream] = {}
            state = self.streams[stream]
        return self.decoder(src_tokens, stream_state=state, **kwargs)

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        check_dictionary_sizes(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)


def _paper_lm_defaults(args):
    """The paper's language-model choices, on top of fairseq's transformer_lm
    defaults; options already set are kept."""
    args.relative_positions = getattr(args, "relative_positions", True)
    args.no_token_positional_embeddings = getattr(args, "no_token_positional_embeddings", True)
    args.decoder_normalize_before = getattr(args, "decoder_normalize_before", True)
    feedback_defaults(args)
    base_lm_architecture(args)
    check_feedback_args(args)


def _sizes(args, layers, embed_dim, ffn_dim, heads, span, dropout, head_dim=None):
    args.decoder_layers = getattr(args, "decoder_layers", layers)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", embed_dim)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", ffn_dim)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", heads)
    args.head_dim = getattr(args, "head_dim", head_dim)
    args.memory_span = getattr(args, "memory_span", span)
    args.dropout = getattr(args, "dropout", dropout)


def _adaptive_input_and_softmax(args, softmax_dropout):
    """As fairseq's transformer_lm_wiki103 uses them."""
    args.adaptive_input = getattr(args, "adaptive_input", True)
    args.tie_adaptive_weights = getattr(args, "tie_adaptive_weights", True)
    args.tie_adaptive_proj = getattr(args, "tie_adaptive_proj", True)
    args.adaptive_input_cutoff = getattr(args, "adaptive_input_cutoff", "20000,60000")
    args.adaptive_softmax_cutoff = getattr(args, "adaptive_softmax_cutoff", "20000,60000")
    args.adaptive_softmax_dropout = getattr(args, "adaptive_softmax_dropout", softmax_dropout)


@register_model_architecture("feedback_lm", "feedback_lm_wiki103")
def feedback_lm_wiki103(args):
    _sizes(args, layers=4, embed_dim=512, ffn_dim=4096, heads=8, span=512, dropout=0.1, head_dim=128)
    _adaptive_input_and_softmax(args, softmax_dropout=0.1)
    _paper_lm_defaults(args)


def _adaptive_span(args, loss):
    """The paper's long-span models learn each head's span (Sukhbaatar et al. 2019)."""
    args.adaptive_span = getattr(args, "adaptive_span", True)
    args.adaptive_span_loss = getattr(args, "adaptive_span_loss", loss)


@register_model_architecture("feedback_lm", "feedback_lm_wiki103_large")
def feedback_lm_wiki103_large(args):
    _sizes(args, layers=8, embed_dim=1024, ffn_dim=4096, heads=8, span=2048, dropout=0.3)
    _adaptive_span(args, loss=1e-5)
    _adaptive_input_and_softmax(args, softmax_dropout=0.2)
    _paper_lm_defaults(args)


@register_model_architecture("feedback_lm", "feedback_lm_enwik8")
def feedback_lm_enwik8(args):
    _sizes(args, layers=12, embed_dim=512, ffn_dim=4096, heads=8, span=8192, dropout=0.5, head_dim=128)
    _adaptive_span(args, loss=5e-7)
    _paper_lm_defaults(args)


@register_model_architecture("feedback_lm", "feedback_lm_toy")
def feedback_lm_toy(args):
    """The paper's algorithmic tasks (Table 9, first column)."""
    _sizes(args, layers=4, embed_dim=256, ffn_dim=1024, heads=4, span=100, dropout=0.2)
    _paper_lm_defaults(args)
