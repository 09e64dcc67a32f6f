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
- fairseq's own options at values that mean nothing (sizes of zero or
  less, probabilities outside [0, 1), rates of zero): the model's, the
  batches', the training loop's, the optimizer's, the scheduler's, the
  criterion's, generation's; those that go together (--nbest and --beam);
  those given as Python literals (--adam-betas, --model-overrides); ranks
  that fairseq would spawn on no GPU; and half precision, which fairseq
  computes on a GPU (or a TPU) only;
- the decoder's options (models/feedback_config.py, beside their
  definitions);
- the data: the directories, a translation task's language pair, the
  dictionaries (read by fairseq, whose checks of their format so come
  first), the splits the tool reads (present, not empty, not cut short, of
  no token beyond their dictionary);
- the checkpoints named on the command line (present, and complete) and
  the one training continues from, against what they were trained with
  (read from the checkpoint): training continues a model with the options
  it was trained with, and the objective (--labels); a model trained to
  predict labels is not scored or sampled as a language model; and what
  --model-overrides changes of it.

Every tool also checks a split as fairseq loads it (check_binarized), and
the models and tasks check their pairing as they are built
(models/plugin_model.py, check_model_and_task).
"""

import argparse
import ast
import functools
import importlib.util
import os
import struct
import types

import numpy as np
import torch

from fairseq import utils
from fairseq.data import Dictionary, data_utils, indexed_dataset
from fairseq.models import MODEL_REGISTRY
from fairseq.tasks import TASK_REGISTRY
from fairseq.tasks.language_modeling import LanguageModelingTask
from fairseq.tasks.translation import TranslationTask
from omegaconf import ListConfig

from ..errors import FeedbackUsageError
from ..models import FeedbackLanguageModel
from ..models.feedback_config import check_feedback_args, may_change_on_resume
from ..models.plugin_model import PluginModel, check_model_and_task, model_class
from ..tasks import FeedbackLanguageModelingTask
from ..tasks.adaptive_span_loss import AdaptiveSpanLossMixin
from ..tasks.feedback_language_modeling import check_block
from ..tasks.splits import labels_dictionary, monolingual_split
from .checkpoints import checkpoint_to_resume, recorded_configuration
from .model_overrides import check_overridden_model


def check_tool(cfg, tool: str) -> None:
    """`tool`: the name of its module in fairseq_cli (train, eval_lm, ...)."""
    model = model_class(cfg.get("model"))  # only training builds a model from the command line
    _check(cfg, model, training_splits(cfg) if model is not None else scored_splits(cfg, tool), tool)


def check_generate(cfg) -> None:
    """fairseq-generate: the model comes from --path (its parser's --arch is a
    placeholder), and it reads --gen-subset."""
    _check(cfg, None, [(utils.split_paths(cfg.task.data)[0], cfg.dataset.gen_subset)], "generate")


def _check(cfg, model, reads, tool) -> None:
    task = TASK_REGISTRY.get(getattr(cfg.get("task"), "_name", None))
    if model is not None and task is not None:
        check_model_and_task(model, task)
        check_trained_by_task(cfg.model, task)
    if task is not None and issubclass(task, FeedbackLanguageModelingTask):
        check_streams(cfg)
        check_labels(cfg, training=model is not None)
    check_fairseq_options(cfg)
    check_shards(cfg, tool)
    check_precision(cfg, training=model is not None)
    if model is not None:
        check_model_options(cfg.model, model)
        check_positions(cfg, model)
    if task is not None and cfg.task.get("data"):
        check_data(cfg, task, reads, training=model is not None)
    check_checkpoints(cfg, model, tool)


# --- the model and the task ----------------------------------------------------------------------


def check_trained_by_task(model_cfg, task) -> None:
    """Learned spans need their loss added and their values kept in range,
    which only this plugin's tasks do."""
    if getattr(model_cfg, "adaptive_span", False) and not issubclass(task, AdaptiveSpanLossMixin):
        raise FeedbackUsageError("--adaptive-span is trained by this plugin's tasks, which add --adaptive-span-loss "
                                 "and keep the spans in range: use --task feedback_translation "
                                 "(feedback_language_modeling for a language model), or drop --adaptive-span")


def check_positions(cfg, model) -> None:
    """A feedback language model with absolute positions has as many as it has: blocks fit in them."""
    if issubclass(model, FeedbackLanguageModel) and not cfg.model.no_token_positional_embeddings:
        check_block(cfg.task.tokens_per_sample, cfg.model.max_target_positions)


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
    path = labels_dictionary(args.data, args.labels)
    labels = Dictionary.load(path)
    if args.ignore_label != "_" and args.ignore_label not in labels:  # labels may need no `_`: all scored
        raise FeedbackUsageError(f"--ignore-label {args.ignore_label!r} is not a label of {args.labels} (its "
                                 "dict.txt): pass the label that marks positions without a target")
    if training:
        for data, split in training_splits(cfg):
            check_monolingual_split(os.path.join(data, args.labels), split, cfg.dataset.dataset_impl,
                                    (path, len(labels)))


def _flag(name) -> str:
    return "--" + name.replace("_", "-")


# --- fairseq's own options -----------------------------------------------------------------------

# The values each of fairseq's numeric options can work with: fairseq takes the others silently
# (a --label-smoothing of 1.5, a negative --lr or --weight-decay train without a word) or fails
# where it uses them (--update-freq 0: ZeroDivisionError at the first epoch). Options a
# configuration does not have (the encoder's, for a language model; the model's, for a tool that
# reads it from a checkpoint; the optimizer's, the scheduler's and the criterion's but those
# chosen) or leaves unset are skipped; an option of several values (--lr, --update-freq) is
# checked value by value.
AT_LEAST_1 = (lambda v: v >= 1, "at least 1")
AT_LEAST_0 = (lambda v: v >= 0, "at least 0")
ABOVE_0 = (lambda v: v > 0, "greater than 0")
PROBABILITY = (lambda v: 0 <= v < 1, "in [0, 1)")  # dropout of 1 would zero every activation
FRACTION = (lambda v: 0 < v <= 1, "in (0, 1]")
SEED = (lambda v: 0 <= v < 2 ** 32, "in [0, 2**32)")  # numpy's seeds


def or_off(valid_bound):
    """A range, or -1: fairseq's value for "not used"."""
    valid, bound = valid_bound
    return lambda v: v == -1 or valid(v), f"{bound} (or -1: off)"


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
# fairseq's options but the model's, in every section of the configuration that has them
OPTION_RANGES = {
    # batches and data
    **dict.fromkeys(("batch_size", "batch_size_valid", "max_tokens", "max_tokens_valid", "required_batch_size_multiple",
                     "required_seq_len_multiple", "num_shards", "max_valid_steps"), AT_LEAST_1),
    **dict.fromkeys(("num_workers", "data_buffer_size", "shard_id", "curriculum"), AT_LEAST_0),
    # the training loop: its length, updates, validations, checkpoints and logs
    **dict.fromkeys(("update_freq", "validate_interval", "save_interval", "log_interval", "checkpoint_shard_count",
                     "fp16_scale_window", "amp_scale_window", "all_gather_list_size"), AT_LEAST_1),
    **dict.fromkeys(("max_epoch", "max_update", "stop_time_hours", "clip_norm", "validate_interval_updates",
                     "validate_after_updates", "save_interval_updates", "empty_cache_freq", "amp_batch_retries"),
                    AT_LEAST_0),
    **dict.fromkeys(("fp16_init_scale", "amp_init_scale", "min_loss_scale", "threshold_loss_scale"), ABOVE_0),
    "fp16_scale_tolerance": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "seed": SEED,
    # several workers
    **dict.fromkeys(("distributed_world_size", "nprocs_per_node", "model_parallel_size", "bucket_cap_mb",
                     "localsgd_frequency"), AT_LEAST_1),
    # the optimizer
    **dict.fromkeys(("lr", "adam_eps", "adamax_eps"), ABOVE_0),  # --lr 0 trains nothing; an eps of 0 divides by 0
    "weight_decay": AT_LEAST_0,
    **dict.fromkeys(("momentum", "beta1"), PROBABILITY),
    "clip_threshold": ABOVE_0,
    # the learning-rate scheduler
    **dict.fromkeys(("warmup_updates", "end_learning_rate", "min_lr", "lr_patience", "warmup_steps", "hold_steps",
                     "decay_steps"), AT_LEAST_0),
    **dict.fromkeys(("power", "t_mult", "init_lr_scale", "final_lr_scale"), ABOVE_0),
    **dict.fromkeys(("lr_shrink", "lr_decay"), FRACTION),
    **dict.fromkeys(("total_num_update", "lr_deacy_period"), AT_LEAST_1),  # sic: fairseq's step scheduler
    "warmup_init_lr": or_off(AT_LEAST_0),
    "lr_period_updates": or_off(ABOVE_0),
    # the criterion
    "label_smoothing": PROBABILITY,  # 1 would make every target uniform
    "ignore_prefix_size": AT_LEAST_0,
    # generation and scoring
    **dict.fromkeys(("beam", "nbest", "softmax_batch"), AT_LEAST_1),
    **dict.fromkeys(("max_len_a", "max_len_b", "min_len", "no_repeat_ngram_size", "prefix_size", "context_window",
                     "iter_decode_max_iter", "buffer_size"), AT_LEAST_0),
    "temperature": ABOVE_0,
    "sampling_topk": or_off(AT_LEAST_1),
    "sampling_topp": or_off(FRACTION),
    "diverse_beam_groups": or_off(AT_LEAST_1),
}
# the sections of fairseq's configuration that OPTION_RANGES covers (the model's and the task's are
# checked with the model and the task)
SECTIONS = ("common", "distributed_training", "dataset", "optimization", "checkpoint", "generation", "eval_lm",
            "interactive", "optimizer", "lr_scheduler", "criterion")
# options whose range depends on the component that reads them: (section, its _name): ranges
COMPONENT_RANGES = {
    ("lr_scheduler", "inverse_sqrt"): {
        "warmup_updates": (lambda v: v >= 1, "at least 1 with --lr-scheduler inverse_sqrt, which divides by it")},
}


def check_model_options(model_cfg, model) -> None:
    """The options of a model trained (or built from options): fairseq's, then the decoder's."""
    check_ranges(model_cfg, MODEL_RANGES)
    check_layers_to_keep(model_cfg)
    if issubclass(model, PluginModel):
        check_feedback_args(model_cfg)


def check_layers_to_keep(model_cfg) -> None:
    """--encoder-layers-to-keep and --decoder-layers-to-keep: numbers of layers of the model, each once.
    fairseq builds as many layers as the list has items, whatever they are ('x' trained one layer)."""
    for side in ("encoder", "decoder"):
        given = _option(model_cfg, f"{side}_layers_to_keep", None)
        if not given:
            continue
        layers = _number(_option(model_cfg, f"{side}_layers", None))
        keep = [number.strip() for number in str(given).split(",")]
        if not all(number.isdigit() for number in keep) or len(set(keep)) < len(keep) \
                or (layers is not None and max(map(int, keep)) >= layers):
            raise FeedbackUsageError(f"--{side}-layers-to-keep must be numbers of layers below --{side}-layers "
                                     f"{layers}, each once, as '0,2', got {given!r}")


def check_fairseq_options(cfg) -> None:
    """The options of fairseq's sections, by their ranges, and those that go together."""
    for name in SECTIONS:
        options = cfg.get(name)
        if options is not None:
            check_ranges(options, OPTION_RANGES)
            check_ranges(options, COMPONENT_RANGES.get((name, _option(options, "_name", None)), {}))
    check_structured_options(cfg)
    dataset, task = cfg.get("dataset"), cfg.get("task")
    if dataset is not None and (getattr(task, "num_batch_buckets", None) or 0) > 0 \
            and getattr(dataset, "max_tokens", None) is None:
        # fairseq asserts it deep in its batching (FairseqDataset.adjust_bsz)
        raise FeedbackUsageError("--num-batch-buckets batches by tokens: add --max-tokens")
    if dataset is not None and dataset.shard_id >= dataset.num_shards:
        raise FeedbackUsageError(f"--shard-id {dataset.shard_id} is not below --num-shards {dataset.num_shards}: "
                                 "shards count from 0")
    generation = cfg.get("generation")
    if generation is not None and generation.max_len_a == 0 and generation.max_len_b < generation.min_len:
        raise FeedbackUsageError(f"--max-len-b {generation.max_len_b} is below --min-len {generation.min_len}: "
                                 "no output could be that long; raise --max-len-b (or --max-len-a)")
    if generation is not None and generation.nbest > generation.beam:
        raise FeedbackUsageError(f"--nbest {generation.nbest} is more than --beam {generation.beam}: a search keeps "
                                 "--beam hypotheses; raise --beam, or lower --nbest")
    check_spawned_ranks(cfg)


def check_shards(cfg, tool) -> None:
    """--num-shards and --shard-id shard the split of fairseq-eval-lm and fairseq-generate (patches.py);
    the other tools took them without a word and read their data whole."""
    dataset = cfg.get("dataset")
    if tool not in ("eval_lm", "generate") and dataset is not None and dataset.num_shards > 1:
        raise FeedbackUsageError(f"fairseq-{tool.replace('_', '-')} reads its data whole, not by --num-shards: those "
                                 "shard the split of fairseq-generate and fairseq-eval-lm; drop --num-shards and "
                                 "--shard-id")


def check_structured_options(cfg) -> None:
    """Options given as Python literals, which fairseq evaluates where it uses them (an optimizer's betas
    at its first step): of the shape and types they must have."""
    optimizer = cfg.get("optimizer") or {}
    for name in ("adam_betas", "adamax_betas", "lamb_betas"):
        given = _option(optimizer, name, None)
        betas = _literal(given)
        if isinstance(given, str) and not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(
                _number(beta) is not None and PROBABILITY[0](beta) for beta in betas)):
            raise FeedbackUsageError(f"{_flag(name)} must be two numbers in [0, 1), as '(0.9, 0.98)', got {given!r}")
    given = _option(cfg.get("common_eval") or {}, "model_overrides", None)
    overrides = model_overrides(given)
    if given is not None and not (isinstance(overrides, dict) and all(isinstance(name, str) for name in overrides)):
        raise FeedbackUsageError(f"--model-overrides must be a Python dict of option names and values, as "
                                 f"\"{{'dropout': 0.1}}\", got {given!r}")


def model_overrides(given):
    """--model-overrides as fairseq evaluates it (None where it cannot: not a literal)."""
    return _literal(given) if isinstance(given, str) else given


def _literal(text):
    """The Python literal a text holds (None if it holds none), as ast reads it without running it."""
    try:
        return ast.literal_eval(text) if isinstance(text, str) else None
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def check_spawned_ranks(cfg) -> None:
    """fairseq starts one process per GPU for distributed training that it launches itself (without
    --distributed-no-spawn): with none, it starts none and ends with exit status 0, having trained nothing."""
    distributed = cfg.get("distributed_training")
    if distributed is None or distributed.distributed_no_spawn or distributed.get("tpu") \
            or distributed.distributed_init_method is None or torch.cuda.device_count() > 0:
        return
    raise FeedbackUsageError("fairseq starts one process per GPU for --distributed-init-method, and torch sees none: "
                             "on CPUs, start one process per rank with --distributed-no-spawn --distributed-rank R "
                             "(and --cpu --distributed-backend gloo)")


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
        given = getattr(options, name, None)
        for value in map(_number, given if isinstance(given, (list, tuple, ListConfig)) else [given]):
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
        dictionary = read_dictionary(os.path.join(paths[0], "dict.txt"))
        for path, split in reads:
            check_monolingual_split(path, split, impl, dictionary)
    elif issubclass(task, TranslationTask):
        src, tgt = language_pair(cfg.task)
        if src is None or tgt is None:
            raise FeedbackUsageError(f"no binarized data found in {paths[0]}: check the data directory, "
                                     "or pass --source-lang and --target-lang")
        dictionaries = {lang: read_dictionary(os.path.join(paths[0], f"dict.{lang}.txt")) for lang in (src, tgt)}
        for path, split in reads:
            _bilingual_split(path, split, src, tgt, impl, dictionaries)
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


def check_binarized(prefix: str, dictionary=None) -> None:
    """A binarized split fairseq can read: with lines (a split of none is an
    empty .bin, as every line holds at least its end-of-sentence token, and
    numpy cannot map an empty file), not cut short (fairseq would read past
    the end of a file, at some batch of some epoch) and, given its
    `dictionary` (its path and its number of symbols), of no token beyond it
    (binarized with another dictionary, or read with one cut short: the
    model's embedding would fail at some batch)."""
    data, index = indexed_dataset.data_file_path(prefix), indexed_dataset.index_file_path(prefix)
    if os.path.isfile(data) and os.path.getsize(data) == 0:
        raise FeedbackUsageError(f"{data} holds no lines (fairseq-preprocess was given an empty file): "
                                 "binarize the split again from a file with text")
    if not (os.path.isfile(data) and os.path.isfile(index)):
        return
    layout = _mmap_layout(index)
    if layout is None:  # another of fairseq's formats (--dataset-impl lazy or cached): fairseq checks it
        return
    *expected, dtype = layout
    again = "binarize the split again with fairseq-preprocess"
    for path, size in zip((index, data), expected):
        if os.path.getsize(path) != size:
            raise FeedbackUsageError(f"{path} holds {os.path.getsize(path)} bytes where {os.path.basename(index)} "
                                     f"counts {size}: it was cut short (or is of another binarization); {again}")
    if dictionary is not None and expected[1] > 0:
        path, symbols = dictionary
        largest = int(np.memmap(data, dtype=dtype, mode="r").max())  # one pass over the file, as numpy maps it
        if largest >= symbols:
            raise FeedbackUsageError(f"{data} holds token {largest}, and {path} has {symbols} symbols (with "
                                     "fairseq's 4 special ones): the split was binarized with another dictionary; "
                                     f"use the dictionary fairseq-preprocess wrote with it, or {again}")


# the index of fairseq's mmap format: a magic, version (<Q), dtype code (<B) and lines (<Q), then each
# line's size (int32), then each line's offset in bytes in the .bin (int64)
MMAP_HEADER = struct.Struct("<9sQBQ")


def _mmap_layout(index: str):
    """(index bytes, data bytes, dtype of the tokens) that an index in
    fairseq's mmap format counts, or None for an index in another format."""
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
        dtype = np.dtype(indexed_dataset._code_to_dtype[code])
        index_bytes = MMAP_HEADER.size + 12 * lines
        if lines == 0:
            return index_bytes, 0, dtype
        if os.path.getsize(index) < index_bytes:
            raise cut_short
        f.seek(MMAP_HEADER.size + 4 * (lines - 1))  # the last line's size, then its offset
        (size,) = struct.unpack("<i", f.read(4))
        f.seek(MMAP_HEADER.size + 4 * lines + 8 * (lines - 1))
        (offset,) = struct.unpack("<q", f.read(8))
    return index_bytes, offset + size * dtype.itemsize, dtype


def check_split(prefix: str, impl, missing: str, dictionary=None) -> None:
    """A split fairseq-preprocess wrote (PREFIX.bin and .idx), readable; `missing` says what to do without it."""
    if not indexed_dataset.dataset_exists(prefix, impl=impl):
        raise FeedbackUsageError(missing)
    check_binarized(prefix, dictionary)


def check_monolingual_split(data: str, split: str, impl=None, dictionary=None) -> None:
    """DATA/SPLIT (fairseq-preprocess --only-source), present and readable."""
    check_binarized(monolingual_split(data, split, impl), dictionary)


def _bilingual_split(data: str, split: str, src: str, tgt: str, impl, dictionaries) -> None:
    """DATA/SPLIT.SRC-TGT.{SRC,TGT} (or TGT-SRC), as fairseq's translation task reads it; `dictionaries`
    by language."""
    pair = next((p for p in (f"{src}-{tgt}", f"{tgt}-{src}")
                 if indexed_dataset.dataset_exists(os.path.join(data, f"{split}.{p}.{src}"), impl=impl)), None)
    expected = f"{split}.{src}-{tgt}.{src}.bin/.idx and {split}.{src}-{tgt}.{tgt}.bin/.idx"
    for lang in (src, tgt):
        check_split(os.path.join(data, f"{split}.{pair or f'{src}-{tgt}'}.{lang}"), impl,
                    f"split '{split}' not found in {data}: expected {expected} from fairseq-preprocess",
                    dictionaries[lang])


def read_dictionary(path: str):
    """(path, number of symbols) of a dictionary that the task will read, read by fairseq's
    Dictionary.load, whose checks of its format (a word twice, a line without its count) so fail
    before the tool creates anything."""
    return path, len(Dictionary.load(path))


def scored_splits(cfg, tool: str):
    """(data directory, split) of what fairseq-eval-lm and fairseq-validate score (no other tool without
    a model to train reads a split)."""
    splits = {"eval_lm": [cfg.dataset.gen_subset], "validate": cfg.dataset.valid_subset.split(",")}.get(tool, [])
    return [(utils.split_paths(cfg.task.data)[0], split) for split in splits]


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
        if not os.path.exists(checkpoint):  # a folder: named by checkpoint_files
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
    from, or None: the one --save-dir resumes from
    (checkpoints.py), else --restore-file when named (which fairseq-train
    silently replaces by a fresh model when it does not exist), else
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
    option, path = named
    if path is None:
        return None
    if not os.path.exists(path):
        raise FeedbackUsageError(f"{option} {path} not found: check the path")
    return path, option


# The model options that may change when training continues from a checkpoint: regularisation,
# how the model is computed and how long its inputs may be. Any other option makes another model.
# fairseq's are listed here; this plugin's say so where they are defined (models/feedback_config.py).
MAY_CHANGE = {
    "dropout", "attention_dropout", "activation_dropout", "relu_dropout", "adaptive_softmax_dropout",
    "encoder_layerdrop", "decoder_layerdrop", "quant_noise_pq", "quant_noise_pq_block_size", "quant_noise_scalar",
    "checkpoint_activations", "offload_activations", "min_params_to_wrap",
    "tpu", "max_source_positions", "max_target_positions", "tokens_per_sample",
} | may_change_on_resume()
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
    differ = other_model(model, recorded.model, cfg.model)
    if differ:
        was, now = differ
        raise FeedbackUsageError(f"{checkpoint} was trained with {was}, and this command line asks for {now}: "
                                 f"continue it with {was}, or {instead}")


def other_model(model, a, b):
    """The options of `model` (a class) in which two configurations of it
    (recorded by checkpoints, or a command line's) make other models, as two
    command-line fragments, one for each; None when they make one model
    (they differ at most in what MAY_CHANGE)."""
    differ = [(name, _option(a, name), _option(b, name)) for name in sorted(model_options(model) - MAY_CHANGE)
              if not (name in DERIVED and any(_option(options, DERIVED[name], None) for options in (a, b)))]
    differ = [(name, x, y) for name, x, y in differ if _MISSING not in (x, y) and not _same(x, y)]
    if not differ:
        return None
    return (" ".join(f"{_flag(name)} {x}" for name, x, _ in differ),
            " ".join(f"{_flag(name)} {y}" for name, _, y in differ))


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
    generation = cfg.get("generation") or {}
    if (tool == "generate" and generation.get("score_reference") and generation.get("print_alignment")
            and str(_option(recorded.model, "arch", "")).startswith("feedback_transformer")):
        raise FeedbackUsageError(f"{checkpoint} returns its alignments as it decodes, and --score-reference scores "
                                 "the references teacher-forced: drop --print-alignment, or --score-reference")
    check_overrides(cfg, recorded, checkpoint)


def check_overrides(cfg, recorded, checkpoint) -> None:
    """--model-overrides names options the checkpoint records (fairseq ignores any other), at values
    they can take; what it changes of the model beyond what training may change when it continues
    (MAY_CHANGE) keeps the parameters' shapes, and is said (model_overrides.py)."""
    overrides = model_overrides(_option(cfg.get("common_eval") or {}, "model_overrides", None)) or {}
    unknown = sorted(set(overrides) - recorded.names)
    if unknown:
        raise FeedbackUsageError(f"--model-overrides names {', '.join(unknown)}, which {checkpoint} does not record "
                                 "(fairseq would ignore it): name options as its configuration does, as 'dropout'")
    check_ranges(types.SimpleNamespace(**overrides), {**MODEL_RANGES, **OPTION_RANGES})
    changed = [(name, _option(recorded.model, name), value) for name, value in overrides.items()
               if name not in MAY_CHANGE]
    changed = [(name, was, now) for name, was, now in changed if was is not _MISSING and not _same(was, now)]
    if changed:
        check_overridden_model(checkpoint, recorded, utils.split_paths(cfg.task.data)[0], changed)


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
