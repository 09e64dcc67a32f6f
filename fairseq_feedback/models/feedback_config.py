"""Options of the feedback decoders, shared by the translation model and the LM:
their defaults and checks (one path for every architecture), and the choice
between the feedback decoder and its Transformer baseline."""

from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.tasks import TASK_REGISTRY

from ..errors import FeedbackUsageError
from ..modules.feedback_memory import composition_layer
from ..tasks.adaptive_span_loss import AdaptiveSpanLossMixin
from .feedback_decoder import FeedbackDecoder
from .transformer_xl_decoder import TransformerXLDecoder

CUDA_GRAPHS = ChoiceEnum(["auto", "off", "emulate"])


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
    cuda_graphs: CUDA_GRAPHS = field(
        default="auto",
        metadata={"help": "the feedback decoder's per-token loop: 'auto' replays it as captured CUDA graphs on a GPU "
                          "(each checked against the eager loop at its first use, eager if it fails) and runs it "
                          "eagerly elsewhere; 'off' always eagerly (the same numbers, many times slower on a GPU); "
                          "'emulate' through the graphs' padding, cache and checks without capturing, on any device "
                          "(to see a data set's shapes and hit rate). fairseq-generate and eval-lm: "
                          "--model-overrides \"{'cuda_graphs': 'off'}\""},
    )
    no_cuda_graphs: bool = field(default=False, metadata={"help": "the same as --cuda-graphs off"})


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
    the feedback options' defaults, then one check of them all and of the
    task they go with. Options already set (on the command line, in a
    checkpoint) are kept. fairseq applies architectures while parsing the
    command line, so a bad value stops it before it creates any directory."""
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    fairseq_architecture(args)
    for name, value in vars(FeedbackConfig()).items():
        if not name.startswith("_") and getattr(args, name, None) is None:
            setattr(args, name, value)
    check_feedback_args(args)
    check_task(args)


def check_task(args) -> None:
    """The model goes with its task (the model's check_task), checked as fairseq
    parses the command line: before it composes its configuration, which for
    a language model under a translation task fails on an option the model
    takes from the task (--tokens-per-sample). Options read from a checkpoint
    name the task of their training, or none; the model's build_model checks
    the task that builds it."""
    task = TASK_REGISTRY.get(getattr(args, "task", None))
    if task is not None:
        ARCH_MODEL_REGISTRY[args.arch].check_task(task)


# The values each numeric option can work with. Options a model does not
# have (the encoder's, for the language model) or leaves unset are skipped.
AT_LEAST_1 = (lambda v: v >= 1, "at least 1")
AT_LEAST_0 = (lambda v: v >= 0, "at least 0")
ABOVE_0 = (lambda v: v > 0, "greater than 0")
PROBABILITY = (lambda v: 0 <= v < 1, "in [0, 1)")  # dropout of 1 would zero every activation
FRACTION = (lambda v: 0 <= v <= 1, "in [0, 1]")
RANGES = {
    **dict.fromkeys(("memory_span", "head_dim", "adaptive_span_ramp", "max_source_positions", "max_target_positions",
                     "decoder_layers", "decoder_embed_dim", "decoder_input_dim", "decoder_output_dim",
                     "decoder_ffn_embed_dim", "decoder_attention_heads", "encoder_embed_dim",
                     "encoder_ffn_embed_dim", "encoder_attention_heads", "character_embedding_dim",
                     "quant_noise_pq_block_size"), AT_LEAST_1),
    **dict.fromkeys(("encoder_layers", "persistent_vectors", "adaptive_span_loss", "char_embedder_highway_layers"),
                    AT_LEAST_0),
    **dict.fromkeys(("adaptive_input_factor", "adaptive_softmax_factor"), ABOVE_0),
    **dict.fromkeys(("dropout", "attention_dropout", "activation_dropout", "relu_dropout", "adaptive_softmax_dropout",
                     "encoder_layerdrop", "decoder_layerdrop", "quant_noise_pq", "quant_noise_scalar"), PROBABILITY),
    "adaptive_span_init": FRACTION,
}
# fairseq options these decoders do not implement, and the value that turns each off
UNSUPPORTED = {"checkpoint_activations": False, "base_layers": 0}


def check_feedback_args(args) -> None:
    """One-line errors for option values the models cannot use."""
    for name, (valid, bound) in RANGES.items():
        value = _number(getattr(args, name, None))
        if value is not None and not valid(value):
            raise FeedbackUsageError(f"--{name.replace('_', '-')} must be {bound}, got {value}")
    for name, off in UNSUPPORTED.items():
        if getattr(args, name, off) not in (off, None):
            raise FeedbackUsageError(f"--{name.replace('_', '-')} is not supported by the feedback decoder; drop it")
    check_heads(args)
    composition_layer(args.memory_composition, args.decoder_layers)
    if args.adaptive_span_loss and not args.adaptive_span:
        raise FeedbackUsageError("--adaptive-span-loss is the loss of learned spans: add --adaptive-span, "
                                 "or drop --adaptive-span-loss")


def _number(value):
    """An option's number; None if it has none yet (unset, or an interpolation
    of another option's value). fairseq's parser leaves the options it fills
    by interpolation, such as --decoder-output-dim, as strings."""
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return None
    return value if isinstance(value, (int, float)) else None


def check_heads(args) -> None:
    """Each attention splits its dimension among its heads. The feedback
    attention can take another size per head (--head-dim), but fairseq's
    attention cannot: the translation encoder's, and the decoder's attention
    over the encoder, which has the decoder's dimension and heads."""
    encoder_dim = getattr(args, "encoder_embed_dim", None)  # None: a language model
    if encoder_dim is not None and encoder_dim % args.encoder_attention_heads:
        raise FeedbackUsageError(f"--encoder-embed-dim {encoder_dim} is not divisible by "
                                 f"--encoder-attention-heads {args.encoder_attention_heads}: change one")
    dim, heads = args.decoder_embed_dim, args.decoder_attention_heads
    if dim % heads == 0:
        return
    if encoder_dim is not None and not getattr(args, "no_cross_attention", False):
        raise FeedbackUsageError(f"--decoder-embed-dim {dim} is not divisible by --decoder-attention-heads {heads}: "
                                 "change one (the decoder's attention over the encoder splits its dimension "
                                 "among the heads, whatever --head-dim)")
    if not args.head_dim:
        raise FeedbackUsageError(f"--decoder-embed-dim {dim} is not divisible by --decoder-attention-heads {heads}: "
                                 "change one, or set --head-dim")


def check_training(cfg, task) -> None:
    """fairseq-train's command line for a feedback model, before it starts
    (checks.py): the model's options, and what training needs of the task (a
    class): learned spans need their loss added and their values kept in
    range, which only this plugin's tasks do."""
    check_feedback_args(cfg.model)
    if cfg.model.adaptive_span and not issubclass(task, AdaptiveSpanLossMixin):
        raise FeedbackUsageError("--adaptive-span is trained by this plugin's tasks, which add --adaptive-span-loss "
                                 "and keep the spans in range: use --task feedback_translation "
                                 "(feedback_language_modeling for a language model), or drop --adaptive-span")


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

