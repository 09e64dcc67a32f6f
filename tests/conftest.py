import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import fairseq_feedback  # noqa: E402,F401  (registers the models)
from fairseq import options  # noqa: E402
from fairseq.data import Dictionary  # noqa: E402
from fairseq.tasks.translation import TranslationTask  # noqa: E402

PLUGIN = os.path.join(REPO, "fairseq_feedback")


def make_dictionary(size=24):
    d = Dictionary()
    for i in range(size - d.nspecial):
        d.add_symbol(f"w{i}")
    return d


def tiny_translation_model(*flags, arch="feedback_transformer", dictionary=None, seed=0):
    """A small model built through fairseq's option parsing, as the CLIs build it."""
    dictionary = dictionary or make_dictionary()
    sizes = []
    for side, layers in (("encoder", 2), ("decoder", 3)):
        sizes += [f"--{side}-embed-dim", "16", f"--{side}-ffn-embed-dim", "32",
                  f"--{side}-attention-heads", "2", f"--{side}-layers", str(layers)]
    args = options.parse_args_and_arch(
        options.get_training_parser(), ["unused", "--task", "translation", "--arch", arch, *sizes, *flags]
    )
    torch.manual_seed(seed)
    model = TranslationTask(args, dictionary, dictionary).build_model(args)
    return model, dictionary


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def tiny_lm(*flags, dictionary=None, labels=None, seed=0):
    """A small feedback_lm and its task, built through fairseq's config system."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_feedback.tasks import FeedbackLanguageModelingTask

    dictionary = dictionary or make_dictionary()
    args = options.parse_args_and_arch(
        options.get_training_parser(),
        ["unused", "--task", "feedback_language_modeling", "--arch", "feedback_lm", "--decoder-layers", "3",
         "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "2",
         "--dropout", "0", *flags],
    )
    cfg = convert_namespace_to_omegaconf(args)
    task = FeedbackLanguageModelingTask(cfg.task, dictionary, labels)
    torch.manual_seed(seed)
    return task.build_model(cfg.model), task
