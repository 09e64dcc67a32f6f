"""A checkpoint against the command line: read as what it was trained for (the objective, --labels; a
translation model's direction; what --model-overrides changes), and continued with the options and
objective it was trained with. fairseq is silent on these (option_values.py): it loads the parameters
into a model that computes something else, or decodes the other direction, without a word;
--print-alignment with --score-reference is late."""

import argparse
import ast
import functools
import os
import types

from fairseq import utils

from ..errors import FeedbackUsageError
from ..models.feedback_config import may_change_on_resume
from ..models.plugin_model import model_class
from ..option_ranges import check_ranges, check_types, flag, number
from .binarized_files import language_pair
from .checkpoints import checkpoint_to_resume, recorded_configuration
from .model_overrides import check_overridden_model
from .option_values import LATE_RANGES, MISSING, MODEL_RANGES, SILENT_RANGES, option


def check_checkpoints(cfg, model, tool) -> None:
    """The checkpoints a tool reads (--path) and, training (`model`: the class it builds), the one it continues."""
    path = cfg.get("common_eval", {}).get("path")
    for checkpoint in utils.split_paths(path) if path else []:  # a missing one: FileNotFoundError's line
        check_read_as_trained(cfg, checkpoint, tool)
    if model is not None:
        continued = continued_checkpoint(cfg)
        if continued is not None:
            check_continued_as_trained(cfg, model, *continued)


def continued_checkpoint(cfg):
    """(path, how it was named) of the checkpoint fairseq-train continues, or None: the one --save-dir
    resumes from (checkpoints.py), else --restore-file (fairseq silently starts afresh without it), else
    --finetune-from-model."""
    checkpoint = cfg.checkpoint
    if cfg.distributed_training.use_sharded_state:
        return None  # one file per rank, named by fairseq-train as it runs
    suffix = checkpoint.checkpoint_suffix or ""
    if checkpoint.restore_file != "checkpoint_last.pt":
        named = ("--restore-file", checkpoint.restore_file.replace(".pt", suffix + ".pt"))
    else:
        resumed = checkpoint_to_resume(checkpoint.save_dir, suffix)
        if resumed is not None:
            return resumed.path, "--save-dir"
        named = ("--finetune-from-model", checkpoint.finetune_from_model)
    given, path = named
    if path is None:
        return None
    if not os.path.exists(path):
        raise FeedbackUsageError(f"{given} {path} not found: check the path")
    return path, given


# The model options that may change when training continues from a checkpoint: regularisation,
# how the model is computed and how long its inputs may be. Any other option makes another model.
# fairseq's are listed here; this plugin's say so where they are defined (models/feedback_config.py).
MAY_CHANGE = {
    "dropout", "attention_dropout", "activation_dropout", "relu_dropout", "adaptive_softmax_dropout",
    "encoder_layerdrop", "decoder_layerdrop", "quant_noise_pq", "quant_noise_pq_block_size", "quant_noise_scalar",
    "checkpoint_activations", "offload_activations", "min_params_to_wrap",
    "tpu", "max_source_positions", "max_target_positions", "tokens_per_sample",
    "base_shuffle",  # read by BASE layers alone: 1 by default, 0 as an --arch of transformer_lm's sets it
} | may_change_on_resume()
# Options that fairseq's build_model overwrites from another one when that one is set (so a checkpoint
# records what the command line did not say): compared through the other.
DERIVED = {"share_decoder_input_output_embed": "share_all_embeddings", "encoder_layers": "encoder_layers_to_keep",
           "decoder_layers": "decoder_layers_to_keep"}
INSTEAD = {"--save-dir": "start in another --save-dir", "--restore-file": "drop --restore-file",
           "--finetune-from-model": "drop --finetune-from-model"}


def check_continued_as_trained(cfg, model, checkpoint, named) -> None:
    """Training continues a model with the options and objective it was trained with (fairseq loads the
    parameters into another model, or trains them on another objective, without a word)."""
    recorded = recorded_configuration(checkpoint)
    if recorded is None:
        return
    instead = INSTEAD[named]
    check_objective(cfg, recorded, checkpoint, "train", f", or {instead}")
    differ = model_class(recorded.model) in (None, model) and other_model(model, recorded.model, cfg.model)
    if differ:  # another model class: fairseq's "Cannot load model parameters" (one_line.py)
        was, now = differ
        raise FeedbackUsageError(f"{checkpoint} was trained with {was}, and this command line asks for {now}: "
                                 f"continue it with {was}, or {instead}")


def other_model(model, a, b):
    """The options of `model` (a class) in which two configurations of it make other models, as two
    command-line fragments; None when they make one model (differing at most in what MAY_CHANGE)."""
    differ = [(name, option(a, name), option(b, name)) for name in sorted(model_options(model).keys() - MAY_CHANGE)
              if not (name in DERIVED and any(option(options, DERIVED[name], None) for options in (a, b)))]
    differ = [(name, x, y) for name, x, y in differ if MISSING not in (x, y) and not _same(x, y)]
    if not differ:
        return None
    archs = ("arch", option(a, "_name"), option(b, "_name"))  # fairseq's configurations name the --arch so
    if MISSING not in archs and archs[1] != archs[2]:  # first: it set the others, unless the command line did
        differ.insert(0, archs)
    return (" ".join(f"{flag(name)} {x}" for name, x, _ in differ),
            " ".join(f"{flag(name)} {y}" for name, _, y in differ))


def check_read_as_trained(cfg, checkpoint, tool) -> None:
    """A checkpoint given to a tool (--path): complete, and read as what it was trained for."""
    recorded = recorded_configuration(checkpoint)
    if recorded is None:
        return
    check_objective(cfg, recorded, checkpoint, tool)
    if tool in ("generate", "interactive"):
        check_direction(cfg, recorded, checkpoint)
    generation = cfg.get("generation") or {}
    if (tool == "generate" and generation.get("score_reference") and generation.get("print_alignment")
            and getattr(model_class(recorded.model), "aligns_as_it_decodes_only", False)):
        # late: fairseq-generate fails as it prints the first sentence's scores, with no alignment to print
        raise FeedbackUsageError(f"{checkpoint} returns its alignments as it decodes, and --score-reference scores "
                                 "the references teacher-forced: drop --print-alignment, or --score-reference")
    check_overrides(cfg, recorded, checkpoint)


def check_objective(cfg, recorded, checkpoint, tool, instead="") -> None:
    """A model of --labels is trained on, scored and sampled as one, a language model as one: `tool` reads
    the checkpoint (fairseq-validate takes the objective from it), or trains it on (`instead`: what else)."""
    labels, given = option(recorded.task, "labels", None), cfg.task.get("labels")
    if labels and tool in ("eval_lm", "generate", "interactive"):
        does = "scores" if tool == "eval_lm" else "generates"
        raise FeedbackUsageError(f"{checkpoint} was trained with --labels {labels}: it predicts labels, not the next "
                                 f"token that fairseq-{tool.replace('_', '-')} {does}; score it with "
                                 "feedback-evaluate-toy, or fairseq-validate")
    if labels and not given and tool == "train":
        raise FeedbackUsageError(f"{checkpoint} was trained with --labels {labels}, to predict labels: continue it "
                                 f"with --task feedback_language_modeling --labels {labels}{instead}")
    if given and not labels:
        raise FeedbackUsageError(f"{checkpoint} was trained without --labels, to predict the next token: "
                                 f"drop --labels {given}{instead}")


def check_overrides(cfg, recorded, checkpoint) -> None:
    """--model-overrides: a dict (fairseq takes a list without a word) of options the checkpoint records
    (fairseq ignores any other), at values they can take; beyond MAY_CHANGE, model_overrides.py."""
    given = option(cfg.get("common_eval") or {}, "model_overrides", None)
    overrides = model_overrides(given)
    if given is None:
        return
    if not (isinstance(overrides, dict) and all(isinstance(name, str) for name in overrides)):
        raise FeedbackUsageError(f"--model-overrides must be a Python dict of option names and values, as "
                                 f"\"{{'dropout': 0.1}}\", got {given!r}")
    unknown = sorted(set(overrides) - recorded.names)
    if unknown:
        raise FeedbackUsageError(f"--model-overrides names {', '.join(unknown)}, which {checkpoint} does not record "
                                 "(fairseq would ignore it): name options as its configuration does, as 'dropout'")
    trained = model_class(recorded.model)
    check_types(overrides, model_options(trained) if trained is not None else {})
    check_ranges(types.SimpleNamespace(**overrides), {**MODEL_RANGES, **SILENT_RANGES, **LATE_RANGES})
    changed = [(name, option(recorded.model, name), value) for name, value in overrides.items()
               if name not in MAY_CHANGE]
    changed = [(name, was, now) for name, was, now in changed if was is not MISSING and not _same(was, now)]
    if changed:
        check_overridden_model(checkpoint, recorded, utils.split_paths(cfg.task.data)[0], changed)


def model_overrides(given):
    """--model-overrides as ast reads it, without running it (None where it cannot)."""
    if not isinstance(given, str):
        return given
    try:
        return ast.literal_eval(given)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def check_direction(cfg, recorded, checkpoint) -> None:
    """A translation model is read in the direction it was trained: with -s and -t swapped and a joined
    dictionary (or of equal sizes), fairseq translated nonsense with exit status 0."""
    trained = language_pair(recorded.task)  # recorded by fairseq-train with the plugin (check_data)
    asked = language_pair(cfg.task)
    if None in trained or None in asked or trained == asked or trained != asked[::-1]:
        return
    src, tgt = trained
    raise FeedbackUsageError(f"{checkpoint} translates {src} to {tgt}, and this command line asks for {tgt} to "
                             f"{src}: pass -s {src} -t {tgt} (a model translates the direction it was trained in; "
                             f"for {tgt} to {src}, train one with -s {tgt} -t {src})")


def _same(a, b) -> bool:
    """Two values of an option, as a command line and a checkpoint hold them (a number may be a string)."""
    a_number, b_number = number(a), number(b)
    if a_number is not None and b_number is not None:
        return a_number == b_number
    return str(a) == str(b)


@functools.lru_cache(maxsize=None)
def model_options(model) -> dict:
    """{name: argparse's action} of a model class's options, as its add_args declares them."""
    parser = argparse.ArgumentParser(add_help=False)
    model.add_args(parser)
    return {action.dest: action for action in parser._actions}

