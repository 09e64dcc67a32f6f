"""Option values from the command line that fairseq cannot work with and would not refuse in time:
its numeric options by their ranges, options that go together, the layers to keep, the devices.

What fairseq raises as the tool starts (--adam-betas '(0.9)', --seed -1, --decoder-output-dim 0) is
its one line (one_line.py). A check is here only where fairseq is silent (a --label-smoothing of 1.5
and a negative --lr train on; an option nothing reads is taken whatever it is; the process dies without
a word: --required-batch-size-multiple 0, in compiled batching) or late (--nbest 0: once the whole test
set is generated; --update-freq 1,0: as the second epoch begins). Each says which.
"""

import argparse
import importlib.util

import torch

from ..errors import FeedbackUsageError
from ..models.feedback_config import check_feedback_args
from ..models.plugin_model import PluginModel
from ..option_ranges import check_ranges, flag, number

MISSING = object()


def option(options, name, missing=MISSING):
    """An option of a configuration (a dict, omegaconf's, an argparse Namespace); `missing` if it has none."""
    if isinstance(options, argparse.Namespace):
        return getattr(options, name, missing)
    return options.get(name, missing)


# The ranges of fairseq's options (option_ranges.py); an option a configuration lacks or leaves unset is skipped
AT_LEAST_1, AT_LEAST_0, ABOVE_0 = {"at_least": 1}, {"at_least": 0}, {"above": 0}
PROBABILITY = {"at_least": 0, "below": 1}  # a dropout of 1 zeroes every activation

# silent: a model's options (a decoder of no layers trains; --character-embedding-dim without character embeddings)
MODEL_RANGES = {
    **dict.fromkeys(("max_target_positions", "decoder_layers", "decoder_ffn_embed_dim", "encoder_ffn_embed_dim",
                     "character_embedding_dim", "quant_noise_pq_block_size"), AT_LEAST_1),
    **dict.fromkeys(("encoder_layers", "char_embedder_highway_layers"), AT_LEAST_0),
    **dict.fromkeys(("adaptive_input_factor", "adaptive_softmax_factor"), ABOVE_0),
    **dict.fromkeys(("dropout", "activation_dropout", "relu_dropout", "adaptive_softmax_dropout", "encoder_layerdrop",
                     "decoder_layerdrop", "quant_noise_pq", "quant_noise_scalar"), PROBABILITY),
}
# silent: the other options
SILENT_RANGES = {
    # batches and data (--required-batch-size-multiple 0: the process dies in fairseq's compiled batching)
    **dict.fromkeys(("batch_size", "batch_size_valid", "max_tokens", "max_tokens_valid", "required_batch_size_multiple",
                     "num_shards", "max_valid_steps"), AT_LEAST_1),
    **dict.fromkeys(("data_buffer_size", "shard_id", "curriculum"), AT_LEAST_0),
    # the training loop: its length, validations, checkpoints and logs, and half precision's loss scale
    **dict.fromkeys(("validate_interval", "save_interval", "log_interval", "checkpoint_shard_count",
                     "all_gather_list_size"), AT_LEAST_1),
    **dict.fromkeys(("max_epoch", "max_update", "stop_time_hours", "clip_norm", "validate_interval_updates",
                     "validate_after_updates", "save_interval_updates", "empty_cache_freq"), AT_LEAST_0),
    **dict.fromkeys(("min_loss_scale", "threshold_loss_scale"), ABOVE_0),
    "fp16_scale_tolerance": {"at_least": 0, "at_most": 1},
    # several workers
    **dict.fromkeys(("distributed_world_size", "nprocs_per_node", "bucket_cap_mb"), AT_LEAST_1),
    # the optimizer (--lr 0 trains nothing; a negative --adam-eps trains on)
    **dict.fromkeys(("lr", "adam_eps", "clip_threshold"), ABOVE_0),
    "weight_decay": AT_LEAST_0,
    **dict.fromkeys(("momentum", "beta1"), PROBABILITY),
    # the learning-rate scheduler
    **dict.fromkeys(("warmup_updates", "min_lr", "lr_patience"), AT_LEAST_0),
    **dict.fromkeys(("lr_shrink", "lr_decay"), {"above": 0, "at_most": 1}),
    "init_lr_scale": ABOVE_0,
    "warmup_init_lr": {**AT_LEAST_0, "off": -1},
    "lr_period_updates": {**ABOVE_0, "off": -1},
    # the criterion (a label smoothing of 1 makes every target uniform)
    "label_smoothing": PROBABILITY,
    "ignore_prefix_size": AT_LEAST_0,
    # generation and scoring (--temperature: fairseq checks it after --sampling's --nbest, as it builds the search)
    "softmax_batch": AT_LEAST_1, "temperature": ABOVE_0,
    **dict.fromkeys(("max_len_a", "min_len", "no_repeat_ngram_size", "prefix_size", "context_window", "buffer_size"),
                    AT_LEAST_0),
    **dict.fromkeys(("sampling_topk", "diverse_beam_groups"), {**AT_LEAST_1, "off": -1}),
    "sampling_topp": {"above": 0, "at_most": 1, "off": -1},
}
# late: --nbest 0 divides by 0 in BLEU once the whole test set is generated; --update-freq is read epoch
# by epoch (1,0: the second epoch divides by 0); an --adamax-eps of 0 divides by 0 at the first update
LATE_RANGES = {**dict.fromkeys(("nbest", "update_freq"), AT_LEAST_1), "adamax_eps": ABOVE_0}
# the sections of fairseq's configuration that the ranges cover (the model's is checked with the model)
SECTIONS = ("common", "distributed_training", "dataset", "optimization", "checkpoint", "generation", "eval_lm",
            "interactive", "optimizer", "lr_scheduler", "criterion")


def check_model_options(model_cfg, model) -> None:
    """fairseq's options of a model trained (or built from options), then the decoder's."""
    check_ranges(model_cfg, MODEL_RANGES)
    check_layers_to_keep(model_cfg)
    if issubclass(model, PluginModel):
        check_feedback_args(model_cfg)


def check_layers_to_keep(model_cfg) -> None:
    """Silent: --decoder-layers-to-keep (and the encoder's) are numbers of layers, each once (fairseq builds
    as many layers as the list has items: 'x' trained one)."""
    for side in ("encoder", "decoder"):
        given = option(model_cfg, f"{side}_layers_to_keep", None)
        if not given:
            continue
        layers = number(option(model_cfg, f"{side}_layers", None))
        keep = [layer.strip() for layer in str(given).split(",")]
        if not all(layer.isdigit() for layer in keep) or len(set(keep)) < len(keep) \
                or (layers is not None and max(map(int, keep)) >= layers):
            raise FeedbackUsageError(f"--{side}-layers-to-keep must be numbers of layers below --{side}-layers "
                                     f"{layers}, each once, as '0,2', got {given!r}")


def check_fairseq_options(cfg) -> None:
    """fairseq's sections by their ranges, and the options that go together (each silent)."""
    for name in SECTIONS:
        options = cfg.get(name)
        if options is not None:
            check_ranges(options, {**SILENT_RANGES, **LATE_RANGES})
    dataset, task = cfg.get("dataset"), cfg.get("task")
    if dataset is not None and (getattr(task, "num_batch_buckets", None) or 0) > 0 \
            and getattr(dataset, "max_tokens", None) is None:  # fairseq batches without the buckets
        raise FeedbackUsageError("--num-batch-buckets batches by tokens: add --max-tokens")
    if dataset is not None and dataset.shard_id >= dataset.num_shards:  # fairseq reads an empty shard
        raise FeedbackUsageError(f"--shard-id {dataset.shard_id} is not below --num-shards {dataset.num_shards}: "
                                 "shards count from 0")
    generation = cfg.get("generation")
    if generation is not None and generation.nbest > generation.beam:  # fairseq prints fewer than asked
        raise FeedbackUsageError(f"--nbest {generation.nbest} is more than --beam {generation.beam}: a search keeps "
                                 "--beam hypotheses; raise --beam, or lower --nbest")
    check_spawned_ranks(cfg)


def check_shards(cfg, tool) -> None:
    """Silent: the tools but fairseq-eval-lm and fairseq-generate (patches.py) read their data whole."""
    dataset = cfg.get("dataset")
    if tool not in ("eval_lm", "generate") and dataset is not None and dataset.num_shards > 1:
        raise FeedbackUsageError(f"fairseq-{tool.replace('_', '-')} reads its data whole, not by --num-shards: those "
                                 "shard the split of fairseq-generate and fairseq-eval-lm; drop --num-shards and "
                                 "--shard-id")


def check_spawned_ranks(cfg) -> None:
    """Silent: fairseq spawns one process per GPU (without --distributed-no-spawn): with none, it trained
    nothing, exit status 0."""
    distributed = cfg.get("distributed_training")
    if distributed is None or distributed.distributed_no_spawn or distributed.get("tpu") \
            or distributed.distributed_init_method is None or torch.cuda.device_count() > 0:
        return
    raise FeedbackUsageError("fairseq starts one process per GPU for --distributed-init-method, and torch sees none: "
                             "on CPUs, start one process per rank with --distributed-no-spawn --distributed-rank R "
                             "(and --cpu --distributed-backend gloo)")


# fairseq's half precision, as it names its options (first: those that imply another)
HALF_PRECISION = ("memory_efficient_fp16", "memory_efficient_bf16", "fp16", "bf16", "amp")


def check_precision(cfg) -> None:
    """Silent: half precision fairseq does not compute as asked: --amp off a GPU, and --bf16 (it implies
    --tpu) without torch_xla, are float32. (--fp16 on the CPU fails as it starts: fairseq's one line.)"""
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
