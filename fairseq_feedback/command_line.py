"""A fairseq tool's whole command line, checked before the tool creates anything.

fairseq-train creates --save-dir as its main begins, and fairseq-generate
its --results-path; only then do they read the data, build the model and
load checkpoints, so a mistake found there leaves a folder behind and a
traceback. patches.py has each tool check its command line first:
check_tool for those that hand their configuration to
distributed_utils.call_main (train, eval-lm, interactive, validate,
hydra-train), check_generate for fairseq-generate. In this order:

- the model with the task, both as classes (the model is None unless the
  tool trains one, which it builds from the command line);
- the streaming task's options: blocks, batches of streams, labels;
- fairseq's own options at values they cannot take (sizes of zero or
  less, probabilities outside [0, 1)): the model's, the batches',
  generation's; and half precision, which fairseq computes on a GPU (or
  a TPU) only;
- the decoder's options (models/feedback_config.py, beside their
  definitions);
- the data: the directories, a translation task's language pair, the
  splits the tool reads (present, not empty, not cut short);
- the checkpoints named on the command line (present, and complete) and
  the one training continues from, against what they were trained with
  (read from the checkpoint): training continues a model with the options
  it was trained with, and the objective (--labels); a model trained to
  predict labels is not scored or sampled as a language model.

Every tool also checks a split as fairseq loads it (check_binarized), and
the models and tasks check their pairing as they are built
(check_model_and_task).
"""

import argparse
import functools
import importlib.util
import os
import struct

import numpy as np
import torch

from fairseq import utils
from fairseq.data import Dictionary, data_utils, indexed_dataset
from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY
from fairseq.tasks import TASK_REGISTRY
from fairseq.tasks.language_modeling import LanguageModelingTask
from fairseq.tasks.translation import TranslationTask

from .checkpoints import is_complete, newest_complete_checkpoint, recorded_configuration
from .errors import FeedbackUsageError
from .models.feedback_config import check_feedback_args


def model_class(model_cfg):
    """The class an architecture's configuration (or a checkpoint's record of
    it) builds, as fairseq's build_model finds it (None: none)."""
    if model_cfg is None:
        return None
    return ARCH_MODEL_REGISTRY.get(_option(model_cfg, "_name", None) or _option(model_cfg, "arch", None))


def check_tool(cfg, tool: str) -> None:
    """`tool`: the name of its module in fairseq_cli (train, eval_lm, ...)."""
    model = model_class(cfg.get("model"))  # only training builds a model from the command line
    _check(cfg, model, training_splits(cfg) if model is not None else [], tool)


def check_generate(cfg) -> None:
    """fairseq-generate: the model comes from --path (its parser's --arch is a
    placeholder), and it reads --gen-subset."""
    _check(cfg, None, [(utils.split_paths(cfg.task.data)[0], cfg.dataset.gen_subset)], "generate")


def _check(cfg, model, reads, tool) -> None:
    task = TASK_REGISTRY.get(getattr(cfg.get("task"), "_name", None))
    if model is not None and task is not None:
        check_model_and_task(model, task)
        check_trained_by_task(cfg.model, task)
    if task is not None and issubclass(task, TASK_REGISTRY["feedback_language_modeling"]):
        check_streams(cfg)
        check_labels(cfg, training=model is not None)
    check_fairseq_options(cfg)
    check_precision(cfg, training=model is not None)
    if model is not None:
        check_model_options(cfg.model, model)
        check_positions(cfg, model)
    if task is not None and cfg.task.get("data"):
        check_data(cfg, task, reads, training=model is not None)
    check_checkpoints(cfg, model, tool)


def _is_feedback(model) -> bool:
    return issubclass(model, (MODEL_REGISTRY["feedback_lm"], MODEL_REGISTRY["feedback_transformer"]))


# --- the model and the task ----------------------------------------------------------------------


def check_model_and_task(model, task) -> None:
    """The model goes with the task (both classes): what this plugin's models
    and tasks need of each other, all of it in one line."""
    language_model = issubclass(task, LanguageModelingTask)
    problems = []
    if issubclass(model, MODEL_REGISTRY["feedback_lm"]) and not language_model:
        problems.append("feedback_lm is a language model: use --task feedback_language_modeling "
                        "(the translation model is --arch feedback_transformer)")
    if issubclass(model, MODEL_REGISTRY["feedback_transformer"]) and language_model:
        problems.append("feedback_transformer is a translation model, which a language-modelling task cannot "
                        "train: use --task translation (or feedback_translation), or the language model, "
                        "--arch feedback_lm")
    if issubclass(task, TASK_REGISTRY["feedback_language_modeling"]) and \
            not issubclass(model, MODEL_REGISTRY["feedback_lm"]):
        problems.append("--task feedback_language_modeling carries each stream's memory from block to block, "
                        "which only --arch feedback_lm (and feedback_lm_*) does: use it (with --no-feedback for "
                        "the transformer baseline), or --task language_modeling")
    if issubclass(task, TASK_REGISTRY["feedback_translation"]) and \
            not issubclass(model, MODEL_REGISTRY["feedback_transformer"]):
        problems.append("--task feedback_translation adds the span loss of a feedback decoder: use --arch "
                        "feedback_transformer (or feedback_transformer_*), or --task translation")
    if problems:
        raise FeedbackUsageError("; ".join(problems))


def check_trained_by_task(model_cfg, task) -> None:
    """Learned spans need their loss added and their values kept in range,
    which only this plugin's tasks do."""
    plugin_tasks = (TASK_REGISTRY["feedback_translation"], TASK_REGISTRY["feedback_language_modeling"])
    if getattr(model_cfg, "adaptive_span", False) and not issubclass(task, plugin_tasks):
        raise FeedbackUsageError("--adaptive-span is trained by this plugin's tasks, which add --adaptive-span-loss "
                                 "and keep the spans in range: use --task feedback_translation "
                                 "(feedback_language_modeling for a language model), or drop --adaptive-span")


def check_positions(cfg, model) -> None:
    """A feedback language model with absolute positions has as many as it has: blocks fit in them."""
    if issubclass(model, MODEL_REGISTRY["feedback_lm"]) and not cfg.model.no_token_positional_embeddings:
        check_block(cfg.task.tokens_per_sample, cfg.model.max_target_positions)


def check_block(block, max_positions) -> None:
    if max_positions is not None and block > max_positions:
        raise FeedbackUsageError(f"--tokens-per-sample {block} is longer than the model allows ({max_positions}): "
                                 "use shorter blocks")


# --- the streaming task --------------------------------------------------------------------------

# fairseq's language-modelling options that streams have no use for, and their values that mean "off"
UNUSED_BY_STREAMS = {"sample_break_mode": "none", "shorten_method": "none", "add_bos_token": False,
                     "self_target": False, "future_target": False, "past_target": False,
                     "pad_to_fixed_length": False, "pad_to_fixed_bsz": False}


def check_streams(cfg) -> None:
    """The blocks, and the batches of streams of training (and eval-lm) and validation."""
    block, warmup = cfg.task.tokens_per_sample, cfg.task.get("bptt_warmup_tokens_per_sample")  # warm-up: block_schedule.py
    if block < 1:
        raise FeedbackUsageError(f"--tokens-per-sample must be at least 1, got {block}")
    if warmup is not None and warmup < 1:
        raise FeedbackUsageError(f"--bptt-warmup-tokens-per-sample must be at least 1, got {warmup}")
    if (warmup is None) != (cfg.task.get("bptt_warmup_updates", 0) <= 0):
        raise FeedbackUsageError("a BPTT warm-up needs both --bptt-warmup-tokens-per-sample (its block length) and "
                                 "--bptt-warmup-updates (above 0: how long it lasts); give both or neither")
    for name, off in UNUSED_BY_STREAMS.items():
        if cfg.task.get(name, off) != off:
            raise FeedbackUsageError(f"--task feedback_language_modeling does not use {_flag(name)}: "
                                     "its streams run across lines, block after block; drop the option, or use "
                                     "--task language_modeling")
    for rows_name, tokens_name in (("batch_size", "max_tokens"), ("batch_size_valid", "max_tokens_valid")):
        rows, tokens = cfg.dataset.get(rows_name), cfg.dataset.get(tokens_name)
        if rows is not None and rows < 1:
            raise FeedbackUsageError(f"{_flag(rows_name)} must be at least 1, got {rows}: it counts the streams "
                                     "of a batch")
        if tokens is not None and tokens < block:
            raise FeedbackUsageError(f"{_flag(tokens_name)} {tokens} holds no block of --tokens-per-sample "
                                     f"{block}: raise it, or give the streams per batch with {_flag(rows_name)}")


def check_labels(cfg, training: bool) -> None:
    args = cfg.task
    if not args.labels:
        if args.ignore_label != "_":
            raise FeedbackUsageError("--ignore-label is a label of --labels: add --labels, or drop --ignore-label")
        return
    labels = Dictionary.load(labels_dictionary(args.data, args.labels))
    if args.ignore_label != "_" and args.ignore_label not in labels:  # labels may need no `_`: all scored
        raise FeedbackUsageError(f"--ignore-label {args.ignore_label!r} is not a label of {args.labels} (its "
                                 "dict.txt): pass the label that marks positions without a target")
    if training:
        for path, split in training_splits(cfg):
            monolingual_split(os.path.join(path, args.labels), split, cfg.dataset.dataset_impl)


def labels_dictionary(data, labels) -> str:
    """The path of the labels' dictionary, checked."""
    path = os.path.join(utils.split_paths(data)[0], labels, "dict.txt")
    if not os.path.exists(path):
        raise FeedbackUsageError(f"labels dictionary {path} not found: binarize the labels with "
                                 f"fairseq-preprocess --only-source --destdir {os.path.dirname(path)}")
    return path


def _flag(name) -> str:
    return "--" + name.replace("_", "-")


# --- fairseq's own options -----------------------------------------------------------------------

# The values each of fairseq's numeric options can work with. Options a
# configuration does not have (the encoder's, for a language model; the
# model's, for a tool that reads it from a checkpoint) or leaves unset are
# skipped.
AT_LEAST_1 = (lambda v: v >= 1, "at least 1")
AT_LEAST_0 = (lambda v: v >= 0, "at least 0")
ABOVE_0 = (lambda v: v > 0, "greater than 0")
PROBABILITY = (lambda v: 0 <= v < 1, "in [0, 1)")  # dropout of 1 would zero every activation
MODEL_RANGES = {
    **dict.fromkeys(("max_source_positions", "max_target_positions", "decoder_layers", "decoder_embed_dim",
                     "decoder_input_dim", "decoder_output_dim", "decoder_ffn_embed_dim", "decoder_attention_heads",
                     "encoder_embed_dim", "encoder_ffn_embed_dim", "encoder_attention_heads",
                     "character_embedding_dim", "quant_noise_pq_block_size"), AT_LEAST_1),
    **dict.fromkeys(("encoder_layers", "char_embedder_highway_layers"), AT_LEAST_0),
    **dict.fromkeys(("adaptive_input_factor", "adaptive_softmax_factor"), ABOVE_0),
    **dict.fromkeys(("dropout", "attention_dropout", "activation_dropout", "relu_dropout", "adaptive_softmax_dropout",
                     "encoder_layerdrop", "decoder_layerdrop", "quant_noise_pq", "quant_noise_scalar"), PROBABILITY),
}
DATASET_RANGES = {
    **dict.fromkeys(("batch_size", "batch_size_valid", "max_tokens", "max_tokens_valid",
                     "required_batch_size_multiple"), AT_LEAST_1),
    "num_workers": AT_LEAST_0,
}
GENERATION_RANGES = {
    **dict.fromkeys(("beam", "nbest"), AT_LEAST_1),
    **dict.fromkeys(("max_len_a", "max_len_b", "min_len", "no_repeat_ngram_size", "prefix_size"), AT_LEAST_0),
    "temperature": ABOVE_0,
}


def check_model_options(model_cfg, model) -> None:
    """The options of a model trained (or built from options): fairseq's, then the decoder's."""
    check_ranges(model_cfg, MODEL_RANGES)
    if _is_feedback(model):
        check_feedback_args(model_cfg)


def check_fairseq_options(cfg) -> None:
    """The batches' options, and generation's."""
    for options, ranges in ((cfg.get("dataset"), DATASET_RANGES), (cfg.get("generation"), GENERATION_RANGES)):
        if options is not None:
            check_ranges(options, ranges)
    dataset, task = cfg.get("dataset"), cfg.get("task")
    if dataset is not None and (getattr(task, "num_batch_buckets", None) or 0) > 0 \
            and getattr(dataset, "max_tokens", None) is None:
        # fairseq asserts it deep in its batching (FairseqDataset.adjust_bsz)
        raise FeedbackUsageError("--num-batch-buckets batches by tokens: add --max-tokens")
    generation = cfg.get("generation")
    if generation is not None and generation.max_len_a == 0 and generation.max_len_b < generation.min_len:
        raise FeedbackUsageError(f"--max-len-b {generation.max_len_b} is below --min-len {generation.min_len}: "
                                 "no output could be that long; raise --max-len-b (or --max-len-a)")


# fairseq's half precision, as it names its options (first: those that imply another)
HALF_PRECISION = ("memory_efficient_fp16", "memory_efficient_bf16", "fp16", "bf16", "amp")


def check_precision(cfg, training: bool) -> None:
    """Half precision where fairseq cannot compute it as asked: --bf16
    implies --tpu; --amp autocasts on a GPU only (elsewhere fairseq computes
    in float32 without a word); and fairseq-train's --fp16 flattens its
    float32 copy of the weights onto a GPU (elsewhere it fails deep inside:
    `Torch not compiled with CUDA`) unless --fp16-no-flatten-grads keeps
    that copy per parameter. Otherwise --fp16 and --memory-efficient-fp16
    compute in float16 on the CPU too."""
    common = cfg.get("common")
    if common is None:
        return
    half = next((name for name in HALF_PRECISION if common.get(name)), None)
    no_gpu = "--cpu asks for none" if common.get("cpu") else None if torch.cuda.is_available() else "torch sees none"
    if common.get("tpu"):
        if importlib.util.find_spec("torch_xla") is None:
            flag = _flag(half) if half in ("memory_efficient_bf16", "bf16") else "--tpu"
            raise FeedbackUsageError(f"{flag} computes on a TPU in fairseq (--bf16 implies --tpu), through torch_xla, "
                                     f"which is not installed: drop {flag} (on a GPU: --fp16 or --amp)")
    elif no_gpu and common.get("amp"):
        raise FeedbackUsageError(f"--amp autocasts to half precision on a GPU, and {no_gpu} (fairseq would compute "
                                 "in float32): drop --amp, or use --fp16")
    elif no_gpu and training and half == "fp16" and not common.get("fp16_no_flatten_grads"):
        raise FeedbackUsageError(f"--fp16 training keeps its float32 weights flattened on a GPU, and {no_gpu}: add "
                                 "--fp16-no-flatten-grads to train in float16 on the CPU, or drop --fp16")


def check_ranges(options, ranges) -> None:
    for name, (valid, bound) in ranges.items():
        value = _number(getattr(options, name, None))
        if value is not None and not valid(value):
            raise FeedbackUsageError(f"--{name.replace('_', '-')} must be {bound}, got {value}")


def _number(value):
    """An option's number; None if it has none yet (unset, or an interpolation
    of another option's value). fairseq's parser leaves the options it fills
    by interpolation, such as --decoder-output-dim, as strings."""
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# --- the data ------------------------------------------------------------------------------------


def check_data(cfg, task, reads, training=False) -> None:
    """The data directories, a translation task's language pair, and the splits the tool reads."""
    paths = utils.split_paths(cfg.task.data)
    for path in paths:
        if not os.path.isdir(path):
            raise FeedbackUsageError(f"data directory {path} not found: pass the --destdir of fairseq-preprocess")
    impl = cfg.dataset.dataset_impl
    if issubclass(task, LanguageModelingTask):
        for path, split in reads:
            monolingual_split(path, split, impl)
    elif issubclass(task, TranslationTask):
        src, tgt = language_pair(cfg.task)
        if src is None or tgt is None:
            raise FeedbackUsageError(f"no binarized data found in {paths[0]}: check the data directory, "
                                     "or pass --source-lang and --target-lang")
        for path, split in reads:
            _bilingual_split(path, split, src, tgt, impl)
        if training:  # the checkpoints record the direction the model learns (check_direction)
            cfg.task.source_lang, cfg.task.target_lang = src, tgt


def language_pair(task_cfg):
    """(source, target) of a translation task's options: -s and -t, or as
    fairseq infers them from the first data directory's files ((None, None)
    if it cannot)."""
    src, tgt = _option(task_cfg, "source_lang", None), _option(task_cfg, "target_lang", None)
    data = utils.split_paths(_option(task_cfg, "data", None) or "")
    if (src is None or tgt is None) and data and os.path.isdir(data[0]):
        src, tgt = data_utils.infer_language_pair(data[0])
    return src, tgt


def check_binarized(prefix: str) -> None:
    """A binarized split fairseq can read: with lines (a split of none is an
    empty .bin, as every line holds at least its end-of-sentence token, and
    numpy cannot map an empty file), and not cut short (fairseq would read
    past the end of a file, at some batch of some epoch)."""
    data, index = indexed_dataset.data_file_path(prefix), indexed_dataset.index_file_path(prefix)
    if os.path.isfile(data) and os.path.getsize(data) == 0:
        raise FeedbackUsageError(f"{data} holds no lines (fairseq-preprocess was given an empty file): "
                                 "binarize the split again from a file with text")
    if not (os.path.isfile(data) and os.path.isfile(index)):
        return
    expected = _mmap_file_sizes(index)
    if expected is None:  # another of fairseq's formats (--dataset-impl lazy or cached): fairseq checks it
        return
    again = "binarize the split again with fairseq-preprocess"
    for path, size in zip((index, data), expected):
        if os.path.getsize(path) != size:
            raise FeedbackUsageError(f"{path} holds {os.path.getsize(path)} bytes where {os.path.basename(index)} "
                                     f"counts {size}: it was cut short (or is of another binarization); {again}")


# the index of fairseq's mmap format: a magic, version (<Q), dtype code (<B) and lines (<Q), then each
# line's size (int32), then each line's offset in bytes in the .bin (int64)
MMAP_HEADER = struct.Struct("<9sQBQ")


def _mmap_file_sizes(index: str):
    """(index bytes, data bytes) that an index in fairseq's mmap format
    counts, or None for an index in another format."""
    magic = indexed_dataset.MMapIndexedDataset.Index._HDR_MAGIC
    cut_short = FeedbackUsageError(f"{index} is cut short: binarize the split again with fairseq-preprocess")
    with open(index, "rb") as f:
        header = f.read(MMAP_HEADER.size)
        if not header.startswith(magic):
            if magic.startswith(header):
                raise cut_short
            return None
        if len(header) < MMAP_HEADER.size:
            raise cut_short
        _, _, code, lines = MMAP_HEADER.unpack(header)
        index_bytes = MMAP_HEADER.size + 12 * lines
        if lines == 0:
            return index_bytes, 0
        if os.path.getsize(index) < index_bytes:
            raise cut_short
        f.seek(MMAP_HEADER.size + 4 * (lines - 1))  # the last line's size, then its offset
        (size,) = struct.unpack("<i", f.read(4))
        f.seek(MMAP_HEADER.size + 4 * lines + 8 * (lines - 1))
        (offset,) = struct.unpack("<q", f.read(8))
    return index_bytes, offset + size * np.dtype(indexed_dataset._code_to_dtype[code]).itemsize


def check_split(prefix: str, impl, missing: str) -> None:
    """A split fairseq-preprocess wrote (PREFIX.bin and .idx), readable; `missing` says what to do without it."""
    if not indexed_dataset.dataset_exists(prefix, impl=impl):
        raise FeedbackUsageError(missing)
    check_binarized(prefix)


def monolingual_split(data: str, split: str, impl=None) -> str:
    """DATA/SPLIT, checked: the layout of fairseq-preprocess --only-source."""
    prefix = os.path.join(data, split)
    check_split(prefix, impl, f"split '{split}' not found in {data}: expected {split}.bin and {split}.idx "
                              "from fairseq-preprocess --only-source")
    return prefix


def _bilingual_split(data: str, split: str, src: str, tgt: str, impl) -> None:
    """DATA/SPLIT.SRC-TGT.{SRC,TGT} (or TGT-SRC), as fairseq's translation task reads it."""
    pair = next((p for p in (f"{src}-{tgt}", f"{tgt}-{src}")
                 if indexed_dataset.dataset_exists(os.path.join(data, f"{split}.{p}.{src}"), impl=impl)), None)
    expected = f"{split}.{src}-{tgt}.{src}.bin/.idx and {split}.{src}-{tgt}.{tgt}.bin/.idx"
    for lang in (src, tgt):
        check_split(os.path.join(data, f"{split}.{pair or f'{src}-{tgt}'}.{lang}"), impl,
                    f"split '{split}' not found in {data}: expected {expected} from fairseq-preprocess")


def training_splits(cfg):
    """(data directory, split) of what fairseq-train reads: the training split
    of every data directory (one per epoch, in turn) and the validation
    splits of the first."""
    paths = utils.split_paths(cfg.task.data)
    valid = [] if cfg.dataset.disable_validation else cfg.dataset.valid_subset.split(",")
    return [(path, cfg.dataset.train_subset) for path in paths] + [(paths[0], split) for split in valid]


# --- checkpoints ---------------------------------------------------------------------------------


def check_checkpoints(cfg, model, tool) -> None:
    """The checkpoints a tool reads (--path) and, when training (`model`: the
    class it builds), the one it continues from; and a training run has
    batches to make."""
    path = cfg.get("common_eval", {}).get("path")
    for checkpoint in utils.split_paths(path) if path else []:
        if not os.path.isfile(checkpoint):
            raise FeedbackUsageError(f"checkpoint {checkpoint} not found: check --path")
        check_read_as_trained(cfg, checkpoint, tool)
    if model is not None:
        continued = continued_checkpoint(cfg)
        if continued is not None:
            check_continued_as_trained(cfg, model, *continued)
        if cfg.dataset.max_tokens is None and cfg.dataset.batch_size is None:
            raise FeedbackUsageError("set a batch size with --max-tokens or --batch-size")


def continued_checkpoint(cfg):
    """(path, how it was named) of the checkpoint fairseq-train will continue
    from, or None: checkpoint_last.pt in --save-dir (or, cut short, what
    checkpoints.py resumes from instead), else --restore-file when named
    (which fairseq-train silently replaces by a fresh model when it does not
    exist), else --finetune-from-model."""
    checkpoint = cfg.checkpoint
    if cfg.distributed_training.use_sharded_state:
        return None  # one file per rank, named by fairseq-train as it runs
    suffix = checkpoint.checkpoint_suffix or ""
    if checkpoint.restore_file != "checkpoint_last.pt":
        named = ("--restore-file", checkpoint.restore_file.replace(".pt", suffix + ".pt"))
    else:
        last = os.path.join(checkpoint.save_dir, f"checkpoint_last{suffix}.pt")
        if os.path.exists(last):
            newest = last if is_complete(last) else newest_complete_checkpoint(checkpoint.save_dir, suffix)
            return None if newest is None else (newest, "--save-dir")  # none: checkpoints.py names it
        named = ("--finetune-from-model", checkpoint.finetune_from_model)
    option, path = named
    if path is None:
        return None
    if not os.path.isfile(path):
        raise FeedbackUsageError(f"{option} {path} not found: check the path")
    return path, option


# The model options that may change when training continues from a checkpoint: regularisation,
# how the model is computed and how long its inputs may be. Any other option makes another model.
MAY_CHANGE = {
    "dropout", "attention_dropout", "activation_dropout", "relu_dropout", "adaptive_softmax_dropout",
    "encoder_layerdrop", "decoder_layerdrop", "quant_noise_pq", "quant_noise_pq_block_size", "quant_noise_scalar",
    "adaptive_span_loss", "adaptive_span_init", "checkpoint_activations", "offload_activations", "min_params_to_wrap",
    "cuda_graphs", "no_cuda_graphs", "tpu", "max_source_positions", "max_target_positions", "tokens_per_sample",
}
# Options that fairseq's build_model overwrites from another one when that one is set (so a checkpoint
# records what the command line did not say): compared through the other.
DERIVED = {"share_decoder_input_output_embed": "share_all_embeddings", "encoder_layers": "encoder_layers_to_keep",
           "decoder_layers": "decoder_layers_to_keep"}
INSTEAD = {"--save-dir": "start in another --save-dir", "--restore-file": "drop --restore-file",
           "--finetune-from-model": "drop --finetune-from-model"}


def check_continued_as_trained(cfg, model, checkpoint, named) -> None:
    """Training continues a model with the options it was trained with, and
    with its objective: fairseq would build the model this command line
    describes and fail to load the parameters into it (a traceback), or load
    them into a model that computes something else, or train them on
    another objective, without a word."""
    recorded = recorded_configuration(checkpoint)
    if recorded is None:
        return
    instead = INSTEAD[named]
    labels, given = _option(recorded.task, "labels", None), cfg.task.get("labels")
    if labels and not given:
        raise FeedbackUsageError(f"{checkpoint} was trained with --labels {labels}, to predict labels: continue it "
                                 f"with --task feedback_language_modeling --labels {labels}, or {instead}")
    if given and not labels:
        raise FeedbackUsageError(f"{checkpoint} was trained without --labels, to predict the next token: "
                                 f"drop --labels {given}, or {instead}")
    trained = model_class(recorded.model)
    if trained is not None and trained is not model:
        raise FeedbackUsageError(f"{checkpoint} holds a {_model_name(trained)} model, and this command line builds "
                                 f"a {_model_name(model)}: continue it with its --arch, or {instead}")
    differ = [(name, _option(recorded.model, name), _option(cfg.model, name))
              for name in sorted(model_options(model) - MAY_CHANGE)
              if not (name in DERIVED and any(_option(options, DERIVED[name], None)
                                              for options in (recorded.model, cfg.model)))]
    differ = [(name, was, now) for name, was, now in differ
              if _MISSING not in (was, now) and not _same(was, now)]
    if differ:
        was = " ".join(f"{_flag(name)} {value}" for name, value, _ in differ)
        now = " ".join(f"{_flag(name)} {value}" for name, _, value in differ)
        raise FeedbackUsageError(f"{checkpoint} was trained with {was}, and this command line asks for {now}: "
                                 f"continue it with {was}, or {instead}")


def check_read_as_trained(cfg, checkpoint, tool) -> None:
    """A checkpoint given to a tool (--path): complete, and read as what it
    was trained for. fairseq-validate reads the objective from the
    checkpoint; the other tools take it from the command line."""
    recorded = recorded_configuration(checkpoint)
    if recorded is None:
        return
    labels, given = _option(recorded.task, "labels", None), cfg.task.get("labels")
    if labels and tool in ("eval_lm", "generate", "interactive"):
        does = "scores" if tool == "eval_lm" else "generates"
        raise FeedbackUsageError(f"{checkpoint} was trained with --labels {labels}: it predicts labels, not the next "
                                 f"token that fairseq-{tool.replace('_', '-')} {does}; score it with "
                                 "feedback-evaluate-toy, or fairseq-validate")
    if given and not labels:
        raise FeedbackUsageError(f"{checkpoint} was trained without --labels, to predict the next token: "
                                 f"drop --labels {given}")
    if tool in ("generate", "interactive"):
        check_direction(cfg, recorded, checkpoint)


def check_direction(cfg, recorded, checkpoint) -> None:
    """A translation model is read in the direction it was trained: with -s
    and -t swapped, fairseq feeds target-language text to the encoder (with
    a joined dictionary, or dictionaries of equal size, it translates
    nonsense with exit status 0; otherwise the dictionaries' sizes differ)."""
    trained = language_pair(recorded.task)  # recorded by fairseq-train with the plugin (check_data)
    asked = language_pair(cfg.task)
    if None in trained or None in asked or trained == asked or trained != asked[::-1]:
        return
    src, tgt = trained
    raise FeedbackUsageError(f"{checkpoint} translates {src} to {tgt}, and this command line asks for {tgt} to "
                             f"{src}: pass -s {src} -t {tgt} (a model translates the direction it was trained in; "
                             f"for {tgt} to {src}, train one with -s {tgt} -t {src})")


_MISSING = object()


def _option(options, name, missing=_MISSING):
    """An option of a configuration (a dict, omegaconf's, or an argparse Namespace); `missing` if it has none."""
    if isinstance(options, argparse.Namespace):
        return getattr(options, name, missing)
    return options.get(name, missing)


def _same(a, b) -> bool:
    """Two values of an option, as a command line and a checkpoint hold them (a number may be a string)."""
    a_number, b_number = _number(a), _number(b)
    if a_number is not None and b_number is not None:
        return a_number == b_number
    return str(a) == str(b)


@functools.lru_cache(maxsize=None)
def model_options(model) -> frozenset:
    """The names of a model class's options, as its add_args declares them."""
    parser = argparse.ArgumentParser(add_help=False)
    model.add_args(parser)
    return frozenset(action.dest for action in parser._actions)


def _model_name(model) -> str:
    return next((name for name, cls in MODEL_REGISTRY.items() if cls is model), model.__name__)
