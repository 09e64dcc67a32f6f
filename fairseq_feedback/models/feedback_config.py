"""Options of the feedback decoders, shared by the translation model and the LM:
their defaults and checks (one path for every architecture). The checks of
fairseq's own options, and of the rest of a command line, are in
fairseq_fixes/command_line.py.

What is known of an option is said in its field's metadata, beside its help:
- "at_least", "at_most": the values it can take (option_ranges.py, as for every
  option of this plugin and fairseq's; check_feedback_args);
- "may_change_on_resume": True where training may continue a checkpoint with
  another value (regularisation, how the model is computed); any other
  option makes another model (fairseq_fixes/trained_options.py refuses it);
- "fused": False where the fused block does not run the option, and the loop
  runs step by step through autograd instead (loop/fallback.py).
"""

from dataclasses import dataclass, field, fields
from typing import List, Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.models.transformer import TransformerConfig

from ..errors import FeedbackUsageError
from ..loop.passes import INITIAL_MEMORIES, PASS_GRADIENTS
from ..modules.feedback_memory import composition_layer
from ..option_ranges import check_ranges, field_ranges, flag

CUDA_GRAPHS = ChoiceEnum(["auto", "off", "emulate"])
PASS_GRADIENTS_CHOICES = ChoiceEnum(list(PASS_GRADIENTS))
INITIAL_MEMORY_CHOICES = ChoiceEnum(list(INITIAL_MEMORIES))


@dataclass
class FeedbackConfig(FairseqDataclass):
    memory_span: int = field(
        default=1024,
        metadata={"help": "how many past memory vectors each step attends to (the paper's attention span)",
                  "at_least": 1},
    )
    per_layer_kv: bool = field(
        default=False,
        metadata={"help": "give each layer its own key/value projection of the memory "
                          "(default: one projection shared by all layers, the paper's fast variant)"},
    )
    head_dim: Optional[int] = field(
        default=None,
        metadata={"help": "dimension of each memory-attention head (default: embed dim / heads)", "at_least": 1},
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
                          "(eq. 1, learned softmax weights), 'average', 'top' (the last layer only), "
                          "'layer:K' (layer K only; 0 is the embeddings), or 'recurrent' (a memory per layer: "
                          "layer l's is eq. 1 over the embeddings and layers 1..l, itself included)"},
    )
    adaptive_span: bool = field(
        default=False,
        metadata={"help": "learn each head's span up to --memory-span (Sukhbaatar et al. 2019); "
                          "the memory kept is what the widest head reaches"},
    )
    adaptive_span_ramp: int = field(
        default=32, metadata={"help": "length of the adaptive span's soft ramp", "at_least": 1})
    adaptive_span_init: float = field(
        default=0.0,
        metadata={"help": "initial span, as a fraction of --memory-span", "at_least": 0, "at_most": 1,
                  "may_change_on_resume": True},
    )
    adaptive_span_loss: float = field(
        default=0.0,
        metadata={"help": "coefficient of the span loss, memory span x mean span fraction per layer, added to "
                          "the training loss by this plugin's tasks and logged as span_loss",
                  "at_least": 0, "may_change_on_resume": True},
    )
    persistent_vectors: int = field(
        default=0,
        metadata={"help": "learned key/value vectors per head that every step also attends to "
                          "(Sukhbaatar et al. 2019, all-attention)", "at_least": 0, "fused": False},
    )
    no_feed_forward: bool = field(
        default=False,
        metadata={"help": "drop the feed-forward sublayers (with --persistent-vectors: all-attention layers)"},
    )
    emb_dropout: float = field(
        default=0.0,
        metadata={"help": "dropout on the embeddings and on the top layer's output only (the paper's 'Embed. dropout' "
                          "of its WikiText-103 models, Table 9; fairseq's adaptive_span example's emb_dropout), "
                          "where --dropout also drops every sublayer's output",
                  "at_least": 0, "at_most": 1, "may_change_on_resume": True},
    )
    cuda_graphs: CUDA_GRAPHS = field(
        default="auto",
        metadata={"help": "the feedback decoder's per-token loop: 'auto' replays it as captured CUDA graphs on a GPU "
                          "(each checked against the eager loop, eager if anything fails) and runs it "
                          "eagerly elsewhere; 'off' always eagerly (the same numbers, many times slower on a GPU); "
                          "'emulate' through the path a GPU takes, with a stand-in for the CUDA calls, on any device "
                          "(to see a data set's shapes and hit rate). fairseq-generate and eval-lm: "
                          "--model-overrides \"{'cuda_graphs': 'off'}\"", "may_change_on_resume": True},
    )
    no_cuda_graphs: bool = field(
        default=False, metadata={"help": "the same as --cuda-graphs off", "may_change_on_resume": True})
    train_passes: int = field(
        default=0,
        metadata={"help": "train in passes (docs/passes.md): each block's positions in groups of --pass-group, "
                          "each group computed this many times, all its positions at once, reading the previous "
                          "pass's memory inside the group; after pass k a group's first k positions are exact "
                          "(--train-passes equal to --pass-group: exact feedback). 0: exact, one position at a "
                          "time. Validation, fairseq-eval-lm and decoding always run exactly",
                  "at_least": 0, "may_change_on_resume": True},
    )
    pass_group: int = field(
        default=16,
        metadata={"help": "with --train-passes: the positions a pass computes at once", "at_least": 1,
                  "may_change_on_resume": True},
    )
    pass_gradients: PASS_GRADIENTS_CHOICES = field(
        default="every",
        metadata={"help": "with --train-passes: gradients through every pass ('every': a memory vector learns "
                          "from the positions of its group that read it), or through the last pass alone "
                          "('last': the earlier passes without autograd, cheaper)", "may_change_on_resume": True},
    )
    pass_initial_memory: INITIAL_MEMORY_CHOICES = field(
        default="embeddings",
        metadata={"help": "with --train-passes: the first pass's guess of a group's memory vectors, the "
                          "embeddings ('embeddings'), or none ('none': the first pass reads only the memory "
                          "before the group)", "may_change_on_resume": True},
    )


def decoder_config(args):
    """fairseq's TransformerConfig for the decoder, with the feedback options
    on it (from_namespace drops unknown options of a DictConfig)."""
    cfg = TransformerConfig.from_namespace(args)
    for name in FeedbackConfig.__dataclass_fields__:
        if not name.startswith("_"):
            setattr(cfg, name, getattr(args, name))
    return cfg


def feedback_architecture(args, fairseq_architecture, **defaults) -> None:
    """What every architecture of this plugin does: its own `defaults` (sizes,
    the paper's choices), then fairseq's architecture of the same shape, then
    the feedback options' defaults. Options already set (on the command line,
    in a checkpoint) are kept. They are checked before fairseq-train starts
    (fairseq_fixes/command_line.py) and as a model is built."""
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    fairseq_architecture(args)
    for name, value in vars(FeedbackConfig()).items():
        if not name.startswith("_") and getattr(args, name, None) is None:
            setattr(args, name, value)


# fairseq options these decoders do not implement, and the value that turns each off
UNSUPPORTED = {"checkpoint_activations": False, "base_layers": 0}
# fairseq's options that the decoders read, at values they cannot use and fairseq's own models
# refuse themselves (the others' ranges: fairseq_fixes/option_values.py): each attention splits its
# dimension among its heads (check_heads), and the decoders' attention drops its probabilities itself
FAIRSEQ_OPTIONS_READ = {
    **dict.fromkeys(("decoder_embed_dim", "decoder_attention_heads", "encoder_embed_dim", "encoder_attention_heads"),
                    {"at_least": 1}),
    "attention_dropout": {"at_least": 0, "below": 1},
}


def may_change_on_resume() -> set:
    """The options that training may continue a checkpoint with at other values."""
    return {f.name for f in fields(FeedbackConfig) if f.metadata.get("may_change_on_resume")}


def unfused_options(cfg) -> List[str]:
    """The options set in `cfg` that the fused block does not run, as flags."""
    return [flag(f.name) for f in fields(FeedbackConfig) if f.metadata.get("fused") is False and getattr(cfg, f.name)]


def check_feedback_args(args) -> None:
    """One-line errors for option values the decoders cannot use."""
    check_ranges(args, {**FAIRSEQ_OPTIONS_READ, **field_ranges(FeedbackConfig)})
    for name, off in UNSUPPORTED.items():
        if getattr(args, name, off) not in (off, None):
            raise FeedbackUsageError(f"{flag(name)} is not supported by the feedback decoder; drop it")
    check_heads(args)
    composition_layer(args.memory_composition, args.decoder_layers)
    if args.adaptive_span_loss and not args.adaptive_span:
        raise FeedbackUsageError("--adaptive-span-loss is the loss of learned spans: add --adaptive-span, "
                                 "or drop --adaptive-span-loss")
    check_passes(args)


def check_passes(args) -> None:
    """--train-passes K of groups of --pass-group G: K <= G (G is exact), a
    feedback model's, and a first guess that leaves no position with
    nothing to read."""
    passes, group = getattr(args, "train_passes", 0), getattr(args, "pass_group", 1)
    if not passes:
        return
    if args.no_feedback:
        raise FeedbackUsageError("--train-passes trains the feedback loop in passes; --no-feedback's Transformer "
                                 "computes its blocks at once already: drop one of them")
    if passes > group:
        raise FeedbackUsageError(f"--train-passes {passes} is more than --pass-group {group}: {group} passes already "
                                 f"compute a group exactly; use at most {group}")
    if str(args.pass_initial_memory) == "none" and (args.adaptive_span or group > args.memory_span):
        raise FeedbackUsageError(
            "--pass-initial-memory none: the first pass of a group would leave its positions beyond "
            + ("a head's learned span (--adaptive-span)" if args.adaptive_span
               else f"--memory-span {args.memory_span} from the group's start (--pass-group {group})")
            + " nothing to read; use --pass-initial-memory embeddings")


def check_heads(args) -> None:
    """Each attention splits its dimension among its heads. The feedback
    attention can take another size per head (--head-dim), but fairseq's
    attention cannot: the translation encoder's, and the decoder's attention
    over the encoder, which has the decoder's dimension and heads."""
    encoder_dim = getattr(args, "encoder_embed_dim", None)  # None: a language model
    if encoder_dim is not None and encoder_dim % args.encoder_attention_heads:
        raise FeedbackUsageError(f"--encoder-embed-dim {encoder_dim} is not divisible by "
                                 f"--encoder-attention-heads {args.encoder_attention_heads}: change one")
    dim, num_heads = args.decoder_embed_dim, args.decoder_attention_heads
    if dim % num_heads == 0:
        return
    if encoder_dim is not None and not getattr(args, "no_cross_attention", False):
        raise FeedbackUsageError(f"--decoder-embed-dim {dim} is not divisible by --decoder-attention-heads {num_heads}: "
                                 "change one (the decoder's attention over the encoder splits its dimension "
                                 "among the heads, whatever --head-dim)")
    if not args.head_dim:
        raise FeedbackUsageError(f"--decoder-embed-dim {dim} is not divisible by --decoder-attention-heads {num_heads}: "
                                 "change one, or set --head-dim")
