"""Options of the feedback decoders, shared by the translation model and the LM:
their defaults and checks (one path for every architecture), and the choice
between the feedback decoder and its Transformer baseline."""

from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass import FairseqDataclass

from ..errors import FeedbackUsageError
from ..modules.feedback_memory import composition_layer
from .feedback_decoder import FeedbackDecoder
from .transformer_xl_decoder import TransformerXLDecoder


@dataclass
class FeedbackConfig(FairseqDataclass):
    memory_span: int = field(
        default=1024,
        metadata={"help": "how many past memory vectors each step attends to (the paper's attention span)"},
    )
    per_layer_kv: bool = field(
        default=False,
        metadata={"help": "give each layer its own key/value projection of the memory "
                          "(default: one projection shared by all layers, the paper's fast variant)"},
    )
    head_dim: Optional[int] = field(
        default=None,
        metadata={"help": "dimension of each memory-attention head (default: embed dim / heads)"},
    )
    no_feedback: bool = field(
        default=False,
        metadata={"help": "the transformer baseline: each layer attends to the past of its own input "
                          "(Transformer-XL caching), through the same code, cache and task"},
    )
    relative_positions: bool = field(
        default=False,
        metadata={"help": "add learned key-side relative position embeddings over the span, "
                          "shared by all layers and heads (the paper's language models)"},
    )
    memory_composition: str = field(
        default="weighted",
        metadata={"help": "how the memory combines the layers (paper, Figures 5 and 8): 'weighted' "
                          "(eq. 1, learned softmax weights), 'average', 'top' (the last layer only), or "
                          "'layer:K' (layer K only; 0 is the embeddings)"},
    )
    adaptive_span: bool = field(
        default=False,
        metadata={"help": "learn each head's span up to --memory-span (Sukhbaatar et al. 2019); "
                          "the memory kept is what the widest head reaches"},
    )
    adaptive_span_ramp: int = field(default=32, metadata={"help": "length of the adaptive span's soft ramp"})
    adaptive_span_init: float = field(default=0.0, metadata={"help": "initial span, as a fraction of --memory-span"})
    adaptive_span_loss: float = field(
        default=0.0,
        metadata={"help": "coefficient of the span loss, memory span x mean span fraction per layer, added to "
                          "the training loss by this plugin's tasks and logged as span_loss"},
    )
    persistent_vectors: int = field(
        default=0,
        metadata={"help": "learned key/value vectors per head that every step also attends to "
                          "(Sukhbaatar et al. 2019, all-attention)"},
    )
    no_feed_forward: bool = field(
        default=False,
        metadata={"help": "drop the feed-forward sublayers (with --persistent-vectors: all-attention layers)"},
    )
    no_cuda_graphs: bool = field(
        default=False,
        metadata={"help": "on a GPU, run the feedback decoder's per-token loop eagerly instead of replaying it as "
                          "captured CUDA graphs (the same numbers, many times slower; fairseq-generate and "
                          "eval-lm: --model-overrides \"{'no_cuda_graphs': True}\")"},
    )


def decoder_config(args):
    """fairseq's TransformerConfig for the decoder, with the feedback options
    on it (from_namespace drops unknown options of a DictConfig)."""
    from fairseq.models.transformer import TransformerConfig

    cfg = TransformerConfig.from_namespace(args)
    for name in FeedbackConfig.__dataclass_fields__:
        if not name.startswith("_"):
            setattr(cfg, name, getattr(args, name))
    return cfg


def build_decoder(cfg, dictionary, embed_tokens, no_encoder_attn=False):
    """The feedback decoder, or with --no-feedback the paper's Transformer baseline."""
    decoder = TransformerXLDecoder if cfg.no_feedback else FeedbackDecoder
    return decoder(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn)


def feedback_architecture(args, fairseq_architecture, **defaults) -> None:
    """What every architecture of this plugin does: its own `defaults` (sizes,
    the paper's choices), then fairseq's architecture of the same shape, then
    the feedback options' defaults, then one check of them all. Options
    already set (on the command line, in a checkpoint) are kept. fairseq
    applies architectures while parsing the command line, so a bad value
    stops it before it creates any directory."""
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    fairseq_architecture(args)
    for name, value in vars(FeedbackConfig()).items():
        if not name.startswith("_") and getattr(args, name, None) is None:
            setattr(args, name, value)
    check_feedback_args(args)


def check_feedback_args(args) -> None:
    """One-line errors for option values the decoder cannot use."""
    if args.memory_span < 1:
        raise FeedbackUsageError(f"--memory-span must be at least 1, got {args.memory_span}")
    heads, embed_dim = args.decoder_attention_heads, args.decoder_embed_dim
    if heads < 1 or embed_dim % heads and not args.head_dim:
        raise FeedbackUsageError(
            f"--decoder-embed-dim {embed_dim} is not divisible by --decoder-attention-heads {heads}; "
            "change one, or set --head-dim"
        )
    if args.head_dim is not None and args.head_dim < 1:
        raise FeedbackUsageError(f"--head-dim must be at least 1, got {args.head_dim}")
    composition_layer(args.memory_composition, args.decoder_layers)
    if args.adaptive_span and (args.adaptive_span_ramp < 1 or not 0 <= args.adaptive_span_init <= 1):
        raise FeedbackUsageError("--adaptive-span needs --adaptive-span-ramp >= 1 and --adaptive-span-init in [0, 1]")
    if args.persistent_vectors < 0:
        raise FeedbackUsageError(f"--persistent-vectors must be at least 0, got {args.persistent_vectors}")
    if getattr(args, "checkpoint_activations", False):
        raise FeedbackUsageError("--checkpoint-activations is not supported by the feedback decoder; drop the flag")


def check_dictionary_sizes(model, state_dict) -> None:
    """A checkpoint read with other dictionaries fails in load_state_dict with
    a wall of size mismatches; say what is wrong instead."""
    own = model.state_dict()
    for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "decoder.output_projection.weight"):
        if name in state_dict and name in own and state_dict[name].size(0) != own[name].size(0):
            side = "source" if name.startswith("encoder") else "target"
            raise FeedbackUsageError(
                f"the checkpoint's {side} dictionary has {state_dict[name].size(0)} symbols but the data's has "
                f"{own[name].size(0)}: use the data directory (dict.*.txt) the model was trained with"
            )

