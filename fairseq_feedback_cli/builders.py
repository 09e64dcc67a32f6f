"""Dictionaries and models built from command-line flags, as fairseq-train builds them.

Used by feedback-benchmark and the tests, so that both measure and check the
models exactly as fairseq's own option parsing and registries make them, and
with their options checked as fairseq-train with the plugin checks them.
"""

from typing import Optional, Sequence

import torch
from fairseq import options
from fairseq.data import Dictionary
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.tasks import TASK_REGISTRY
from fairseq.tasks.translation import TranslationTask

from fairseq_feedback.fairseq_fixes.option_values import check_model_options
from fairseq_feedback.fairseq_fixes.patches import silence_hydra_deprecations

silence_hydra_deprecations()  # fairseq's configuration, composed here as fairseq's tools compose it


def make_dictionary(size: int) -> Dictionary:
    """fairseq's special symbols, then w0, w1, ...: `size` symbols in all."""
    dictionary = Dictionary()
    for i in range(size - dictionary.nspecial):
        dictionary.add_symbol(f"w{i}")
    return dictionary


def size_flags(side: str, embed_dim: int, ffn_dim: int, heads: int, layers: int) -> list:
    """The options sizing fairseq's "encoder" or "decoder" side."""
    return [f"--{side}-embed-dim", str(embed_dim), f"--{side}-ffn-embed-dim", str(ffn_dim),
            f"--{side}-attention-heads", str(heads), f"--{side}-layers", str(layers)]


def _parse(task: str, arch: str, flags: Sequence):
    return options.parse_args_and_arch(options.get_training_parser(),
                                       ["unused", "--task", task, "--arch", arch, *map(str, flags)])


def translation_model(arch: str, flags: Sequence, dictionary: Dictionary, seed: Optional[int] = None):
    """A model of the translation task with `dictionary` on both sides; `seed`
    seeds torch just before the weights are drawn."""
    args = _parse("translation", arch, flags)
    check_model_options(args, ARCH_MODEL_REGISTRY[arch])
    if seed is not None:
        torch.manual_seed(seed)
    return TranslationTask(args, dictionary, dictionary).build_model(args)


def language_model(arch: str, task: str, flags: Sequence, dictionary: Dictionary,
                   output_dictionary: Optional[Dictionary] = None, seed: Optional[int] = None):
    """(model, task) of a language-modelling task; `output_dictionary` (the
    labels of feedback_language_modeling --labels) defaults to `dictionary`."""
    cfg = convert_namespace_to_omegaconf(_parse(task, arch, flags))
    check_model_options(cfg.model, ARCH_MODEL_REGISTRY[arch])
    lm_task = TASK_REGISTRY[task](cfg.task, dictionary, output_dictionary)
    if seed is not None:
        torch.manual_seed(seed)
    return lm_task.build_model(cfg.model), lm_task


def training_config(flags: Sequence):
    """fairseq-train's configuration for `flags` (its training options: the
    optimizer, --fp16 and the loss scale), parsed as for any model."""
    return convert_namespace_to_omegaconf(_parse("translation", "transformer", flags))
