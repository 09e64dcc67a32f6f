"""What both models of this plugin add to fairseq's (TransformerModel, TransformerLanguageModel), the
decoder they build, and the task each goes with."""

import argparse
import os
from typing import Optional

from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.tasks.language_modeling import LanguageModelingTask

from .. import checkpoint_files
from ..cuda_graphs import GraphStatistics
from ..errors import FeedbackUsageError
from ..safe_checkpoints import fairseq_checkpoints_allowed
from .feedback_decoder import FeedbackDecoder
from .transformer_xl_decoder import TransformerXLDecoder


def build_decoder(cfg, dictionary, embed_tokens, no_encoder_attn=False):
    """The feedback decoder, or with --no-feedback the paper's Transformer baseline."""
    decoder = TransformerXLDecoder if cfg.no_feedback else FeedbackDecoder
    return decoder(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn)


class PluginModel:
    # a language model or not: which of fairseq's kinds of task it goes with, and else what to use
    language_model: bool
    wrong_task: str
    # fairseq's "attn" (the alignment) comes from incremental decoding alone: none when scored teacher-forced
    aligns_as_it_decodes_only = True

    @classmethod
    def hub_models(cls):
        return {}  # fairseq's transformers name downloads that are not feedback models

    @classmethod
    def from_pretrained(cls, model_name_or_path, checkpoint_file="model.pt", *args, **kwargs):
        """fairseq's hub, loading under torch's weights-only rule with the classes
        fairseq stores allowed for this load alone (safe_checkpoints.py): a
        program of one's own that imports the plugin is otherwise left as it was.
        A checkpoint that rule refuses is named (checkpoint_files.read) without
        torch's advice to load it with weights_only=False, which would run the
        code it carries."""
        for name in checkpoint_file.split(os.pathsep):  # a file that is no checkpoint: FeedbackUsageError
            if os.path.exists(os.path.join(model_name_or_path, name)):
                checkpoint_files.read(os.path.join(model_name_or_path, name))
        with fairseq_checkpoints_allowed():
            return super().from_pretrained(model_name_or_path, checkpoint_file, *args, **kwargs)

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        check_dictionary_sizes(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)

    def graph_statistics(self) -> Optional[GraphStatistics]:
        """What the CUDA graphs of the feedback loop have done: graphs captured
        and held, their bytes, calls and hits, why they gave up. None where the
        loop runs eagerly: --cuda-graphs off, the Transformer baseline, or no
        call yet (or none on a device that replays graphs)."""
        graphed = getattr(self.decoder, "graphed", None)
        return None if graphed is None else graphed.statistics()


def check_model_and_task(model, task) -> None:
    """The model goes with the task (both classes), all that is wrong in one line:
    a model of this plugin goes with a language-modelling task or with another
    (`language_model`), and a task of this plugin takes one model (its
    `takes_model`), each saying what to use instead."""
    problems = []
    if issubclass(model, PluginModel) and model.language_model != issubclass(task, LanguageModelingTask):
        problems.append(model.wrong_task)
    takes = getattr(task, "takes_model", None)
    if takes is not None and not issubclass(model, takes):
        problems.append(task.wrong_model)
    if problems:
        raise FeedbackUsageError("; ".join(problems))


def model_class(model_cfg) -> Optional[type]:
    """The class an architecture's configuration (or a checkpoint's record of
    it) builds, as fairseq's build_model finds it (None: none)."""
    if model_cfg is None:
        return None
    get = (lambda name: getattr(model_cfg, name, None)) if isinstance(model_cfg, argparse.Namespace) else \
        (lambda name: model_cfg.get(name, None))
    return ARCH_MODEL_REGISTRY.get(get("_name") or get("arch"))


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
