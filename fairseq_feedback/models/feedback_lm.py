"""The feedback language model: a Feedback Transformer decoder on its own.

Built like fairseq's transformer_lm (plain, adaptive or character input
embeddings, adaptive softmax), with the paper's language-model choices by
default: pre-norm layers and learned relative positions over the span.
With --no-feedback the same model is the paper's Transformer baseline.
"""

import argparse
import ast
from dataclasses import dataclass, field
from typing import Dict

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer_lm import (
    DEFAULT_MAX_TARGET_POSITIONS,
    TransformerLanguageModel,
    TransformerLanguageModelConfig,
    base_lm_architecture,
)
from fairseq.modules import AdaptiveInput, CharacterTokenEmbedder
from omegaconf import II

from ..errors import FeedbackUsageError
from .feedback_config import FeedbackConfig, check_feedback_args, decoder_config, feedback_architecture
from .memory_decoder import StreamState
from .plugin_model import PluginModel, build_decoder, check_model_and_task


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
    # The task's, as transformer_lm takes them, with a value where the task
    # has none: under another kind of task (a mistake) fairseq could not
    # compose the configuration, and the mistake would end in an interpolation
    # error rather than in the one line fairseq_fixes/command_line.py gives.
    add_bos_token: bool = _default("add_bos_token", "${oc.select:task.add_bos_token,false}")
    tokens_per_sample: int = _default("tokens_per_sample", "${oc.select:task.tokens_per_sample,1024}")


@register_model("feedback_lm", dataclass=FeedbackLanguageModelConfig)
class FeedbackLanguageModel(PluginModel, TransformerLanguageModel):
    language_model = True
    wrong_task = ("feedback_lm is a language model: use --task feedback_language_modeling "
                  "(the translation model is --arch feedback_transformer)")

    def __init__(self, decoder):
        super().__init__(decoder)
        # stream name -> what it carries from its previous block
        self.streams: Dict[str, StreamState] = {}

    @classmethod
    def add_args(cls, parser):
        # fairseq makes a boolean option whose default is True a flag that turns
        # it off; for the paper's defaults here the flag keeps its name's meaning
        # and an explicit value turns it off: --decoder-normalize-before False
        # (or --adaptive-span False: the long-span architectures' fixed span;
        # --per-layer-kv False: the character-level ones' shared projection).
        # Added first: fairseq's options from the dataclass skip a flag that exists.
        for name, default in (("decoder_normalize_before", "True"), ("relative_positions", "True"),
                              ("no_token_positional_embeddings", "True"), ("adaptive_span", "the architecture's"),
                              ("per_layer_kv", "the architecture's")):
            parser.add_argument("--" + name.replace("_", "-"), type=_boolean, nargs="?", const=True,
                                metavar="BOOL", help=_default(name, None).metadata["help"] + f" (default: {default})")
        super().add_args(parser)

    @classmethod
    def build_model(cls, args, task):
        check_model_and_task(cls, type(task))
        check_feedback_args(args)  # for what does not come through fairseq's tools (the hub, Python)
        if args.decoder_layers_to_keep:
            args.decoder_layers = len(args.decoder_layers_to_keep.split(","))
        if getattr(args, "max_target_positions", None) is None:
            args.max_target_positions = getattr(args, "tokens_per_sample", DEFAULT_MAX_TARGET_POSITIONS)
        embed_tokens = cls.build_input_embeddings(args, task.source_dictionary)
        return cls(build_decoder(decoder_config(args), task.target_dictionary, embed_tokens, no_encoder_attn=True))

    @classmethod
    def build_input_embeddings(cls, args, dictionary):
        """Character CNN, adaptive input or a plain table, as fairseq's
        transformer_lm builds them (literal_eval, where it has eval: a
        checkpoint's options must not run code)."""
        if args.character_embeddings:
            return CharacterTokenEmbedder(dictionary, ast.literal_eval(args.character_filters),
                                          args.character_embedding_dim, args.decoder_embed_dim,
                                          args.char_embedder_highway_layers)
        if args.tie_adaptive_weights and not (
            args.adaptive_input and args.adaptive_input_factor == args.adaptive_softmax_factor
            and args.adaptive_input_cutoff == args.adaptive_softmax_cutoff
            and args.decoder_input_dim == args.decoder_output_dim
        ):
            raise FeedbackUsageError("--tie-adaptive-weights needs --adaptive-input with the adaptive softmax's "
                                     "factor and cutoffs, and --decoder-input-dim equal to --decoder-output-dim")
        if args.adaptive_input:
            cutoff = ast.literal_eval(args.adaptive_input_cutoff)  # "20000,60000", as fairseq's eval_str_list reads it
            return AdaptiveInput(len(dictionary), dictionary.pad(), args.decoder_input_dim, args.adaptive_input_factor,
                                 args.decoder_embed_dim, list(cutoff) if isinstance(cutoff, tuple) else [cutoff],
                                 args.quant_noise_pq, args.quant_noise_pq_block_size)
        return cls.build_embedding(args, dictionary, args.decoder_input_dim)

    def forward(self, src_tokens, src_lengths=None, stream=None, block_index=None, **kwargs):
        """The decoder on a block of tokens, carrying its stream's memory.

        The memory left by block k-1 of a stream is carried into block k;
        block 0 starts fresh. Without a stream the call is self-contained (hub
        scoring, tests).

        Args:
            src_tokens: [bsz, tgt_len].
            src_lengths: unused (the blocks of a stream are not padded but at its end).
            stream: the name of a stream the feedback_language_modeling task
                delivers block by block (its split's), or None.
            block_index: the block's number k in the stream.

        Returns:
            the decoder's output and extra outputs, as fairseq's language models return them.
        """
        state = None
        if stream is not None:
            if block_index == 0 or stream not in self.streams:
                self.streams[stream] = StreamState()
            state = self.streams[stream]
        return self.decoder(src_tokens, stream_state=state, **kwargs)


# The paper's language-model choices (section 4, Table 9), on top of fairseq's
# transformer_lm defaults; options already set are kept.
PAPER_LM = dict(decoder_normalize_before=True, relative_positions=True, no_token_positional_embeddings=True)
# as fairseq's transformer_lm_wiki103 uses them
ADAPTIVE_INPUT_AND_SOFTMAX = dict(adaptive_input=True, tie_adaptive_weights=True, tie_adaptive_proj=True,
                                  adaptive_input_cutoff="20000,60000", adaptive_softmax_cutoff="20000,60000")


def _sizes(layers, embed_dim, ffn_dim, num_heads, head_dim=None):
    return dict(decoder_layers=layers, decoder_embed_dim=embed_dim, decoder_ffn_embed_dim=ffn_dim,
                decoder_attention_heads=num_heads, head_dim=head_dim)


def _dropout(rate, embeddings=0.0):
    """Table 9's dropout where the paper and the authors put it: "Dropouts are applied to attention and ReLU
    activations" (appendix 7.6; their main.py's --dropout is the "dropout rate of ReLU and attention": the
    attention probabilities and the feed-forward hidden layer), none on the residual branches (fairseq's
    --dropout); the WikiText-103 models' "Embed. dropout" on the embeddings and the top layer's output."""
    return dict(dropout=0.0, attention_dropout=rate, activation_dropout=rate, emb_dropout=embeddings)


@register_model_architecture("feedback_lm", "feedback_lm_wiki103")
def feedback_lm_wiki103(args):
    feedback_architecture(args, base_lm_architecture, **PAPER_LM, **ADAPTIVE_INPUT_AND_SOFTMAX,
                          **_sizes(4, 512, 4096, 8, head_dim=128), **_dropout(0.1, embeddings=0.1), memory_span=512)


# The paper's long-span models learn each head's span (Sukhbaatar et al. 2019);
# with --adaptive-span False they attend over a fixed span instead, Table 9's
# 512 for the large WikiText-103 model (its "512, 2048*", the ablation of Table 6).


def _learned_span(args, learned, loss, fixed):
    if getattr(args, "adaptive_span", None) is False:
        return dict(memory_span=fixed)
    return dict(memory_span=learned, adaptive_span=True, adaptive_span_loss=loss)


@register_model_architecture("feedback_lm", "feedback_lm_wiki103_large")
def feedback_lm_wiki103_large(args):
    feedback_architecture(args, base_lm_architecture, **PAPER_LM, **ADAPTIVE_INPUT_AND_SOFTMAX,
                          **_sizes(8, 1024, 4096, 8), **_dropout(0.3, embeddings=0.2),
                          **_learned_span(args, 2048, 1e-5, fixed=512))


# The character-level models of Table 9 project the memory's keys and values in
# each layer, as the official code does by default (no --share-proj-kv in its
# enwik8 script): the parameters Table 9 counts, 77M and 10.7M.


@register_model_architecture("feedback_lm", "feedback_lm_enwik8")
def feedback_lm_enwik8(args):
    feedback_architecture(args, base_lm_architecture, **PAPER_LM,
                          **_sizes(12, 512, 4096, 8, head_dim=128), **_dropout(0.5), per_layer_kv=True,
                          **_learned_span(args, 8192, 5e-7, fixed=8192))


@register_model_architecture("feedback_lm", "feedback_lm_char_ptb")
def feedback_lm_char_ptb(args):
    feedback_architecture(args, base_lm_architecture, **PAPER_LM, **_sizes(6, 384, 1536, 4), **_dropout(0.5),
                          per_layer_kv=True, memory_span=512)


@register_model_architecture("feedback_lm", "feedback_lm_toy")
def feedback_lm_toy(args):
    """The paper's algorithmic tasks (Table 9, first column)."""
    feedback_architecture(args, base_lm_architecture, **PAPER_LM, **_sizes(4, 256, 1024, 4), **_dropout(0.2),
                          memory_span=100)
