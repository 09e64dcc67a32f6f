"""Option values from the command line, checked before the tool runs: the streaming task's blocks and
batches of streams, fairseq's numeric options by their ranges, the options that go together, those
given as Python literals, the layers to keep, and the devices (ranks fairseq would spawn on no GPU,
half precision where fairseq cannot compute it as asked). command_line.py calls them in order."""

import argparse
import ast
import importlib.util

import torch
from omegaconf import ListConfig

from ..errors import FeedbackUsageError
from ..models.feedback_config import check_feedback_args
from ..models.plugin_model import PluginModel

MISSING = object()


def option(options, name, missing=MISSING):
    """An option of a configuration (a dict, omegaconf's, or an argparse Namespace); `missing` if it has none."""
    if isinstance(options, argparse.Namespace):
        return getattr(options, name, missing)
    return options.get(name, missing)


def flag(name) -> str:
    return "--" + name.replace("_", "-")


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
            raise FeedbackUsageError(f"--task feedback_language_modeling does not use {flag(name)}: "
                                     "its streams run across lines, block after block; drop the option, or use "
                                     "--task language_modeling")
    for rows_name, tokens_name in (("batch_size", "max_tokens"), ("batch_size_valid", "max_tokens_valid")):
        rows, tokens = cfg.dataset.get(rows_name), cfg.dataset.get(tokens_name)
        if rows is not None and rows < 1:
            raise FeedbackUsageError(f"{flag(rows_name)} must be at least 1, got {rows}: it counts the streams "
                                     "of a batch")
        if tokens is not None and tokens < block:
            raise FeedbackUsageError(f"{flag(tokens_name)} {tokens} holds no block of --tokens-per-sample "
                                     f"{block}: raise it, or give the streams per batch with {flag(rows_name)}")



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
        given = option(model_cfg, f"{side}_layers_to_keep", None)
        if not given:
            continue
        layers = number(option(model_cfg, f"{side}_layers", None))
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
            check_ranges(options, COMPONENT_RANGES.get((name, option(options, "_name", None)), {}))
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


def check_structured_options(cfg) -> None:
    """Options given as Python literals, which fairseq evaluates where it uses them (an optimizer's betas
    at its first step): of the shape and types they must have."""
    optimizer = cfg.get("optimizer") or {}
    for name in ("adam_betas", "adamax_betas", "lamb_betas"):
        given = option(optimizer, name, None)
        betas = _literal(given)
        if isinstance(given, str) and not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(
                number(beta) is not None and PROBABILITY[0](beta) for beta in betas)):
            raise FeedbackUsageError(f"{flag(name)} must be two numbers in [0, 1), as '(0.9, 0.98)', got {given!r}")
    given = option(cfg.get("common_eval") or {}, "model_overrides", None)
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
            given = flag(half) if half in ("memory_efficient_bf16", "bf16") else "--tpu"
            raise FeedbackUsageError(f"{given} computes on a TPU in fairseq (--bf16 implies --tpu), through torch_xla, "
                                     f"which is not installed: drop {given} (on a GPU: --fp16 or --amp)")
    elif no_gpu and common.get("amp"):
        raise FeedbackUsageError(f"--amp autocasts to half precision on a GPU, and {no_gpu} (fairseq would compute "
                                 "in float32): drop --amp, or use --fp16")
    elif no_gpu and training and half == "fp16" and not common.get("fp16_no_flatten_grads"):
        raise FeedbackUsageError(f"--fp16 training keeps its float32 weights flattened on a GPU, and {no_gpu}: add "
                                 "--fp16-no-flatten-grads to train in float16 on the CPU, or drop --fp16")


def check_ranges(options, ranges) -> None:
    for name, (valid, bound) in ranges.items():
        given = getattr(options, name, None)
        for value in map(number, given if isinstance(given, (list, tuple, ListConfig)) else [given]):
            if value is not None and not valid(value):
                raise FeedbackUsageError(f"--{name.replace('_', '-')} must be {bound}, got {value}")


def number(value):
    """An option's number; None if it has none yet (unset, or an interpolation
    of another option's value). fairseq's parser leaves the options it fills
    by interpolation, such as --decoder-output-dim, as strings."""
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


